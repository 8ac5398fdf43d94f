"""The layout page of a compile or a plan: DIR/index.html, a page a person looks at (one self-contained file,
inline SVG and CSS, no script, nothing fetched), and DIR/report.json (the same facts). Every figure on the page is
in an element with `data-fact` (its path in report.json, dot-separated) and `data-value` (the value there), so a
test reads the page back against the JSON."""

from __future__ import annotations

import html
import json

from olmax import run_dir, storage
from olmax.figures import figure, percent, size
from olmax.pages import document, fact, table
from olmax.scale import step_time

GiB = 2**30
FAMILY_ORDER = ["embeddings", "attention projections", "MLP", "experts", "router", "norms", "LM head"]
SEGMENT_COLOURS = {"parameters": "#4e79a7", "optimizer state": "#f28e2b", "batch and other arguments": "#9c755f",
                   "gradients": "#e15759", "residuals kept for the backward": "#76b7b2", "gathered weights": "#edc948",
                   "temporaries": "#59a14f",
                   "free": "#f4f4f4"}


def gib(path: str, value: int) -> str:
    """A memory figure on the page, in the unit that shows it best (`size`)."""
    return fact(path, value, size(value))


def plan_of(r: dict) -> dict:
    return r["plan"] if "plan" in r else r


def fits(r: dict) -> bool | None:
    if "peak" in r:
        return r["peak"] <= r["memory_per_device"]
    return False if "compiler_error" in r else None


# --- sections ------------------------------------------------------------------------------------------------------

def _header(r: dict) -> str:
    plan = plan_of(r)
    what = "compile" if "memory_per_device" in r else "plan"
    lines = [f"<h1>{html.escape(r['config'])} on {html.escape(r['target'])}</h1>",
             f"<p>{fact('devices', r['devices'])} devices"
             + (f" ({html.escape(r['device_kind'])})" if r.get("device_kind") else "")
             + f", olmax {what}" + (f", overrides <code>{html.escape(' '.join(r['overrides']))}</code>"
                                    if r.get("overrides") else "") + "</p>"]
    fit = fits(r)
    if fit is not None:
        figure = (f"peak {gib('peak', r['peak'])} of {gib('memory_per_device', r['memory_per_device'])} "
                  f"a device ({percent(r['peak'] / r['memory_per_device'])})" if "peak" in r
                  else html.escape(r["compiler_error"]))
        verdict = "fits" if fit else "does not fit"
        lines.append(f'<p>The step <span class="verdict-{"yes" if fit else "no"}">{verdict}</span>: {figure}. '
                     f"Compiled in {fact('compile_seconds', r['compile_seconds'], format(r['compile_seconds'], ',.0f'))} s."
                     "</p>")
    if r.get("layout"):
        lines.append(f"<p>Layout for {html.escape(r['layout']['target'])} from the config: "
                     f"<code>{html.escape(' '.join(r['layout']['settings']))}</code></p>")
    if "instances_per_device_micro_step" in r:
        lines.append(
            f"<p>{fact('instances_per_device_micro_step', r['instances_per_device_micro_step'])} x "
            f"{fact('sequence_length', r['sequence_length'])} tokens a device a micro-step, "
            f"{fact('micro_steps', r['micro_steps'])} micro-step(s) a step, {html.escape(r['compute_dtype'])} "
            f"compute, {html.escape(r['attention'])} attention, remat <code>{html.escape(str(r['remat']))}</code>"
            + (f", experts by {html.escape(r['moe_dispatch'])}" if r.get("moe_dispatch") else "") + ".</p>")
    if plan.get("pipeline"):
        lines.append(f"<p>Pipeline: {html.escape(plan['pipeline']['summary'])}.</p>")
    return "\n".join(lines)


def _mesh(r: dict) -> str:
    if "mesh_axes" not in r:
        return ""
    rows = []
    for i, axis in enumerate(r["mesh_axes"]):
        spans = " x ".join(f"{dim} {n}" for dim, n in axis["spans"].items()) or ("-" if axis["size"] == 1 else "")
        rows.append([html.escape(axis["axis"]), fact(f"mesh_axes.{i}.size", axis["size"]), html.escape(spans)])
    out = ["<section id=\"mesh\"><h2>Mesh</h2>",
           "<p class=\"note\">Mesh axes and the physical dimensions of the slice each one steps along. In the "
           "pictures every device is a square at its place in the slice (one panel per z), coloured by its index "
           "along the axis named above the panel row.</p>",
           table(["axis", "size", "physical dimensions it spans"], rows, {1})]
    for axis in r["mesh_axes"]:
        if axis["size"] > 1:
            out.append(f"<h3>{html.escape(axis['axis'])} ({html.escape(str(axis['size']))}): devices coloured by their "
                       f"{html.escape(axis['axis'])} index</h3>" + _chip_picture(r["chips"], axis["axis"], axis["size"]))
    return "\n".join(out) + "</section>"


