"""A step's time predicted from its compiled program: a roofline per op, loops times their trip counts,
collectives costed on the target's links, asynchronous collectives hidden behind the compute scheduled
between their start and their done.

Every op of the optimized, scheduled HLO (olmax.scale.hlo) is costed on one device (olmax.scale.op_cost) of the
target (olmax.scale.hardware), and the step is simulated in the order the compiler scheduled it
(olmax.scale.simulator); where the grouped-matmul kernels' time rests on assumptions no measurement has checked
(their tiles' re-reads served by L2, cuBLAS's rate), again at the other end of them (`kernel_range`). The result
says where the time goes: matmuls, attention, memory-bound work and exposed collectives, by layer kind (from the op
names the model's named scopes write), the costliest op groups, plus a timeline of one step for the layout page;
`matmul_rate`, `range_line` and `notes` say in words what it assumed.
"""

from __future__ import annotations

import collections
import dataclasses

from olmax.scale import hlo
from olmax.scale.hardware import Hardware
from olmax.scale.op_cost import AttentionInfo, ExpertBlocks, ProgramCost
from olmax.scale.simulator import Simulator

CATEGORIES = ("matmul", "attention", "memory", "collective")  # compute categories, then exposed communication
# Where libtpu's estimated cycles and the roofline give steps further apart than this, a prediction is a range:
# neither is known to be the better (the v5p 7B's measured step fell between the two)
SPREAD = 0.10
COSTLIEST = 20  # op groups the prediction lists, by their seconds a step


def _downsample(events: list, total: float, limit: int = 4000) -> list:
    """The timeline's events, at most 2 x `limit` of them where there are more than `limit`: neighbours on one lane
    with one category closer than a `limit`-th of the step merged into one (it keeps the first's label), then the
    first 2 x `limit` of what is left, in time order."""
    if len(events) <= limit:
        return events
    quantum = total / limit
    merged = []
    for event in sorted(events, key=lambda e: (e[2], e[0])):
        last = merged[-1] if merged else None
        if last and last[2] == event[2] and last[3] == event[3] and event[0] - last[1] < quantum:
            merged[-1] = (last[0], max(last[1], event[1]), last[2], last[3], last[4])
        else:
            merged.append(event)
    return sorted(merged, key=lambda e: e[0])[: limit * 2]


def predict(text: str, hw: Hardware, coords: list[dict] | None = None, attention: AttentionInfo | None = None,
            model_flops_per_device: float | None = None, experts: ExpertBlocks | None = None) -> dict:
    """The predicted step of the compiled program `text` (optimized HLO) on `hw`: its time, where the time goes,
    and, given the model's FLOPs per device and step, the MFU those FLOPs make of the device's peak.

    `loops` lists the loops whose trip count the model derived (the program does not state it) with the count
    it assumed; `warnings` names what the model could not count: a loop without a derivable trip count (counted
    once) and a custom call it does not know (costed by its bytes only, `unknown_kernels` by calls a step).
    `libtpu_estimate`: the ops costed at libtpu's own cycle estimate, what the roofline gives for them, and the
    step with them at the roofline; where the two steps are more than SPREAD apart, `step_range` is both (shortest
    first), and `step_seconds` still the one at libtpu's estimate."""
    module = hlo.Module(text)
    simulator = Simulator(ProgramCost(module, hw, coords, attention, experts))
    tally = simulator.run()
    loops = collections.defaultdict(lambda: {"loops": 0})
    for scope, trips, basis in tally.derived_loops.values():
        loops[(scope, trips, basis)]["loops"] += 1
    warnings = [f"loop {name} ({op_name}): its trip count is data the model cannot derive; counted once"
                for name, op_name in sorted(tally.uncounted_loops.items())]
    warnings += [f"custom call {name} ({calls:,.0f} a step): an unknown kernel, costed by its bytes only (register "
                 "its work in olmax.model.kernel_registry)" for name, calls in sorted(tally.unknown_kernels.items())]
    step = tally.total
    by_category = collections.defaultdict(float)
    by_region = collections.defaultdict(lambda: collections.defaultdict(float))
    for (category, region), seconds in tally.seconds.items():
        by_category[category] += seconds
        by_region[region][category] += seconds
    peak = hw.matmul_flops["bf16"]
    report = {
        "hardware": hw.name,
        "step_seconds": step,
        "seconds": {c: by_category.get(c, 0.0) for c in CATEGORIES},
        "collectives": {"total_seconds": tally.collective_seconds, "exposed_seconds": by_category.get("collective", 0.0),
                        "hidden_seconds": max(tally.collective_seconds - by_category.get("collective", 0.0), 0.0),
                        "bytes_by_kind": dict(tally.collective_bytes)},
        "by_region": {r: {c: v.get(c, 0.0) for c in CATEGORIES} for r, v in sorted(by_region.items())},
        "executed_flops": tally.flops,
        "executed_ops": tally.ops,
        "costliest": [{"category": category, "group": group, "seconds": seconds, "ops": ops}
                      for (category, group), (seconds, ops) in sorted(tally.groups.items(), key=lambda kv: -kv[1][0])
                      [:COSTLIEST]],
        "loops": [{"scope": scope, "trips": trips, "basis": basis, **v} for (scope, trips, basis), v in loops.items()],
        "warnings": warnings,
        "unknown_kernels": dict(tally.unknown_kernels),
        "constants": {"matmul_efficiency": hw.matmul_efficiency, "memory_efficiency": hw.memory_efficiency,
                      "collective_efficiency": hw.collective_efficiency, "peak_flops_per_device": peak,
                      "memory_bandwidth_per_device": hw.memory_bandwidth, "gemm_table": hw.gemm_table,
                      "clock": hw.clock},
        "timeline": [{"start": s, "end": e, "lane": lane, "category": c, "label": label}
                     for s, e, lane, c, label in _downsample(tally.events, step)],
        "timeline_until": min(tally.timeline_cut, step),
    }
    if tally.estimated_ops:
        # the same step with those ops at the roofline: the other prediction, which the point figure does not follow
        roofline = Simulator(ProgramCost(module, dataclasses.replace(hw, clock=0.0), coords, attention, experts),
                             keep_events=0).run().total
        report["libtpu_estimate"] = {"ops": len(tally.estimated_ops), "seconds": tally.estimated_seconds,
                                     "roofline_seconds": tally.roofline_seconds, "clock": hw.clock,
                                     "roofline_step_seconds": roofline}
        if step and max(step, roofline) > (1 + SPREAD) * min(step, roofline):
            report["step_range"] = [min(step, roofline), max(step, roofline)]
    if tally.ranged_kernels:
        # the same step with the kernels at the slow end of their assumptions: tile loads from HBM, their designs'
        # rates
        slow = Simulator(ProgramCost(module, hw, coords, attention, experts, kernels="slow"), keep_events=0).run().total
        report["kernel_range"] = {"kernels": len(tally.ranged_kernels), "seconds": dict(tally.kernel_ends),
                                  "slow_step_seconds": slow}
        if step and slow > (1 + SPREAD) * step:
            report["step_range"] = [step, slow]
    if model_flops_per_device:
        report["model_flops_per_device"] = model_flops_per_device
        report["mfu"] = model_flops_per_device / (step * peak) if step else None
    return report


