#!/usr/bin/env python3
"""Reads the question log `ragkv eval qa --dir D` keeps (`D/qa-log*.jsonl`: a header line, then
one line per question) and prints, per strategy, the teacher-forced agreement with full
prefill and, for a run with `--codec`, with the same stored KV in f16 (`uncompressed`), with
the KL per forced token: the figures of the run's JSON lines, available while it still runs.

    scripts/qa-log.py LOG                       totals over the questions logged so far
    scripts/qa-log.py LOG --every 20            the running figures every 20 questions
    scripts/qa-log.py LOG --against OTHER_LOG   the same questions of two runs side by side

With `--against`, only questions both logs hold count, and the questions whose agreeing
decisions differ between the two runs are listed per strategy with both runs' counts (against
the f16 KV for a `--codec` run, else against full prefill): few flips either way is the
evaluation's noise, many in one direction a real change.
"""
import json
import sys


def load(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[0], {q["id"]: q for q in lines[1:]}


def tally(questions, key):
    """Per strategy: [questions, agreeing decisions, decisions, KL sum] against `key`
    (`full`: full prefill; `uncompressed`: the same KV in f16)."""
    out = {}
    for q in questions:
        for a in q["answers"]:
            src = a if key == "full" else a.get("uncompressed")
            if a["strategy"] == "full" or src is None:
                continue
            agree, tokens = (
                (src["forced_agree"], src["forced_tokens"])
                if key == "full"
                else (src["agree"], src["tokens"])
            )
            t = out.setdefault(a["strategy"], [0, 0, 0, 0.0])
            t[0] += 1
            t[1] += agree
            t[2] += tokens
            t[3] += src["kl_sum"]
    return out


def show(questions, label):
    for key in ("full", "uncompressed"):
        for name, (n, agree, tokens, kl) in tally(questions, key).items():
            share = 100 * agree / tokens if tokens else float("nan")
            print(
                f"{label}{name} vs {key}: {n} questions, {agree} / {tokens} = {share:.2f} %, "
                f"KL {kl / max(tokens, 1):.4f}"
            )


def decisions(q, key):
    """Per strategy, the agreeing decisions of question `q` against `key`."""
    out = {}
    for a in q["answers"]:
        if a["strategy"] == "full":
            continue
        if key == "full":
            out[a["strategy"]] = (a["forced_agree"], a["forced_tokens"])
        elif "uncompressed" in a:
            out[a["strategy"]] = (a["uncompressed"]["agree"], a["uncompressed"]["tokens"])
    return out


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
            a, b = decisions(qs[i], key), decisions(other[i], key)
            for name in sorted(set(a) & set(b)):
                if a[name] != b[name]:
                    print(f"  question {i} {name} vs {key}: {a[name][0]}/{a[name][1]} here, "
                          f"{b[name][0]}/{b[name][1]} in the other")
        return 0
    show(ordered, "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
