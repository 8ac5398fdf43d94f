"""What a run costs on a target: chip-seconds per step, step time, chip-hours, at the step time the
step-time model predicts from the compiled program (olmax.scale.step_time) or at an MFU the user gives.

At an MFU, chip-seconds per step = training FLOPs of the global batch / (MFU x the chip's peak), the same on any
slice of one chip kind (the published OLMo 3 7B accounting: 0.76 s x 256 Ironwood chips ~ 3.05 s x 64
chips ~ 195 chip-s). Both FLOP counts are given: sliding windows counted exactly, and every layer
counted as global attention, the convention of MaxText's published MFU. The same wall time is a lower
MFU by the exact count; a plan at a given MFU is therefore cheaper by the exact count.
"""

from __future__ import annotations

from olmax.config import RunConfig
from olmax.figures import figure, percent, prefix, si
from olmax.model import flops
from olmax.parallel import schedules
from olmax.scale import anatomy, step_time
from olmax.scale.targets import Target

COUNTS = {"exact_window": "sliding windows exact", "all_global": "every layer global"}


def plan(cfg: RunConfig, target: Target, mfu: float | None = None, goodput: float | None = None,
         prediction: dict | None = None) -> dict:
    """The run's cost at `mfu` where one is given, else at the predicted step (`prediction`, the step-time
    model's report), else FLOPs alone. `goodput`: the share of wall time spent on productive steps (`olmax
    goodput` measures it); the chip-hours the run really costs are the steps' chip-hours over it."""
    seq = cfg.data.sequence_length
    count = flops.count(cfg.model, seq)
    tokens_per_step = cfg.train.global_batch_instances * seq
    peak = target.accelerator.peak_flops_per_chip
    step_seconds = prediction["step_seconds"] if prediction and mfu is None else None
    report = {
        "config": cfg.name,
        "target": target.name,
        "chips": target.chips,
        "devices": target.devices,
        "mfu": mfu,
        "mfu_from": "given" if mfu is not None else ("predicted" if step_seconds else None),
        "peak_tflops_per_chip": peak / 1e12,
        "tokens_per_step": tokens_per_step,
        "steps": cfg.train.steps,
        "tokens": tokens_per_step * cfg.train.steps,
        "pipeline": _pipeline(cfg),
        "goodput": goodput,
        "schedules": anatomy.schedules(cfg),
        "xla_flags": target.xla_flags,
    }
    per_token = {"exact_window": count.per_token, "all_global": count.per_token_all_global}
    for key, flops_per_token in per_token.items():
        step_flops = flops_per_token * tokens_per_step
        row = {"train_flops_per_token": flops_per_token, "tflop_per_device_step": step_flops / target.devices / 1e12}
        if mfu is not None or step_seconds:
            chip_seconds = step_flops / (mfu * peak) if mfu is not None else step_seconds * target.chips
            row.update({
                "mfu": step_flops / (chip_seconds * peak),
                "chip_seconds_per_step": chip_seconds,
                "step_seconds": chip_seconds / target.chips,
                "tokens_per_second_per_chip": tokens_per_step / chip_seconds,
                "chip_hours": chip_seconds * cfg.train.steps / 3600,
                "chip_hours_at_goodput": chip_seconds * cfg.train.steps / 3600 / goodput if goodput else None,
                "chip_hours_per_trillion_tokens": chip_seconds / tokens_per_step * 1e12 / 3600,
            })
        report[key] = row
    report["sustained_tflops_per_device"] = (report["exact_window"]["tflop_per_device_step"]
                                             / report["exact_window"]["step_seconds"]
                                             if "step_seconds" in report["exact_window"] else None)
    return report


def _pipeline(cfg: RunConfig) -> dict | None:
    sched = schedules.schedule_for(cfg)
    if sched is None:
        return None
    return {"schedule": sched.title, "stages": sched.stages, "microbatches": sched.microbatches,
            "chunks_per_stage": sched.repeats, "iterations": sched.iterations, "bubble_fraction": sched.bubble,
            "in_flight_microbatches": sched.in_flight, "summary": sched.describe()}


TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def _bytes(size: float) -> str:
    unit = next((u for u in ("GiB", "MiB", "KiB") if size >= 2 ** {"GiB": 30, "MiB": 20, "KiB": 10}[u]), "B")
    return f"{figure(size / 2 ** {'GiB': 30, 'MiB': 20, 'KiB': 10, 'B': 0}[unit])} {unit}"


