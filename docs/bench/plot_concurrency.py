"""Draws docs/bench/concurrency.svg from a `bench --concurrency ... --json` result: aggregate
tokens/s against the number of streams, one line per engine and preset, and the measured
ceiling. No plotting library: a few lines of SVG.

    python docs/bench/plot_concurrency.py docs/bench/concurrency.json docs/bench/concurrency.svg
"""

import json
import sys

W, H, L, B, T, R = 640, 380, 60, 50, 30, 170  # size and margins (left, bottom, top, right)
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def main(src: str, out: str) -> None:
    rows = json.load(open(src))["rows"]
    lines: dict[str, list[tuple[int, float]]] = {}
    ceiling: dict[int, float] = {}
    for r in rows:
        lines.setdefault(f"{r['engine']} {r['preset']}", []).append(
            (r["concurrency"], r["aggregate_tokens_per_s"]))
        if r["engine"] == "miniserve" and r["ceiling_tokens_per_s"]:
            ceiling[r["concurrency"]] = r["ceiling_tokens_per_s"]
    xs = sorted({x for pts in lines.values() for x, _ in pts})
    top = max([y for pts in lines.values() for _, y in pts] + list(ceiling.values())) * 1.08

    def px(x):  # streams on an even spacing
        return L + xs.index(x) * (W - L - R) / max(len(xs) - 1, 1)

    def py(y):
        return H - B - y / top * (H - B - T)

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for i in range(6):  # horizontal grid and tokens/s labels
        y = top * i / 5
        svg.append(f'<line x1="{L}" x2="{W - R}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                   f'stroke="#ddd"/><text x="{L - 6}" y="{py(y) + 4:.1f}" '
                   f'text-anchor="end">{y:.0f}</text>')
    for x in xs:
        svg.append(f'<text x="{px(x):.1f}" y="{H - B + 18}" text-anchor="middle">{x}</text>')
    svg.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">'
               'streams at once</text>')
    svg.append(f'<text x="16" y="{(H - B + T) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(H - B + T) / 2})">aggregate tokens/s</text>')
    series = [(name, pts, COLORS[i % len(COLORS)], "") for i, (name, pts) in
              enumerate(lines.items())]
    if ceiling:
        series.append(("ceiling (measured)", sorted(ceiling.items()), "#999", "6,4"))
    for i, (name, pts, color, dash) in enumerate(series):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
        svg.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')
        for x, y in pts:
            svg.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = T + 10 + 18 * i
        svg.append(f'<line x1="{W - R + 12}" x2="{W - R + 32}" y1="{ly}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>'
                   f'<text x="{W - R + 38}" y="{ly + 4}">{name}</text>')
    svg.append("</svg>")
    open(out, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
