#!/usr/bin/env python3
"""Draws the benches' JSON lines as a picture: one bar per line, its `ratio` (how many times
better ragkv is than the line's baseline) on a log scale, 1x marked.

    scripts/bench-plots.py FILE.jsonl [OUT.svg]      (default OUT: FILE with .svg)

Reads what `ragkv bench ...` / `ragkv eval ...` print (`{"bench", "ours", "baseline",
"ratio", "unit", "baseline_name"?}`; other lines are skipped) and writes an SVG with no
dependency beyond Python. docs/figures/summary.jsonl holds the figures of docs/BENCHMARKS.md's
summary table; `scripts/bench-plots.py docs/figures/summary.jsonl` redraws
docs/figures/summary.svg.
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


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    src = sys.argv[1]
    dst = sys.argv[2] if len(sys.argv) > 2 else src.rsplit(".", 1)[0] + ".svg"
    rows = lines(src)
    if not rows:
        print(f"{src}: no bench lines with a ratio", file=sys.stderr)
        sys.exit(1)
    with open(dst, "w", encoding="utf-8") as f:
        f.write(svg(rows))
    print(f"{dst}: {len(rows)} bars")


if __name__ == "__main__":
    main()
