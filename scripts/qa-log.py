#!/usr/bin/env python3
"""Reads the question log `ragkv eval qa --dir D` keeps (`D/qa-log*.jsonl`: a header line, then
one line per question) and prints, per strategy, the teacher-forced agreement with full
prefill and, for a run with `--codec`, with the same stored KV in f16 (`uncompressed`), with
the KL per forced token: the totals of the run's JSON lines (without their intervals, which
the run prints when it ends), available while it still runs.

    scripts/qa-log.py LOG                       totals over the questions logged so far
    scripts/qa-log.py LOG --every 20            the running figures every 20 questions
    scripts/qa-log.py LOG --against OTHER_LOG   the same questions of two runs side by side

With `--against`, only questions both logs hold count, and the questions whose agreeing
decisions differ between the two runs are listed per strategy with both runs' counts (against
the f16 KV for a `--codec` run, else against full prefill): few flips either way is the
evaluation's noise, many in one direction a real change. Then, per strategy in both, the
paired difference of agreement (this run minus the other, in points) with a 95 % bootstrap
interval over questions (2,000 resamples, fixed seed); where both runs share the same
baseline (`naive@context:none`), the difference in gap closed is that divided by the
baseline's distance to 100 %.
"""
import json
import random
import sys


def load(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[0], {q["id"]: q for q in lines[1:]}


def counts(answer, key):
    """(agreeing decisions, decisions, KL sum) of one strategy's answer against `key` (`full`:
    full prefill; `uncompressed`: the same KV in f16), or None where the log has none."""
    if answer["strategy"] == "full":
        return None
    if key == "full":
        return answer["forced_agree"], answer["forced_tokens"], answer["kl_sum"]
    u = answer.get("uncompressed")
    return (u["agree"], u["tokens"], u["kl_sum"]) if u else None


def tally(questions, key):
    """Per strategy: [questions, agreeing decisions, decisions, KL sum] against `key`."""
    out = {}
    for q in questions:
        for a in q["answers"]:
            c = counts(a, key)
            if c is None:
                continue
            t = out.setdefault(a["strategy"], [0, 0, 0, 0.0])
            t[0] += 1
            t[1] += c[0]
            t[2] += c[1]
            t[3] += c[2]
    return out


def show(questions, label):
    for key in ("full", "uncompressed"):
        for name, (n, agree, tokens, kl) in tally(questions, key).items():
            share = 100 * agree / tokens if tokens else float("nan")
            print(
                f"{label}{name} vs {key}: {n} questions, {agree} / {tokens} = {share:.2f} %, "
                f"KL {kl / max(tokens, 1):.4f}"
            )


def paired(mine, other, common, key, resamples=2000):
    """Per strategy both runs answered: agreement here minus there, in points, and its 95 %
    bootstrap interval over the common questions."""
    per = {}
    for i in common:
        theirs = {a["strategy"]: counts(a, key) for a in other[i]["answers"]}
        for a in mine[i]["answers"]:
            m, o = counts(a, key), theirs.get(a["strategy"])
            if m and o and m[1] == o[1]:
                per.setdefault(a["strategy"], []).append((m[0], o[0], m[1]))
    rng = random.Random(0)

    def diff(rows):
        tokens = sum(r[2] for r in rows)
        return 100 * (sum(r[0] for r in rows) - sum(r[1] for r in rows)) / max(tokens, 1)

    for name, rows in per.items():
        draws = sorted(
            diff([rows[rng.randrange(len(rows))] for _ in rows]) for _ in range(resamples)
        )
        lo, hi = draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]
        print(f"paired {name} vs {key}: {diff(rows):+.2f} points [{lo:+.2f}, {hi:+.2f}] "
              f"over {len(rows)} questions")


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    header, qs = load(argv[0])
    print(f"{argv[0]}: {json.dumps(header)}")
    ordered = [qs[i] for i in sorted(qs)]
    if "--every" in argv:
        every = int(argv[argv.index("--every") + 1])
        for end in range(every, len(ordered) + every, every):
            show(ordered[: min(end, len(ordered))], f"[{min(end, len(ordered))}] ")
        return 0
    if "--against" in argv:
        other_path = argv[argv.index("--against") + 1]
        _, other = load(other_path)
        common = sorted(set(qs) & set(other))
        print(f"{len(common)} questions in both logs")
        show([qs[i] for i in common], "this:  ")
        show([other[i] for i in common], "other: ")
        key = "uncompressed" if "codec" in header and header["codec"] else "full"
        for i in common:
            theirs = {a["strategy"]: counts(a, key) for a in other[i]["answers"]}
            for a in qs[i]["answers"]:
                mine, other_c = counts(a, key), theirs.get(a["strategy"])
                if mine and other_c and mine[:2] != other_c[:2]:
                    print(f"  question {i} {a['strategy']} vs {key}: {mine[0]}/{mine[1]} here, "
                          f"{other_c[0]}/{other_c[1]} in the other")
        paired(qs, other, common, key)
        return 0
    show(ordered, "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