def matmul_rate(constants: dict) -> str:
    """In words, the rate a prediction's matmuls were costed at."""
    k = constants
    if k.get("gemm_table"):
        return (f"matmuls at XLA's measured rate for their shape and dtype ({k['gemm_table']} GEMM table; "
                f"{k['matmul_efficiency']:.0%} of the {k['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s peak at "
                "the largest shapes)")
    estimate = (f"; ops libtpu estimates, at its estimated cycles ({k['clock'] / 1e9:.3f} GHz)" if k.get("clock")
                else "")
    return (f"matmuls at {k['matmul_efficiency']:.0%} of the {k['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s peak, "
            f"derated where their dimensions do not fill the unit{estimate}")


def range_line(prediction: dict) -> str | None:
    """The predicted step as the range of its two predictions, in words, where it has one (`step_range`): the step
    and its MFU at each end, and which the point figure follows."""
    if not prediction.get("step_range"):
        return None
    from olmax.figures import figure, percent

    step, (low, high) = prediction["step_seconds"], prediction["step_range"]
    scale, unit = next(((scale, unit) for scale, unit in ((1.0, "s"), (1e-3, "ms")) if low >= scale), (1e-6, "us"))
    mfu = [f"{percent(prediction[key] * step / high)}-{percent(prediction[key] * step / low)}{count}"
           for key, count in (("mfu", " (exact count)"), ("mfu_all_global", " (every layer global)")) if prediction.get(key)]
    if estimate := prediction.get("libtpu_estimate"):
        other = estimate["roofline_step_seconds"]
        ends = (f"{figure(step / scale)} {unit} with its {estimate['ops']:,} ops at libtpu's estimated cycles, "
                f"{figure(other / scale)} {unit} with them at the roofline")
        follows = "libtpu's estimate"
    else:
        kernels, other = prediction["kernel_range"], prediction["kernel_range"]["slow_step_seconds"]
        ends = (f"{figure(step / scale)} {unit} with its {kernels['kernels']:,} grouped-matmul kernels' re-reads from "
                f"L2 at cuBLAS's rate, {figure(other / scale)} {unit} with every tile load from HBM at their designs' "
                "rates")
        follows = "L2 and cuBLAS's rate"
    return (f"predicted step {figure(low / scale)}-{figure(high / scale)} {unit}"
            f"{', MFU ' + ', '.join(mfu) if mfu else ''}: {ends}, {max(step, other) / min(step, other) - 1:.0%} apart; "
            f"the point figure follows {follows}")


def notes(prediction: dict) -> list[str]:
    """What a prediction assumed and could not count, in words: the loops whose trip counts it derived, libtpu's
    estimate against the roofline, and its warnings."""
    lines = [f"{loop['loops']} {loop['scope']} loops at {loop['trips']} trips each: {loop['basis']}"
             for loop in prediction.get("loops", [])]
    if estimate := prediction.get("libtpu_estimate"):
        lines.append(f"{estimate['ops']:,} ops at libtpu's estimated cycles: {estimate['seconds']:.4g} s a step, "
                     f"where the roofline gives them {estimate['roofline_seconds']:.4g} s")
    if kernels := prediction.get("kernel_range"):
        ends = kernels["seconds"]
        lines.append(f"{kernels['kernels']:,} grouped-matmul kernels: {ends['fast']:.4g} s a step with their tiles' "
                     f"re-reads from L2 at cuBLAS's rate; {ends['hbm']:.4g} s with every tile load from HBM, "
                     f"{ends['own_rate']:.4g} s at their designs' fraction of cuBLAS's rate (JAX's Blackwell matmul "
                     f"guide), {ends['slow']:.4g} s with both (the step {kernels['slow_step_seconds']:.4g} s)")
    return lines + [f"warning: {w}" for w in prediction.get("warnings", [])]

