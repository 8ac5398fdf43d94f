"""What a run costs on a target at an assumed MFU: chip-seconds per step, step time, chip-hours.

Chip-seconds per step = training FLOPs of the global batch / (MFU x the chip's peak), the same on any
slice of one chip kind (the published OLMo 3 7B accounting: 0.76 s x 256 Ironwood chips ~ 3.05 s x 64
chips ~ 195 chip-s). Both FLOP counts are given: sliding windows counted exactly, and every layer
counted as global attention, the convention of MaxText's published MFU. The same wall time is a lower
MFU by the exact count; a plan at a given MFU is therefore cheaper by the exact count.
"""

from __future__ import annotations

from olmax.config import RunConfig
from olmax.model import flops
from olmax.parallel import pipeline
from olmax.scale.targets import Target

COUNTS = {"exact_window": "sliding windows exact", "all_global": "every layer global"}


def plan(cfg: RunConfig, target: Target, mfu: float) -> dict:
    seq = cfg.data.sequence_length
    count = flops.count(cfg.model, seq)
    tokens_per_step = cfg.train.global_batch_instances * seq
    sustained_per_chip = mfu * target.accelerator.peak_flops_per_chip
    report = {
        "config": cfg.name,
        "target": target.name,
        "chips": target.chips,
        "devices": target.devices,
        "mfu": mfu,
        "peak_tflops_per_chip": target.accelerator.peak_flops_per_chip / 1e12,
        "sustained_tflops_per_device": sustained_per_chip / target.accelerator.devices_per_chip / 1e12,
        "tokens_per_step": tokens_per_step,
        "steps": cfg.train.steps,
        "tokens": tokens_per_step * cfg.train.steps,
        "pipeline": _pipeline(cfg),
    }
    per_token = {"exact_window": count.per_token, "all_global": count.per_token_all_global}
    for key, flops_per_token in per_token.items():
        chip_seconds = flops_per_token * tokens_per_step / sustained_per_chip
        report[key] = {
            "train_flops_per_token": flops_per_token,
            "tflop_per_device_step": flops_per_token * tokens_per_step / target.devices / 1e12,
            "chip_seconds_per_step": chip_seconds,
            "step_seconds": chip_seconds / target.chips,
            "tokens_per_second_per_chip": tokens_per_step / chip_seconds,
            "chip_hours": chip_seconds * cfg.train.steps / 3600,
            "chip_hours_per_trillion_tokens": chip_seconds / tokens_per_step * 1e12 / 3600,
        }
    return report


def _pipeline(cfg: RunConfig) -> dict | None:
    sched = pipeline.schedule_for(cfg)
    if sched is None:
        return None
    return {"schedule": sched.name, "stages": sched.stages, "microbatches": sched.microbatches,
            "chunks_per_stage": sched.repeats, "iterations": sched.iterations, "bubble_fraction": sched.bubble,
            "in_flight_microbatches": sched.in_flight, "summary": sched.describe()}


SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def _prefix(value: float, largest: float) -> tuple[float, str]:
    """The largest SI prefix up to `largest` that writes `value` with a digit before the point."""
    return next(((scale, p) for scale, p in SI_PREFIXES if scale <= largest and abs(value) >= scale),
                SI_PREFIXES[-1])


def _figure(value: float) -> str:
    """Four significant digits below 100, whole numbers with thousands separators above: a tiny model's
    figures are not printed as zeros."""
    return f"{value:,.0f}" if abs(value) >= 100 or value == 0 else f"{value:.4g}"


def format_plan(report: dict) -> str:
    exact = report["exact_window"]
    flop_scale, flop = _prefix(exact["train_flops_per_token"], 1e9)
    step_scale, step = _prefix(exact["tflop_per_device_step"] * 1e12, 1e12)
    time_scale, time_unit = next(((scale, u) for scale, u in TIME_UNITS if exact["step_seconds"] >= scale),
                                 TIME_UNITS[-1])
    rows = [
        (f"train {flop}FLOP / token", "train_flops_per_token", lambda v: _figure(v / flop_scale)),
        (f"{step}FLOP / device-step", "tflop_per_device_step", lambda v: _figure(v * 1e12 / step_scale)),
        ("chip-seconds / step", "chip_seconds_per_step", _figure),
        (f"step time ({time_unit})", "step_seconds", lambda v: _figure(v / time_scale)),
        ("tokens / s / chip", "tokens_per_second_per_chip", _figure),
        ("chip-hours", "chip_hours", _figure),
        ("chip-hours / T tokens", "chip_hours_per_trillion_tokens", _figure),
    ]
    token_scale, token_prefix = _prefix(report["tokens"], 1e12)
    lines = [
        f"{report['config']} on {report['target']}: {report['chips']} chips, {report['devices']} devices, "
        f"at {report['mfu']:.1%} MFU of {report['peak_tflops_per_chip']:,.0f} TFLOP/s per chip "
        f"({report['sustained_tflops_per_device']:,.1f} TFLOP/s per device)",
        f"{report['steps']:,} steps of {report['tokens_per_step']:,} tokens = "
        f"{_figure(report['tokens'] / token_scale)}{token_prefix} tokens",
        "",
        f"{'':24}{COUNTS['exact_window']:>24}{COUNTS['all_global']:>24}",
    ]
    for label, key, fmt in rows:
        lines.append(f"{label:24}{fmt(report['exact_window'][key]):>24}{fmt(report['all_global'][key]):>24}")
    if report["pipeline"]:
        lines += ["", f"pipeline: {report['pipeline']['summary']}; the MFU above is of the whole step, bubble included"]
    return "\n".join(lines)
