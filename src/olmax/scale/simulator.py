"""A step's timeline from its costed ops (olmax.scale.op_cost): ops run in the order the compiler scheduled
them; an asynchronous collective (a `-start` / `-done` pair, or an async call) runs beside the compute between its
start and its done, and only what is left when the done is reached is exposed. A loop's body is simulated twice
(a collective started in one iteration may finish in the next) and its second iteration counts for all the rest.
A loop whose trip count the program does not state runs as often as the model derives: the experts' block loops
(olmax.model.moe.block_loop) and a bounded exchange's rounds past its first (olmax.parallel.expert.rounds) by the
routing's expectation (op_cost.ExpertBlocks); any other such loop once, named in the tally.

The tally (`Tally`) says where the time goes: seconds by category and region (the layer kind, from the op names
the model's named scopes write: `layer_of`, `region_of`), by op group (`op_group`), and a timeline of one step.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass, field

from olmax.scale import hlo
from olmax.scale.op_cost import ProgramCost

LAYER = re.compile(r"[/(]layer(\d+)\.(\w+)[/)]")


def layer_of(instruction: hlo.Instruction) -> tuple[str | None, str | None]:
    """(layer label, layer kind) from the op's name, as the model's named scopes wrote it: a path part under a
    scan (`.../layer3.global/...`), a transform's argument where the layers are unrolled (`jvp(layer3.global)`)."""
    found = LAYER.search(f"/{instruction.op_name}/")
    if found:
        return f"layer{found.group(1)}.{found.group(2)}", found.group(2)
    return None, None


def region_of(instruction: hlo.Instruction, layer_kind: str | None) -> str:
    """What a layer-less op belongs to: the loss and LM head or embedding (inside the loss function), or the
    optimizer update and gradient reduction (outside it)."""
    if layer_kind:
        return layer_kind
    name = instruction.op_name
    if not name:
        return "other"
    return "embedding and head" if "closed_call" in name else "optimizer and gradients"


def op_group(module: hlo.Module, instruction: hlo.Instruction, region: str) -> str:
    """What an op is, for the table of where a step's time goes: its region, its pass (forward, backward, or the
    forward recomputed for the backward), the last part of its op name (the JAX operation or named scope that made
    it) and, for a fusion, what the fused computation ends in."""
    name = instruction.op_name
    if "rematted_computation" in name:
        step = "recomputed"
    elif "transpose(" in name:
        step = "backward"
    elif "jvp(" in name:
        step = "forward"
    else:
        step = ""
    parts = [p for p in name.split("/") if p and not re.fullmatch(r"(jit|jvp|transpose|vmap)\(.*\)|while|body|"
                                                                 r"closed_call|checkpoint|rematted_computation|"
                                                                 r"layer\d+\.\w+|jit\(\w+\)", p)]
    what = re.sub(r"_tile_m=[^/]*", "", "/".join(parts[-2:])) or instruction.op  # a kernel's name less its tiles
    if instruction.op == "fusion" and instruction.calls():
        fused = module.computation(instruction.calls()[0])
        if fused is not None and fused.instructions:
            what += f" ({fused.root.op} fusion)"
    elif instruction.op not in what:
        what += f" ({instruction.op})"
    return f"{region}{' ' + step if step else ''}: {what}"


@dataclass
class Tally:
    """What a step's simulation counted: seconds by (category, region), the compute waiting for collectives among
    them (category `collective`); every collective's seconds and bytes, hidden or not; FLOPs and ops; the loops
    whose trip counts were derived or could not be; the kernels it did not know; the ops at libtpu's estimate; the
    kernels whose time is a range, at each end; and the timeline's events."""

    seconds: dict = field(default_factory=lambda: collections.defaultdict(float))
    collective_seconds: float = 0.0
    collective_bytes: dict = field(default_factory=lambda: collections.defaultdict(float))
    flops: float = 0.0
    ops: float = 0.0  # compute ops launched a step (a loop's body's as often as it runs)
    derived_loops: dict = field(default_factory=dict)  # while op -> (its scope, the trips assumed, why)
    uncounted_loops: dict = field(default_factory=dict)  # while op -> its op name: no count derivable, counted once
    unknown_kernels: dict = field(default_factory=lambda: collections.defaultdict(float))  # name -> calls a step
    estimated_ops: set = field(default_factory=set)  # ops costed at libtpu's estimated cycles
    estimated_seconds: float = 0.0  # their seconds a step at those cycles
    roofline_seconds: float = 0.0  # and at the roofline
    ranged_kernels: set = field(default_factory=set)  # kernels whose time is a range (op_cost.KERNEL_ENDS)
    kernel_ends: dict = field(default_factory=lambda: collections.defaultdict(float))  # their seconds a step, by end
    total: float = 0.0  # the step's seconds
    timeline_cut: float = math.inf  # where the timeline stops, when a step has more events than it keeps
    events: list = field(default_factory=list)  # (start, end, lane, category, label) of the timeline
    # (category, op_group) -> [seconds, ops]
    groups: dict = field(default_factory=lambda: collections.defaultdict(lambda: [0.0, 0.0]))