def format_plan(report: dict, prediction: dict | None = None) -> str:
    """The plan as a table (both FLOP counts), with the predicted step's breakdown where there is one."""
    exact = report["exact_window"]
    flop_scale, flop = prefix(exact["train_flops_per_token"], 1e9)
    step_scale, step = prefix(exact["tflop_per_device_step"] * 1e12, 1e12)
    rows = [
        (f"train {flop}FLOP / token", "train_flops_per_token", lambda v: figure(v / flop_scale)),
        (f"{step}FLOP / device-step", "tflop_per_device_step", lambda v: figure(v * 1e12 / step_scale)),
    ]
    timed = "step_seconds" in exact
    if timed:
        time_scale, time_unit = next(((scale, u) for scale, u in TIME_UNITS if exact["step_seconds"] >= scale),
                                     TIME_UNITS[-1])
        rows += [
            ("MFU", "mfu", percent),
            ("chip-seconds / step", "chip_seconds_per_step", figure),
            (f"step time ({time_unit})", "step_seconds", lambda v: figure(v / time_scale)),
            ("tokens / s / chip", "tokens_per_second_per_chip", figure),
            ("chip-hours", "chip_hours", figure),
            ("chip-hours / T tokens", "chip_hours_per_trillion_tokens", figure),
        ]
        if report["goodput"]:
            rows.append((f"chip-h at {report['goodput']:.0%} goodput", "chip_hours_at_goodput", figure))
    token_scale, token_prefix = prefix(report["tokens"], 1e12)
    if report["mfu_from"] == "given":
        how = (f"at {percent(report['mfu'])} MFU (given) of a peak of {report['peak_tflops_per_chip']:,.0f} TFLOP/s "
               f"per chip (each device computing {si(report['sustained_tflops_per_device'] * 1e12, 'FLOP/s')})")
    elif report["mfu_from"] == "predicted":
        how = (f"at the step time predicted from the compiled program, of a peak of "
               f"{report['peak_tflops_per_chip']:,.0f} TFLOP/s per chip (each device computing "
               f"{si(report['sustained_tflops_per_device'] * 1e12, 'FLOP/s')})")
    else:
        how = "FLOPs only (no prediction: the step was not compiled; --mfu X gives a cost at an assumed MFU)"
    lines = [
        f"{report['config']} on {report['target']}: {report['chips']} chips, {report['devices']} devices, {how}",
        f"{report['steps']:,} steps of {report['tokens_per_step']:,} tokens = "
        f"{figure(report['tokens'] / token_scale)}{token_prefix} tokens",
        "",
        f"{'':24}{COUNTS['exact_window']:>24}{COUNTS['all_global']:>24}",
    ]
    for label, key, fmt in rows:
        lines.append(f"{label:24}{fmt(report['exact_window'][key]):>24}{fmt(report['all_global'][key]):>24}")
    if report["pipeline"]:
        lines += ["", f"pipeline: {report['pipeline']['summary']}; the MFU above is of the whole step, bubble included"]
    if prediction:
        lines += ["", *format_prediction(prediction)]
    return "\n".join(lines)


REGIONS = ("sliding", "global", "embedding and head", "optimizer and gradients", "other")
LABELS = {"matmul": "matmuls", "attention": "attention", "memory": "memory-bound", "collective": "exposed collectives"}


def format_prediction(prediction: dict) -> list[str]:
    """The predicted step's time by category and by layer kind, and its collectives, hidden and exposed; first its
    range, where it has one (olmax.scale.step_time.range_line)."""
    step = prediction["step_seconds"]
    scale, unit = next(((scale, u) for scale, u in TIME_UNITS if step >= scale), TIME_UNITS[-1])
    regions = [r for r in REGIONS if r in prediction["by_region"]] + sorted(
        set(prediction["by_region"]) - set(REGIONS))
    width = 14
    span = step_time.range_line(prediction)
    lines = [*([span] if span else []),
             f"predicted step {figure(step / scale)} {unit}, where the time goes ({unit}, one device):",
             f"{'':24}" + "".join(f"{r[:width - 1]:>{width}}" for r in regions) + f"{'total':>{width}}"]
    for category, label in LABELS.items():
        values = [prediction["by_region"][r][category] for r in regions]
        lines.append(f"{label:24}" + "".join(f"{figure(v / scale):>{width}}" for v in values)
                     + f"{figure(prediction['seconds'][category] / scale):>{width}}")
    c = prediction["collectives"]
    moved = ", ".join(f"{kind} {_bytes(size)}" for kind, size in sorted(c["bytes_by_kind"].items()))
    lines.append(f"collectives {figure(c['total_seconds'] / scale)} {unit} on the links ({moved or 'none'}): "
                 f"{figure(c['hidden_seconds'] / scale)} {unit} hidden behind compute, "
                 f"{figure(c['exposed_seconds'] / scale)} {unit} exposed")
    k = prediction["constants"]
    lines.append(f"model constants: {step_time.matmul_rate(k)}, memory at {k['memory_efficiency']:.0%} of "
                 f"{k['memory_bandwidth_per_device'] / 1e9:,.0f} GB/s, links at {k['collective_efficiency']:.0%} "
                 "(olmax.scale.targets)")
    return lines + step_time.notes(prediction)
