#!/usr/bin/env python3
"""Draws the benches' JSON lines as a picture: one bar per line, its `ratio` (how many times
better ragkv is than the line's baseline) on a log scale, 1x marked.

    scripts/bench-plots.py FILE.jsonl [OUT.svg]      (default OUT: FILE with .svg)
    scripts/bench-plots.py [--bench NAME] [--log-y] [--names A,B] \
        --xy FIELD_X FIELD_Y[,FIELD_Y2...] FILE.jsonl [OUT.svg]

Reads what `ragkv bench ...` / `ragkv eval ...` print (`{"bench", "ours", "baseline",
"ratio", "unit", "baseline_name"?}`; other lines are skipped) and writes an SVG with no
dependency beyond Python. With `--xy`, one point per line instead: FIELD_Y (e.g. `ours`)
against FIELD_X (e.g. `recomputed_tokens`, on a log scale from 1), labelled by `bench`; with
several FIELD_Ys (e.g. `ours,baseline`), one coloured series each, named by `--names`. Fields
may name nested keys with dots (`detail.prompt_tokens_mean`); `--bench` keeps only the lines
of one bench; `--log-y` draws y on a log scale.

    scripts/bench-plots.py docs/figures/summary.jsonl
    scripts/bench-plots.py --xy recomputed_tokens ours docs/figures/agreement.jsonl
    scripts/bench-plots.py --bench peer.ttft_p50 --log-y --names ragkv,llama-server \
        --xy detail.prompt_tokens_mean ours,baseline docs/figures/ttft.jsonl

redraw docs/figures/summary.svg (the figures of docs/BENCHMARKS.md's summary table) and
docs/figures/agreement.svg (teacher-forced agreement with full prefill against the chunk
tokens each assembly strategy recomputes) and docs/figures/ttft.svg (time to first token
against prompt length, ragkv from stored KV and llama-server's full prefill).
"""
import html
import json
import math
import sys