def _place(at: dict) -> tuple[int, int, int]:
    """(panel, column, row) of a device in the slice picture."""
    if "x" in at:
        return at.get("z", 0), at["x"] * 2 + at.get("core", 0), at["y"]
    return 0, at["device"] % 8, at["host"]


def _chip_picture(chips: list[dict], axis: str, size: int) -> str:
    places, name = [_place(c["at"]) for c in chips], html.escape(axis)
    cores = 2 if any(c["at"].get("core") for c in chips) else 1
    columns = max(p[1] for p in places) // (2 if "x" in chips[0]["at"] and cores == 1 else 1) + 1
    rows, panels = max(p[2] for p in places) + 1, max(p[0] for p in places) + 1
    cell = max(6, min(22, 1060 // max(1, panels * (columns + 1))))
    per_row = max(1, 1060 // ((columns + 1) * cell))
    width = min(panels, per_row) * (columns + 1) * cell
    height = -(-panels // per_row) * (rows * cell + 18)
    parts = []
    for chip, (panel, column, row) in zip(chips, places):
        if "x" in chip["at"] and cores == 1:
            column //= 2
        px, py = panel % per_row * (columns + 1) * cell, panel // per_row * (rows * cell + 18) + 14
        hue = round(300 * chip["index"][axis] / max(1, size - 1))
        parts.append(f'<rect x="{px + column * cell}" y="{py + row * cell}" width="{cell - 1}" height="{cell - 1}" '
                     f'fill="hsl({hue},65%,55%)"><title>{html.escape(str(chip["at"]))}: {name} '
                     f'{html.escape(str(chip["index"][axis]))}</title></rect>')
    for panel in range(panels):
        if panels > 1:
            px, py = panel % per_row * (columns + 1) * cell, panel // per_row * (rows * cell + 18)
            parts.append(f'<text x="{px}" y="{py + 11}">z {panel}</text>')
    legend = (f'<text x="{width + 8}" y="26">{name} 0</text><rect x="{width + 8}" y="32" width="80" height="8" '
              f'fill="url(#hue)"/><text x="{width + 8}" y="54">{name} {size - 1}</text>')
    gradient = ('<defs><linearGradient id="hue">' + "".join(
        f'<stop offset="{k / 4}" stop-color="hsl({75 * k},65%,55%)"/>' for k in range(5)) + "</linearGradient></defs>")
    return (f'<svg width="{width + 100}" height="{max(height, 60)}" role="img" aria-label="{name} on the slice">'
            f'{gradient}{"".join(parts)}{legend}</svg>')


def _colour(segment: str) -> str:
    return SEGMENT_COLOURS.get(segment, "#bbb")  # a segment this olmax does not draw: grey


def memory_bar(r: dict, width: int = 900, whole: bool = True) -> str:
    """The stacked bar of one device's memory: its whole memory (`whole`), or the peak at full width."""
    stack = r["memory_stack"] if whole else r["memory_stack"][:-1]
    device = r["memory_per_device"] if whole else r["peak"]
    x, parts = 0.0, []
    for segment in stack:
        w = segment["bytes"] / device * width
        parts.append(f'<rect x="{x:.2f}" y="0" width="{max(w, 0):.2f}" height="26" '
                     f'fill="{_colour(segment["segment"])}" stroke="#fff" stroke-width="0.5">'
                     f'<title>{html.escape(segment["segment"])}: {size(segment["bytes"])}</title></rect>')
        x += w
    peak_x = r["peak"] / device * width
    parts.append(f'<line x1="{peak_x:.2f}" x2="{peak_x:.2f}" y1="-4" y2="30" stroke="#000" stroke-width="1.5"/>')
    parts.append(f'<rect x="0" y="0" width="{width}" height="26" fill="none" stroke="#555"/>')
    parts.append(f'<text x="0" y="42">0</text><text x="{width}" y="42" text-anchor="end">{size(device)}'
                 f'{"" if whole else " (peak)"}</text>')
    if whole and 60 < peak_x < width - 120:
        parts.append(f'<text x="{peak_x:.0f}" y="42" text-anchor="middle">peak {size(r["peak"])}</text>')
    return f'<svg width="{width + 10}" height="52" viewBox="-2 -6 {width + 10} 52">{"".join(parts)}</svg>'


def _memory(r: dict) -> str:
    if "memory_per_device" not in r:
        return ""
    if "memory_stack" not in r:
        needed = r.get("required")
        text = (f"The compiler needs {gib('required', needed)} of temporaries on top of the arguments"
                if needed else "The compiler gave no figures")
        return (f'<section id="memory"><h2>Memory per device</h2><p>{text}; the device has '
                f"{gib('memory_per_device', r['memory_per_device'])} ({html.escape(r['compiler_error'])}). "
                f"Arguments: parameters {gib('parameters', r['parameters'])}, optimizer state "
                f"{gib('optimizer_state', r['optimizer_state'])}, batch {gib('batch', r['batch'])}.</p></section>")
    rows = [[f'<span class="swatch" style="background:{_colour(s["segment"])}"></span>'
             f'{html.escape(s["segment"])}',
             gib(f"memory_stack.{i}.bytes", s["bytes"]), percent(s['bytes'] / r['memory_per_device'])]
            for i, s in enumerate(r["memory_stack"])]
    added = sum(s["bytes"] for s in r["memory_stack"][:-1])
    return (
        '<section id="memory"><h2>Memory per device</h2>'
        f"<p class=\"note\">One program runs on every device (SPMD), so every device holds the same: the bar is "
        f"the {gib('memory_per_device', r['memory_per_device'])} of one device, the black line the compiler's "
        f"peak ({gib('peak', r['peak'])}, from the compiled program's memory analysis). Parameters, optimizer "
        f"state and batch are the program's arguments ({gib('arguments', r['arguments'])}); gradients are the "
        "float32 accumulator, the parameters' size; the residuals kept for the backward are read from the "
        "compiled program (the buffers the forward's loops, over layers and over the loss's chunks, fill "
        "iteration by iteration for the backward's); the gathered weights are the most one loop iteration "
        "gathers whole (a layer group's weights from their shards, or the LM head); temporaries are the rest of "
        f"the peak (the compiler's total of temporaries, {gib('temporaries', r['temporaries'])}, sums every temporary "
        "buffer of the whole program, buffers that are never all live at once: it can exceed the peak).</p>"
        + "<h3>The device</h3>" + memory_bar(r) + "<h3>The peak, at full width</h3>" + memory_bar(r, whole=False)
        + table(["segment", "size", "of the device"], rows, {1, 2})
        + f'<p>Segments below the peak add up to <span id="memory-sum">{size(added)}</span>, the '
        f"compiler's peak is {size(r['peak'])}.</p></section>")


def _parameters(r: dict) -> str:
    if "parameter_table" not in r:
        return ""
    rows = []
    order = sorted(range(len(r["parameter_table"])),
                   key=lambda i: (FAMILY_ORDER.index(r["parameter_table"][i]["family"])
                                  if r["parameter_table"][i]["family"] in FAMILY_ORDER else len(FAMILY_ORDER), i))
    for i in order:
        p = r["parameter_table"][i]
        spec = ", ".join(s or "-" for s in p["spec"])
        rows.append([html.escape(p["family"]), f"<code>{html.escape(p['name'])}</code>",
                     fact(f"parameter_table.{i}.shape", p["shape"], " x ".join(map(str, p["shape"]))),
                     f"<code>({html.escape(spec)})</code>",
                     fact(f"parameter_table.{i}.bytes_per_device", p["bytes_per_device"], size(p["bytes_per_device"]))])
    total = sum(p["bytes_per_device"] for p in r["parameter_table"])
    return ('<section id="parameters"><h2>Parameters</h2><p class="note">Every parameter (stacked over layers), its '
            "global shape, its partition spec (the mesh axes that split each dimension, - for none) and what one "
            f"device holds, {html.escape(r['parameter_table'][0]['dtype'])}. Total {size(total)} a device.</p>"
            + table(["family", "parameter", "global shape", "partition spec", "a device"], rows, {4})
            + "</section>")


def _collectives(r: dict) -> str:
    if "collectives" not in r:
        return ""
    found = r["collectives"]
    largest = max([c["bytes_per_step"] for c in found["by_axis"]] + [1])
    rows = []
    for i, c in enumerate(found["by_axis"]):
        bar = (f'<svg width="210" height="12"><rect width="{200 * c["bytes_per_step"] / largest:.1f}" height="10" '
               f'fill="#4e79a7"/></svg>')
        kind = c["kind"] + (f" as {c['as']}" if c.get("as") else "")
        rows.append([html.escape(c["axes"]), html.escape(kind), fact(f"collectives.by_axis.{i}.count", c["count"]),
                     fact(f"collectives.by_axis.{i}.bytes_per_step", c["bytes_per_step"], size(c["bytes_per_step"])),
                     bar])
    unknown = found["loops_without_trip_count"]
    return ('<section id="collectives"><h2>Collectives per mesh axis</h2><p class="note">From the compiled '
            "program (HLO): each collective by the mesh axes its device groups span, how many run a step and the "
            "bytes a device sends or receives in them a step (the larger of input and output). A loop body counts "
            "as often as its loop runs where that is a constant"
            + (f"; {fact('collectives.loops_without_trip_count', unknown)} loop runs whose trip count the HLO "
               "does not state as a constant (an MoE's expert block loops are such) count once" if unknown else "")
            + ".</p>" + (_AS_NOTE if any(c.get("as") for c in found["by_axis"]) else "")
            + table(["mesh axes", "kind", "count a step", "bytes a step", ""], rows, {2, 3}) + "</section>")


_AS_NOTE = ('<p class="note">"all-reduce as all-gather": the TPU compiler gathers FSDP-sharded weights with an '
            "all-reduce: each device writes its shard into a buffer of zeros the size of the whole weight and the "
            "sum is the whole weight on every device. \"all-reduce as reduce-scatter\": the gradient is summed "
            "whole and each device keeps its own slice. The bytes are an all-reduce's (each device sends and "
            "receives the whole buffer, twice (n-1)/n of it over a ring); the step-time model costs them so.</p>")


def _phases(s: dict) -> dict:
    """The ticks each kind of work spans (see schedules.Ticks): an empty slot inside its span is the bubble."""
    S, M, R = s["stages"], s["microbatches"], s["chunks_per_stage"]
    if s["schedule"] in ("gpipe", "circular"):
        return {"F": range(M * R + S - 1)}
    return {"F": range(M * R + S - 1), "B": range(R * S - 1, M * R + R * S + S - 2)}


def _schedule_grid(s: dict, index: int, path: str) -> str:
    ticks, stages, phases = s["ticks"], s["stages"], _phases(s)
    cell_w = max(14, min(34, 1100 // len(ticks)))
    half = 14 if len(phases) == 2 else 18
    cell_h = half * len(phases)
    left, top = 58, 16
    parts = [f'<text x="0" y="{top - 4}">stage</text>']
    for s_i in range(stages):
        parts.append(f'<text x="0" y="{top + s_i * cell_h + cell_h * 0.6:.0f}">{s_i}</text>')
    for t, row in enumerate(ticks):
        for s_i, cell in enumerate(row):
            x = left + t * cell_w
            for j, kind in enumerate(phases):
                y = top + s_i * cell_h + j * half
                if t not in phases[kind]:
                    continue
                if kind not in (cell or {}):
                    parts.append(f'<rect x="{x}" y="{y}" width="{cell_w - 1}" height="{half - 1}" fill="url(#idle)" '
                                 f'class="idle"><title>tick {t}, stage {s_i}: idle</title></rect>')
                    continue
                mb, chunk = cell[kind], cell["chunk" if kind == "F" else "b_chunk"]
                colour = f"hsl({(mb * 47) % 360},{60 if kind == 'F' else 35}%,{62 if kind == 'F' else 42}%)"
                parts.append(f'<rect x="{x}" y="{y}" width="{cell_w - 1}" height="{half - 1}" fill="{colour}" '
                             f'class="busy"><title>tick {t}, stage {s_i}: {"forward" if kind == "F" else "backward"} '
                             f"of micro-batch {html.escape(str(mb))} through chunk {html.escape(str(chunk))}</title></rect>")
                if cell_w >= 16:
                    label = f"{kind}{mb}" if cell_w >= 26 else str(mb)
                    parts.append(f'<text x="{x + 2}" y="{y + half * 0.72:.1f}" fill="#fff">{html.escape(label)}</text>')
    width, height = left + len(ticks) * cell_w + 10, top + stages * cell_h + 20
    parts.append(f'<text x="{left}" y="{height - 4}">tick 0 .. {len(ticks) - 1}</text>')
    idle = ('<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ddd"/><line x1="0" y1="0" x2="0" y2="6" '
            'stroke="#999" stroke-width="2"/></pattern></defs>')
    return (f'<h3 data-schedule="{html.escape(s["schedule"])}">{html.escape(s["name"])}'
            f'{" (configured)" if s["configured"] else ""}: bubble '
            f"{fact(f'{path}.{index}.bubble_fraction', s['bubble_fraction'], format(s['bubble_fraction'], '.1%'))}, "
            f"{html.escape(str(s['microbatches']))} micro-batches, up to {html.escape(str(s['in_flight_microbatches']))} "
            "kept per stage</h3>"
            f'<div class="scroll"><svg width="{width}" height="{height}">{idle}{"".join(parts)}</svg></div>')


def _pipeline(r: dict) -> str:
    plan = plan_of(r)
    if not plan.get("schedules"):
        return ""
    path = "plan.schedules" if "plan" in r else "schedules"
    grids, refused = [], []
    for i, s in enumerate(plan["schedules"]):
        if s["allowed"]:
            grids.append(_schedule_grid(s, i, path))
        else:
            refused.append(f"<li>{html.escape(s['schedule'])}: {html.escape(s['why'])}</li>")
    return ('<section id="pipeline"><h2>Pipeline schedules</h2><p class="note">Each schedule the config\'s stages '
            "allow, as ticks (left to right) by stages (top to bottom): a coloured cell is a micro-batch's forward "
            "(F, light; its number) or backward (B, dark, the lower half of a 1F1B tick) through one layer chunk, a "
            "hatched cell is the bubble, where the stage idles while others work. GPipe and circular show the "
            "forward iterations; autodiff runs their backward the same way in reverse.</p>" + "".join(grids)
            + (f"<p>Not allowed here:</p><ul>{''.join(refused)}</ul>" if refused else "") + "</section>")


PLAN_ROWS = [("train GFLOP / token", "train_flops_per_token", lambda v: figure(v / 1e9)),
             ("TFLOP / device-step", "tflop_per_device_step", figure),
             ("MFU", "mfu", percent),
             ("chip-seconds / step", "chip_seconds_per_step", figure),
             ("step time (s)", "step_seconds", figure),
             ("tokens / s / chip", "tokens_per_second_per_chip", figure),
             ("chip-hours", "chip_hours", figure),
             ("chip-hours / T tokens", "chip_hours_per_trillion_tokens", figure)]


def _plan(r: dict) -> str:
    plan, prefix = plan_of(r), "plan." if "plan" in r else ""
    rows = [[label] + [fact(f"{prefix}{count}.{key}", plan[count][key], fmt(plan[count][key]))
                       for count in ("exact_window", "all_global")]
            for label, key, fmt in PLAN_ROWS if key in plan["exact_window"]]
    if plan.get("mfu_from") == "given":
        title = f'cost at {fact(prefix + "mfu", plan["mfu"], percent(plan["mfu"]))} MFU (given)'
    elif plan.get("mfu_from") == "predicted":
        title = "cost at the predicted step"
    else:
        title = "FLOPs (no step time: the step did not compile)"
    return (f'<section id="plan"><h2>Plan: {title}</h2><p>{fact(prefix + "chips", plan["chips"])} chips at '
            f"{plan['peak_tflops_per_chip']:,.0f} TFLOP/s peak each; {fact(prefix + 'steps', plan['steps'])} steps "
            f"of {fact(prefix + 'tokens_per_step', plan['tokens_per_step'])} tokens.</p>"
            + table(["", "sliding windows exact", "every layer global"], rows, {1, 2}) + "</section>")


CATEGORY_COLOURS = {"matmul": "#4e79a7", "attention": "#f28e2b", "memory": "#59a14f", "hidden": "#b8b8b8",
                    "exposed": "#d62728"}
CATEGORY_NAMES = {"matmul": "matmuls", "attention": "attention", "memory": "memory-bound",
                  "collective": "exposed collectives"}


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if value >= scale:
            return f"{value / scale:,.4g} {unit}"
    return f"{value * 1e6:.3g} us"


def _step_time(r: dict) -> str:
    """The predicted step: where its time goes by category and layer kind, its collectives, and one step as a
    timeline of the compute and the links."""
    p = r.get("step_time")
    if not p:
        return ""
    regions = list(p["by_region"])
    rows = [[html.escape(CATEGORY_NAMES[c])]
            + [fact(f"step_time.by_region.{region}.{c}", p["by_region"][region][c], _seconds(p["by_region"][region][c]))
               for region in regions]
            + [fact(f"step_time.seconds.{c}", p["seconds"][c], _seconds(p["seconds"][c]))] for c in CATEGORY_NAMES]
    breakdown = table(["", *(html.escape(region) for region in regions), "total"], rows, set(range(1, len(regions) + 2)))
    c, k = p["collectives"], p["constants"]
    mfu = (f", MFU {fact('step_time.mfu', p['mfu'], percent(p['mfu']))} (exact FLOP count)"
           if p.get("mfu") is not None else "")
    summary = (f"<p>Predicted step {fact('step_time.step_seconds', p['step_seconds'], _seconds(p['step_seconds']))}"
               f"{mfu}. Collectives take {_seconds(c['total_seconds'])} on the links: "
               f"{fact('step_time.collectives.hidden_seconds', c['hidden_seconds'], _seconds(c['hidden_seconds']))} "
               f"hidden behind compute, "
               f"{fact('step_time.collectives.exposed_seconds', c['exposed_seconds'], _seconds(c['exposed_seconds']))} "
               "exposed.</p>")
    note = ('<p class="note">From the compiled program: each op costed by a roofline (its FLOPs at the matrix '
            f"unit's rate, {html.escape(step_time.matmul_rate(k))}; its bytes at {k['memory_efficiency']:.0%} "
            f"of {k['memory_bandwidth_per_device'] / 1e9:,.0f} GB/s of HBM), kernels by the work olmax.model."
            f"kernel_registry holds, collectives on the target's links at {k['collective_efficiency']:.0%} of their "
            "rate, loops times their trip counts, asynchronous collectives hidden behind the compute scheduled "
            "between their start and done. The constants and their sources: olmax.scale.targets.</p>")
    counted = "".join(f"<li>{html.escape(line)}</li>" for line in step_time.notes(p))
    if counted:
        note += f'<ul class="note">{counted}</ul>'

    costliest = ""
    if p.get("costliest"):
        rows = [[html.escape(g["group"]), html.escape(CATEGORY_NAMES.get(g["category"], g["category"])),
                 f"{g['ops']:,.0f}", _seconds(g["seconds"])] for g in p["costliest"]]
        costliest = ("<h3>The costliest op groups</h3><p class=\"note\">Ops by region, pass (forward, backward, or "
                     "the forward recomputed for the backward) and what made them, a step.</p>"
                     + table(["op group", "kind", "ops", "seconds"], rows, {2, 3}))
    until = p.get("timeline_until", p["step_seconds"])
    cut = (f"<p class=\"note\">The timeline shows the first {_seconds(until)} of the step: it has more ops than a page "
           "draws.</p>" if until < p["step_seconds"] else "")
    return (f'<section id="step-time"><h2>Predicted step time</h2>{note}{summary}{breakdown}{costliest}'
            f"{_timeline(p['timeline'], p['step_seconds'])}{cut}</section>")


def _timeline(events: list[dict], total: float, width: int = 1180) -> str:
    """One step from left to right: the compute (coloured by what it is), the links (grey: a collective hidden
    behind compute; red: the compute waits for it), and the layers the compute belongs to."""
    if not events or total <= 0:
        return ""
    left, lane_h = 70, 22
    scale = (width - left - 10) / total
    lanes = {"compute": 18, "links": 18 + lane_h + 6}
    parts = [f'<text x="0" y="{lanes["compute"] + 15}">compute</text>',
             f'<text x="0" y="{lanes["links"] + 15}">links</text>']
    bands, exposed = [], 0
    for e in events:
        if e["lane"] not in lanes:  # a report.json olmax did not write
            continue
        x, w = left + e["start"] * scale, max((e["end"] - e["start"]) * scale, 0.3)
        colour = CATEGORY_COLOURS.get(e["category"], "#999")
        klass = f'event {html.escape(e["category"])}'
        title = ""
        if e["category"] == "exposed":
            exposed += 1
            title = (f"<title>{html.escape(str(e['label']))}: compute waits {_seconds(e['end'] - e['start'])} for a "
                     "collective</title>")
        parts.append(f'<rect class="{klass}" x="{x:.2f}" y="{lanes[e["lane"]]}" width="{w:.2f}" height="{lane_h}" '
                     f'fill="{colour}">{title}</rect>')
        if e["lane"] == "compute":
            if bands and bands[-1][2] == e["label"]:
                bands[-1][1] = e["end"]
            else:
                bands.append([e["start"], e["end"], e["label"]])
    y = lanes["links"] + lane_h + 8
    for i, (start, end, label) in enumerate(bands):
        x, w = left + start * scale, (end - start) * scale
        parts.append(f'<rect class="layer" x="{x:.2f}" y="{y}" width="{max(w, 0.3):.2f}" height="10" '
                     f'fill="{"#ddd" if i % 2 else "#eee"}"><title>{html.escape(str(label))}</title></rect>')
        if w > 60:
            parts.append(f'<text x="{x + 2:.1f}" y="{y + 22}">{html.escape(str(label))}</text>')
    parts.append(f'<text x="{left}" y="{y + 38}">0</text>'
                 f'<text x="{width - 80}" y="{y + 38}">{html.escape(_seconds(total))}</text>')
    legend = " ".join(f'<span class="swatch" style="background:{colour}"></span>{html.escape(name)}'
                      for name, colour in (("matmuls", CATEGORY_COLOURS["matmul"]),
                                           ("attention", CATEGORY_COLOURS["attention"]),
                                           ("memory-bound", CATEGORY_COLOURS["memory"]),
                                           ("collective hidden", CATEGORY_COLOURS["hidden"]),
                                           ("collective exposed", CATEGORY_COLOURS["exposed"])))
    return (f'<h3>One step</h3><p>{legend}</p><div class="scroll"><svg class="timeline" data-exposed="{exposed}" '
            f'width="{width}" height="{y + 46}">{"".join(parts)}</svg></div>')


def _target(r: dict) -> str:
    flags = r.get("xla_flags")
    tiles = r.get("attention_tiles")
    flag_text = (table(["XLA flag", "value"], [[f"<code>{html.escape(k)}</code>", fact(f"xla_flags.{k}", v)]
                                                for k, v in flags.items()])
                 + "<p><code>olmax train</code> compiles its step with them on these devices; as <code>"
                 + ("XLA_FLAGS" if str(r.get("target", "")).startswith("gpu") else "LIBTPU_INIT_ARGS") + "</code>: <code>"
                 + html.escape(" ".join(f"--{k}={str(v).lower()}" for k, v in flags.items())) + "</code></p>"
                 if flags else "<p>No XLA flag profile for this chip kind: the compiler's defaults.</p>")
    tile_text = (table(["tile", "size"], [[html.escape(k), fact(f"attention_tiles.{k}", v)] for k, v in tiles.items()])
                 if tiles else f"<p>{html.escape(str(r.get('attention', 'attention')))}: no kernel tiles.</p>")
    program = r.get("program")
    kernels = ("<p>Custom calls in the compiled program: "
               + html.escape(", ".join(f"{k} x{n}" for k, n in program["custom_calls"].items()) or "none")
               + f"; {html.escape(str(program['float8_matmuls']))} of {html.escape(str(program['matmuls']))} matmuls "
               "float8.</p>" if program else "")
    return (f'<section id="target"><h2>Target {html.escape(r["target"])}</h2><h3>Flag profile</h3>{flag_text}'
            f"<h3>Attention kernel tiles</h3>{tile_text}{kernels}</section>")


def page(r: dict) -> str:
    body = "\n".join(s for s in (_header(r), _mesh(r), _memory(r), _parameters(r), _collectives(r), _pipeline(r),
                                 _plan(r), _step_time(r), _target(r)) if s)
    return document(f"olmax: {r['config']} on {r['target']}", body)


def write(report: dict, directory: str) -> str:
    """DIR/report.json and DIR/index.html (DIR a local directory or a bucket URL); returns the page's path."""
    return write_files(directory, report, page(report))


def write_files(directory: str, report: dict, html_page: str) -> str:
    """DIR/report.json and DIR/index.html, each replaced whole in DIR opened once, through no symbolic link, even
    one planted while the report was made (run_dir.write_files); neither is written when either would be refused."""
    run_dir.write_files(directory, {"report.json": json.dumps(report, indent=1) + "\n", "index.html": html_page})
    return storage.join(directory, "index.html")
