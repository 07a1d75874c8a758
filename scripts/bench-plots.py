#!/usr/bin/env python3
"""Draws the benches' JSON lines as a picture: one bar per line, its `ratio` (how many times
better ragkv is than the line's baseline) on a log scale, 1x marked.

    scripts/bench-plots.py FILE.jsonl [OUT.svg]      (default OUT: FILE with .svg)
    scripts/bench-plots.py --xy FIELD_X FIELD_Y FILE.jsonl [OUT.svg]

Reads what `ragkv bench ...` / `ragkv eval ...` print (`{"bench", "ours", "baseline",
"ratio", "unit", "baseline_name"?}`; other lines are skipped) and writes an SVG with no
dependency beyond Python. With `--xy`, one point per line instead: FIELD_Y (e.g. `ours`)
against FIELD_X (e.g. `recomputed_tokens`, on a log scale from 1), labelled by `bench`.

    scripts/bench-plots.py docs/figures/summary.jsonl
    scripts/bench-plots.py --xy recomputed_tokens ours docs/figures/agreement.jsonl

redraw docs/figures/summary.svg (the figures of docs/BENCHMARKS.md's summary table) and
docs/figures/agreement.svg (teacher-forced agreement with full prefill against the chunk
tokens each assembly strategy recomputes).
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


def scatter(rows, fx, fy):
    """FIELD_Y against FIELD_X (log scale of x + 1), one labelled point per line."""
    pts = [(float(r[fx]), float(r[fy]), r["bench"]) for r in rows if fx in r and fy in r]
    left, top, w, h = 70, 40, 560, 320
    xmax = math.log10(max(p[0] for p in pts) + 1) or 1.0
    ylo, yhi = min(p[1] for p in pts), max(p[1] for p in pts)
    pad = (yhi - ylo) * 0.1 or 1.0
    ylo, yhi = ylo - pad, yhi + pad

    def px(v):
        return left + w * math.log10(v + 1) / xmax

    def py(v):
        return top + h * (1 - (v - ylo) / (yhi - ylo))

    unit = html.escape(str(rows[0].get("unit", fy)))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w + 260}" '
        f'height="{top + h + 50}" font-family="sans-serif" font-size="12">',
        f'<rect width="{left + w + 260}" height="{top + h + 50}" fill="white"/>',
        f'<text x="10" y="20" font-size="14">{html.escape(fy)} ({unit}) against '
        f"{html.escape(fx)} (log scale)</text>",
        f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#444"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#444"/>',
    ]
    for tick in [0, 10, 100, 1000, 10000]:
        if math.log10(tick + 1) <= xmax * 1.001:
            out.append(
                f'<text x="{px(tick):.1f}" y="{top + h + 16}" text-anchor="middle">{tick}</text>'
            )
    for k in range(5):
        v = ylo + (yhi - ylo) * k / 4
        out.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    pts.sort()
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)
    out.append(f'<polyline points="{path}" fill="none" stroke="#1565c0"/>')
    for x, y, name in pts:
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="#1565c0"/>')
        out.append(
            f'<text x="{px(x) + 7:.1f}" y="{py(y) + 4:.1f}">{html.escape(name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    args = sys.argv[1:]
    xy = None
    if args[:1] == ["--xy"]:
        if len(args) < 4:
            print(__doc__.strip(), file=sys.stderr)
            sys.exit(2)
        xy, args = (args[1], args[2]), args[3:]
    if not args:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    src = args[0]
    dst = args[1] if len(args) > 1 else src.rsplit(".", 1)[0] + ".svg"
    rows = lines(src)
    if not rows:
        print(f"{src}: no bench lines with a ratio", file=sys.stderr)
        sys.exit(1)
    with open(dst, "w", encoding="utf-8") as f:
        f.write(scatter(rows, *xy) if xy else svg(rows))
    print(f"{dst}: {len(rows)} {'points' if xy else 'bars'}")


if __name__ == "__main__":
    main()