def lines(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            raw = raw.strip()
            if not raw.startswith("{"):
                continue
            try:
                j = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(j.get("ratio"), (int, float)) and j["ratio"] > 0 and "bench" in j:
                out.append(j)
    return out


def svg(rows):
    label_w, bar_w, row_h, top = 330, 420, 22, 40
    lo = min(0.1, min(r["ratio"] for r in rows))
    hi = max(40.0, max(r["ratio"] for r in rows))
    span = math.log10(hi) - math.log10(lo)

    def x(v):
        return label_w + bar_w * (math.log10(v) - math.log10(lo)) / span

    height = top + row_h * len(rows) + 40
    width = label_w + bar_w + 300
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14">ratio (x better than the baseline; log scale;'
        " &lt; 1: ragkv loses)</text>",
    ]
    for tick in [0.1, 0.3, 1, 3, 10, 30, 100]:
        if lo <= tick <= hi:
            tx = x(tick)
            stroke = "#444" if tick == 1 else "#ddd"
            out.append(
                f'<line x1="{tx:.1f}" y1="{top - 8}" x2="{tx:.1f}" '
                f'y2="{top + row_h * len(rows)}" stroke="{stroke}"/>'
            )
            out.append(
                f'<text x="{tx:.1f}" y="{top + row_h * len(rows) + 16}" '
                f'text-anchor="middle">{tick:g}x</text>'
            )
    for i, r in enumerate(rows):
        y = top + i * row_h
        ratio = r["ratio"]
        x0, x1 = x(1.0), x(ratio)
        color = "#2e7d32" if ratio >= 1 else "#c62828"
        left, w = min(x0, x1), abs(x1 - x0)
        out.append(
            f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">'
            f'{html.escape(r["bench"])}</text>'
        )
        out.append(
            f'<rect x="{left:.1f}" y="{y + 4}" width="{max(w, 1):.1f}" height="{row_h - 8}" '
            f'fill="{color}"/>'
        )
        base = html.escape(str(r.get("baseline_name", "baseline")))
        out.append(
            f'<text x="{max(x0, x1) + 6:.1f}" y="{y + 15}">{ratio:.3g}x'
            f' <tspan fill="#777">vs {base}</tspan></text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def field(row, path):
    """`path`'s value in `row`: a key, or keys joined by dots into nested objects."""
    v = row
    for k in path.split("."):
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v if isinstance(v, (int, float)) else None


COLORS = ["#1565c0", "#c62828", "#2e7d32", "#6a1b9a"]


def scatter(rows, fx, fys, log_y=False, names=None):
    """Each FIELD_Y against FIELD_X (log scale of x + 1): one labelled point per line with one
    field, one coloured series per field (and a legend) with several."""
    names = names or fys
    series = []
    for fy, name, color in zip(fys, names, COLORS):
        pts = [(field(r, fx), field(r, fy), r["bench"]) for r in rows]
        pts = sorted(p for p in pts if p[0] is not None and p[1] is not None)
        if pts:
            series.append((name, color, pts))
    if not series:
        raise SystemExit(f"no line has both {fx} and any of {', '.join(fys)}")
    left, top, w, h = 70, 40, 560, 320
    allp = [p for _, _, pts in series for p in pts]
    xmax = math.log10(max(p[0] for p in allp) + 1) or 1.0
    # From 0 when a point sits there; otherwise from a little below the smallest x.
    xmin = max(0.0, math.log10(min(p[0] for p in allp) + 1) - 0.15)
    xmin = 0.0 if xmin < 0.5 else xmin
    xmax = max(xmax, xmin + 0.5)
    ty = (lambda v: math.log10(max(v, 1e-9))) if log_y else (lambda v: v)
    ylo, yhi = min(ty(p[1]) for p in allp), max(ty(p[1]) for p in allp)
    pad = (yhi - ylo) * 0.1 or 1.0
    ylo, yhi = ylo - pad, yhi + pad

    def px(v):
        return left + w * (math.log10(v + 1) - xmin) / (xmax - xmin)

    def py(v):
        return top + h * (1 - (ty(v) - ylo) / (yhi - ylo))

    unit = html.escape(str(rows[0].get("unit", fys[0])))
    what = html.escape(", ".join(names))
    scale = "log scales" if log_y else "log scale"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w + 260}" '
        f'height="{top + h + 50}" font-family="sans-serif" font-size="12">',
        f'<rect width="{left + w + 260}" height="{top + h + 50}" fill="white"/>',
        f'<text x="10" y="20" font-size="14">{what} ({unit}) against '
        f"{html.escape(fx)} ({scale})</text>",
        f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#444"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#444"/>',
    ]
    steps = [1, 2, 5] if xmin > 0 else [1]
    for tick in [0] + [m * 10**e for e in range(1, 6) for m in steps]:
        if xmin <= math.log10(tick + 1) <= xmax * 1.001:
            out.append(
                f'<text x="{px(tick):.1f}" y="{top + h + 16}" text-anchor="middle">{tick}</text>'
            )
    if log_y:
        yticks = [m * 10.0**e for e in range(-3, 7) for m in (1, 2, 5)]
        yticks = [v for v in yticks if ylo <= math.log10(v) <= yhi]
    else:
        yticks = [ylo + (yhi - ylo) * k / 4 for k in range(5)]
    for v in yticks:
        label = f"{v:,.0f}" if log_y and v >= 1 else f"{v:.3g}"
        out.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{label}</text>')
        out.append(
            f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + w}" y2="{py(v):.1f}" stroke="#eee"/>'
        )
    for i, (name, color, pts) in enumerate(series):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}"/>')
        for x, y, label in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{color}"/>')
            if len(series) == 1:
                out.append(
                    f'<text x="{px(x) + 7:.1f}" y="{py(y) + 4:.1f}">{html.escape(label)}</text>'
                )
        if len(series) > 1:
            ly = top + 16 * i
            out.append(
                f'<rect x="{left + w + 20}" y="{ly}" width="12" height="12" fill="{color}"/>'
            )
            out.append(
                f'<text x="{left + w + 38}" y="{ly + 11}">{html.escape(name)}</text>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    args = sys.argv[1:]
    xy, log_y, names, only = None, False, None, None
    while args[:1] and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--xy" and len(args) >= 2:
            xy, args = (args[0], args[1].split(",")), args[2:]
        elif flag == "--log-y":
            log_y = True
        elif flag == "--names" and args:
            names = args.pop(0).split(",")
        elif flag == "--bench" and args:
            only = args.pop(0)
        else:
            print(__doc__.strip(), file=sys.stderr)
            sys.exit(2)
    if not args:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    src = args[0]
    dst = args[1] if len(args) > 1 else src.rsplit(".", 1)[0] + ".svg"
    rows = [r for r in lines(src) if only is None or r["bench"] == only]
    if not rows:
        print(f"{src}: no bench lines with a ratio", file=sys.stderr)
        sys.exit(1)
    with open(dst, "w", encoding="utf-8") as f:
        f.write(scatter(rows, xy[0], xy[1], log_y, names) if xy else svg(rows))
    print(f"{dst}: {len(rows)} {'points' if xy else 'bars'}")


if __name__ == "__main__":
    main()