@dataclass
class Clock:
    compute: float = 0.0  # when the compute stream is free
    links: float = 0.0  # when the collective stream is free
    copies: float = 0.0  # when the asynchronous copy engine is free
    pending: dict = field(default_factory=dict)  # async op name -> (start, finish, kind: a collective's or copy)
    order: list = field(default_factory=list)  # pending names in start order


class Simulator:
    def __init__(self, cost: ProgramCost, keep_events: int = 200_000):
        self.cost, self.keep_events = cost, keep_events
        self.module = cost.module

    def run(self) -> Tally:
        tally = Tally()
        clock = Clock()
        self._computation(self.module.computation(self.module.entry), clock, tally, 1.0, record=True)
        tally.total = clock.compute
        return tally

    def _event(self, tally, record, start, end, lane, category, label):
        if record and end > start and len(tally.events) >= self.keep_events:
            tally.timeline_cut = min(tally.timeline_cut, start)
        elif record and end > start:
            last = tally.events[-1] if tally.events else None
            if last and last[2] == lane and last[3] == category and last[4] == label and abs(last[1] - start) < 1e-12:
                tally.events[-1] = (last[0], end, lane, category, label)
            else:
                tally.events.append((start, end, lane, category, label))

    def _computation(self, computation: hlo.Computation, clock: Clock, tally: Tally, weight: float, record: bool,
                     region: str | None = None, layer: str | None = None, kind: str | None = None):
        """Ops without an op name (the partitioner's collectives, kernels' custom calls) belong to the layer of the
        op before them."""
        for instruction in computation.instructions:
            label, found = layer_of(instruction)
            if label or instruction.op_name:
                layer, kind = label, found
                region = region_of(instruction, kind)
            self._instruction(computation, instruction, clock, tally, weight, record, region or "other", layer, kind)

    def _instruction(self, computation, instruction, clock, tally, weight, record, region, layer, kind):
        op = instruction.op
        module = self.module
        if op == "while":
            body = module.computation((instruction.attribute("body") or "").lstrip("%"))
            trips = module.trip_count(instruction, computation)
            if body is None:
                return
            if trips is None:  # bounded by data: the routing's expectation for the experts' block loops
                trips = self._derived_trips(instruction, tally)
            if trips == 0:
                return
            self._computation(body, clock, tally, weight, record, region, layer)
            if trips > 1:
                mark = len(tally.events)
                second_start = clock.compute
                self._computation(body, clock, tally, weight * (trips - 1), record, region, layer)
                per = clock.compute - second_start
                if record:  # the timeline shows every iteration: the second's events again, shifted
                    repeat = tally.events[mark:]
                    for t in range(1, trips - 1):
                        for (s, e, lane, cat, lab) in repeat:
                            self._event(tally, True, s + t * per, e + t * per, lane, cat, lab)
                shift = per * (trips - 2)  # the iterations after the second, which take as long
                clock.compute += shift
                clock.links += shift
                clock.copies += shift
                clock.pending = {k: (a + shift, b + shift, c) for k, (a, b, c) in clock.pending.items()}
            return
        if op in ("call", "conditional") and not op.endswith("-start"):
            called = [module.computation(c) for c in instruction.calls()]
            called = [c for c in called if c is not None]
            if op == "conditional" and called:
                # the longest branch: simulate each on a copy of the clock, keep the slowest
                best = None
                for branch in called:
                    trial = Clock(clock.compute, clock.links, clock.copies, dict(clock.pending), list(clock.order))
                    scratch = Tally()
                    self._computation(branch, trial, scratch, weight, False, region, layer)
                    if best is None or trial.compute > best[0].compute:
                        best = (trial, branch)
                self._computation(best[1], clock, tally, weight, record, region, layer)
                return
            for callee in called:
                self._computation(callee, clock, tally, weight, record, region, layer)
            return
        kind_name = op.removesuffix("-start")
        if op.endswith("-start") or op == "async-start":
            self._start(computation, instruction, clock, tally, weight, record, region, layer)
            return
        if op.endswith("-done") or op == "async-done":
            self._done(instruction, clock, tally, weight, record, region, layer)
            return
        if kind_name in hlo.COLLECTIVES:  # synchronous: the compute waits for it
            cost = self.cost.collective(computation, instruction, kind_name)
            start = max(clock.compute, clock.links)
            end = start + cost.seconds
            self._exposed(tally, weight, end - clock.compute, region, kind_name)
            tally.collective_seconds += weight * cost.seconds
            tally.collective_bytes[kind_name] += weight * cost.bytes
            self._event(tally, record, start, end, "links", "exposed", layer or region)
            clock.compute = clock.links = end
            return
        cost = self.cost.compute(computation, instruction, kind)
        if cost is None:
            return
        if cost.unknown_kernel:
            tally.unknown_kernels[cost.unknown_kernel] += weight
        if cost.kernel_ends is not None:
            tally.ranged_kernels.add(instruction.name)
            for end, seconds in cost.kernel_ends.items():
                tally.kernel_ends[end] += weight * seconds
        if cost.roofline is not None:
            tally.estimated_ops.add(instruction.name)
            tally.estimated_seconds += weight * cost.seconds
            tally.roofline_seconds += weight * cost.roofline
        start = clock.compute
        clock.compute += cost.seconds
        tally.seconds[(cost.category, region)] += weight * cost.seconds
        tally.flops += weight * cost.flops
        tally.ops += weight
        group = tally.groups[(cost.category, op_group(self.module, instruction, region))]
        group[0] += weight * cost.seconds
        group[1] += weight
        self._event(tally, record, start, clock.compute, "compute", cost.category, layer or region)

    @staticmethod
    def _exposed(tally, weight, seconds, region, kind):
        """Seconds the compute waited for a collective (or an asynchronous copy): in its region's exposed
        collectives, and in the op groups as the collective's kind, exposed."""
        tally.seconds[("collective", region)] += weight * seconds
        group = tally.groups[("collective", f"{region}: {kind} (exposed)")]
        group[0] += weight * seconds
        group[1] += weight

    def _derived_trips(self, loop: hlo.Instruction, tally: Tally) -> int:
        """The trip count of a loop the compiled program does not state: an expert block loop's from the
        routing's expectation (ExpertBlocks), and so the rounds of a bounded exchange past its first; any other
        loop's cannot be derived: it counts once, and is named."""
        experts = self.cost.experts
        if experts is not None and f"/{experts.scope}/" in f"/{loop.op_name}/":
            tally.derived_loops[loop.name] = (experts.scope, experts.trips, experts.basis())
            return experts.trips
        if experts is not None and experts.buffer_slots and f"/{experts.overflow_scope}/" in f"/{loop.op_name}/":
            tally.derived_loops[loop.name] = (experts.overflow_scope, experts.overflow_trips, experts.overflow_basis())
            return experts.overflow_trips
        tally.uncounted_loops[loop.name] = loop.op_name or loop.name
        return 1

    def _async_kind(self, instruction: hlo.Instruction) -> tuple[str, hlo.Computation | None, hlo.Instruction | None]:
        """(collective kind or 'copy' or 'call', the computation and instruction that does the work)."""
        op = instruction.op
        if op in ("async-start", "call-start"):
            called = self.module.computation(instruction.calls()[0]) if instruction.calls() else None
            if called is not None:
                root = called.root
                kind = root.op.removesuffix("-start")
                if kind in hlo.COLLECTIVES:
                    return kind, called, root
                return "call", called, root
            return "call", None, None
        kind = op.removesuffix("-start")
        return (kind if kind in hlo.COLLECTIVES else "copy"), None, instruction

    def _start(self, computation, instruction, clock, tally, weight, record, region, layer):
        kind, inner_computation, inner = self._async_kind(instruction)
        if kind in hlo.COLLECTIVES:
            cost = self.cost.collective(inner_computation or computation, inner, kind)
            start = max(clock.compute, clock.links)
            clock.links = start + cost.seconds
            finish = clock.links
            tally.collective_seconds += weight * cost.seconds
            tally.collective_bytes[kind] += weight * cost.bytes
        elif kind == "call" and inner_computation is not None:
            # work on another engine (the SparseCores' offloaded collectives): its own clock
            trial = Clock(max(clock.compute, clock.links), clock.links, clock.copies)
            scratch = Tally()
            Simulator(self.cost)._computation(inner_computation, trial, scratch, 1.0, False, region, layer)
            finish = trial.compute
            start = max(clock.compute, clock.links)
            tally.collective_seconds += weight * (finish - trial.links)
            clock.links = finish
        else:  # an asynchronous copy (memory space, host offload): the copy engine at HBM bandwidth
            moved = sum(a.bytes for a in self.cost.operands(computation, instruction))
            start = max(clock.compute, clock.copies)
            clock.copies = start + moved / (self.cost.hw.memory_bandwidth * self.cost.hw.memory_efficiency)
            finish = clock.copies
        clock.pending[instruction.name] = (start, finish, kind)
        clock.order.append(instruction.name)

    def _done(self, instruction, clock, tally, weight, record, region, layer):
        name = next((o for o in instruction.operands if o in clock.pending), None)
        if name is None:  # started in an earlier loop iteration, passed through the loop's tuple: the oldest alike
            kind = instruction.op.removesuffix("-done")
            name = next((n for n in clock.order if clock.pending[n][2] == kind or
                         (kind == "async" and clock.pending[n][2] != "copy")), None)
        if name is None:
            return
        start, finish, kind = clock.pending.pop(name)
        on_links = kind != "copy"
        clock.order.remove(name)
        if on_links:  # the timeline's links lane: hidden while the compute went on, exposed while it waited
            self._event(tally, record, start, min(finish, clock.compute), "links", "hidden", layer or region)
        if finish > clock.compute:
            self._exposed(tally, weight, finish - clock.compute, region, kind)
            if on_links:
                self._event(tally, record, clock.compute, finish, "links", "exposed", layer or region)
            clock.compute = finish

