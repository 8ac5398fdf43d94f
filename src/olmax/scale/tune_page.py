"""The page of an `olmax tune` search: the candidates compiled on a chart of predicted speed against peak memory,
then ranked in a table (DIR/index.html beside DIR/report.json, as the layout pages)."""

from __future__ import annotations

import html

from olmax.figures import percent
from olmax.pages import document, fact, table
from olmax.scale.layout_page import GiB, write_files

STATUS_COLOURS = {"fits": "#1a7f37", "over headroom": "#e6a100", "out of memory": "#c62828"}


def tune_page(r: dict) -> str:
    """The candidates `olmax tune` compiled on a chart of predicted speed (tokens/s a chip) against peak memory a
    device, the device's memory and the headroom's limit drawn across, the best ringed; then the ranked table."""
    plotted = [(i, x) for i, x in enumerate(r["results"]) if x.get("peak") and x.get("tokens_per_second_per_chip")]
    width, height, left, bottom = 900, 420, 70, 40
    memory, limit = r["memory_per_device"], r["memory_per_device"] * (1 - r["headroom"])
    x_max = max([x["peak"] for _, x in plotted] + [memory]) * 1.05
    y_max = max([x["tokens_per_second_per_chip"] for _, x in plotted] + [1]) * 1.1

    def px(v):
        return left + (width - left - 20) * v / x_max

    def py(v):
        return height - bottom - (height - bottom - 20) * v / y_max

    parts = [f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" stroke="#888"/>',
             f'<line x1="{left}" y1="10" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
             f'<text x="{left}" y="{height - 8}">peak GiB a device (0 .. {x_max / GiB:,.1f})</text>',
             f'<text x="4" y="16">tokens/s a chip (0 .. {y_max:,.0f})</text>']
    for value, name, dash in ((memory, "device memory", ""), (limit, f"{1 - r['headroom']:.0%} of it", "4 3")):
        parts.append(f'<line class="limit" x1="{px(value):.1f}" y1="14" x2="{px(value):.1f}" y2="{height - bottom}" '
                     f'stroke="#444" stroke-dasharray="{dash}"/><text x="{px(value) + 3:.1f}" y="26">'
                     f'{html.escape(name)}</text>')
    best = next((i for i, x in enumerate(r["results"]) if x["status"] == "fits"), None)
    for i, x in plotted:
        colour = STATUS_COLOURS.get(x["status"], "#777")
        ring = ' stroke="#000" stroke-width="2"' if i == best else ""
        parts.append(f'<circle class="candidate {html.escape(x["status"].replace(" ", "-"))}" cx="{px(x["peak"]):.1f}" '
                     f'cy="{py(x["tokens_per_second_per_chip"]):.1f}" r="{7 if i == best else 5}" fill="{colour}"{ring}>'
                     f'<title>#{i + 1} {html.escape(x["layout"])}: {x["step_seconds"]:.4g} s, '
                     f'{x["peak"] / GiB:.2f} GiB</title></circle>')
    legend = " ".join(f'<span class="swatch" style="background:{c}"></span>{html.escape(s)}'
                      for s, c in STATUS_COLOURS.items())
    chart = f'<p>{legend}</p><svg class="tune-chart" width="{width}" height="{height}">{"".join(parts)}</svg>'
    rows = []
    for i, x in enumerate(r["results"]):
        rows.append([str(i + 1), fact(f"results.{i}.status", x["status"]),
                     fact(f"results.{i}.step_seconds", x["step_seconds"], f"{x['step_seconds']:.4g}")
                     if x["step_seconds"] else "-",
                     fact(f"results.{i}.mfu", x["mfu"], percent(x["mfu"])) if x["mfu"] else "-",
                     f"{x['tokens_per_second_per_chip']:,.0f}" if x["tokens_per_second_per_chip"] else "-",
                     fact(f"results.{i}.peak", x["peak"], f"{x['peak'] / GiB:.2f}") if x["peak"] else "-",
                     html.escape(x["layout"]), html.escape(x["reason"] or (x["pruned_by"] or ""))])
    best_text = (f"<p>Best: <code>{html.escape(r['results'][best]['layout'])}</code>.</p>" if best is not None
                 else "<p>No layout fits within the headroom among those searched.</p>")
    body = (f"<h1>olmax tune {html.escape(r['config'])} on {html.escape(r['target'])}</h1>"
            f"<p>{fact('space', r['space'])} layouts in the space; {len(r['results'])} searched within a budget of "
            f"{fact('budget', r['budget'])} compiles ({fact('compiled', r['compiled'])} new), in "
            f"{r['seconds']:,.0f} s. Each point a compiled layout: its predicted speed against the compiler's peak "
            f"memory.</p>{best_text}"
            f'<section id="chart"><h2>Speed against memory</h2>{chart}</section>'
            f'<section id="candidates"><h2>Candidates, fastest that fit first</h2><div class="scroll">'
            + table(["#", "status", "step s", "MFU", "tokens/s/chip", "peak GiB", "layout", "why"], rows,
                     {0, 2, 3, 4, 5}) + "</div></section>")
    return document(f"olmax tune: {r['config']} on {r['target']}", body)


def write_tune(report: dict, directory: str) -> str:
    return write_files(directory, report, tune_page(report))
