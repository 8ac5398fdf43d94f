"""`olmax tune`: the fastest layout that fits, found before the hardware exists.

The space is every way to lay the config's step out on the target (olmax.scale.tune_space). Each candidate is
compiled ahead of time (`olmax compile`'s step; programs cached by their text, so a rerun or a longer search
compiles only what is new), or at two reduced depths and extrapolated (olmax.scale.tune_depth), judged by the
compiler's peak memory (it fits with `headroom` to spare) and by the step-time model's prediction.

The search takes candidates in the order a quick estimate puts them (olmax.scale.tune_estimate: the recipe's FLOPs
plus what the remat policy recomputes, the weights and tokens the mesh moves, and the memory a device keeps: an
MoE's experts where the mesh puts them, with their optimizer state and routed rows): what fits fastest first, then
what is estimated over memory closest to fitting first. It compiles up to `budget` of them, and prunes by memory as
it learns: a candidate that keeps everything an out-of-memory one keeps, and more (a superset of its saved
activations, a larger micro-batch, the same mesh and flags; Splash's tiles live in VMEM, not HBM), is out of memory
too, and is not compiled; and the estimate is rescaled by what the compiler and the step-time model said of the
candidates so far (its memory and its time, per mesh), so the search moves to what fits and runs fast. What did not
compile for another reason is listed with the reason.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

from olmax.config import RunConfig, load_config
from olmax.figures import size
from olmax.model import flops
from olmax.progress import SILENCE, repeating
from olmax.scale.targets import Target
from olmax.scale.tune_depth import TRUSTED, at_depth, depths, extrapolated, trusted
from olmax.scale.tune_estimate import Estimate
from olmax.scale.tune_space import Candidate, given, pruned_by, space


@dataclass
class Result:
    candidate: Candidate
    status: str  # fits, over (fits the device, not the headroom), out of memory, failed, pruned
    peak: int | None = None
    step_seconds: float | None = None
    mfu: float | None = None
    tokens_per_chip: float | None = None
    compile_seconds: float = 0.0
    cached: bool = False
    reason: str = ""
    by: Candidate | None = None  # pruned: the out-of-memory candidate that proves it
    depths: tuple[int, int] | None = None  # extrapolated from compiles at these depths; None: compiled whole
    error: dict | None = None  # a confirmed extrapolation's relative error against the full compile
    whole: str = ""  # a depth-reduced search: why this layout was compiled whole

    def row(self) -> dict:
        return {"layout": self.candidate.describe(), "overrides": self.candidate.overrides(),
                "flags": self.candidate.flags, "status": self.status, "peak": self.peak,
                "step_seconds": self.step_seconds, "mfu": self.mfu, "tokens_per_second_per_chip": self.tokens_per_chip,
                "compile_seconds": self.compile_seconds, "cached": self.cached, "reason": self.reason,
                "pruned_by": self.by.describe() if self.by else None,
                "extrapolated_from": list(self.depths) if self.depths else None, "extrapolation_error": self.error,
                "compiled_whole_because": self.whole or None}


def evaluate(config: str, overrides: list[str], target_name: str, candidate: Candidate, headroom: float,
             reduced: bool = False) -> Result:
    """Compile one candidate and predict its step (run in a worker process: compiles run side by side): whole, or
    (`reduced`, where its depth allows: `depths`) at two depths, its figures extrapolated to the whole."""
    from olmax.scale import targets

    target = targets.parse_target(target_name)
    if not candidate.flags:
        target = _without_flags(target)
    start = time.perf_counter()
    try:
        cfg = load_config(config, [*overrides, *candidate.overrides()], target.name)
        at = depths(cfg) if reduced else None
        reports = [_compiled(cfg, target)] if at is None else [_compiled(at_depth(cfg, d), target) for d in at]
    except Exception as err:  # noqa: BLE001 - a candidate the compiler or the config refuses is listed with why
        return Result(candidate, "failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
                      compile_seconds=time.perf_counter() - start)
    seconds, cached = time.perf_counter() - start, all(r.get("compile_cached") for r in reports)
    for depth, report in zip(at or [cfg.model.n_layers], reports):
        if "step_time" in report:
            continue
        if "VmemOom" in report.get("compiler_error", ""):
            # Splash's tiles do not fit the cores' VMEM: a failure of this layout's tiles, not of its HBM
            return Result(candidate, "failed", reason="the attention tiles do not fit the cores' VMEM ("
                          + report["compiler_error"][:120] + ")", compile_seconds=seconds, cached=cached, depths=at)
        # the TPU compiler refused it: at a reduced depth, the whole needs more still
        needs = report.get("required") and report["required"] + report["parameters"] + report["optimizer_state"]
        return Result(candidate, "out of memory", needs if at is None else None, compile_seconds=seconds,
                      cached=cached, depths=at, reason=(report.get("compiler_error", "") if at is None else
                                                        f"out of memory at {depth} of {cfg.model.n_layers} layers"))
    peak = round(extrapolated(cfg.model.n_layers, at, [r["peak"] for r in reports]))
    step = extrapolated(cfg.model.n_layers, at, [r["step_time"]["step_seconds"] for r in reports])
    limit = reports[0]["memory_per_device"] * (1 - headroom)
    status = ("fits" if peak <= limit else "over headroom" if peak <= reports[0]["memory_per_device"]
              else "out of memory")
    seq = cfg.data.sequence_length
    tokens = cfg.train.global_batch_instances * seq
    mfu = flops.count(cfg.model, seq).per_token * tokens / target.devices / (
        step * reports[0]["step_time"]["constants"]["peak_flops_per_device"])
    return Result(candidate, status, peak, step, mfu, tokens / step / target.chips, seconds, cached, depths=at)


def _compiled(cfg: RunConfig, target: Target) -> dict:
    """`olmax compile`'s report of the step, one over the device's memory included."""
    from olmax.errors import DoesNotFit
    from olmax.scale.compile import compile_train_step

    try:
        return compile_train_step(cfg, target)
    except DoesNotFit as err:
        return err.report


def extrapolation_error(estimate: Result, full: Result) -> dict:
    """The relative error of an extrapolated peak and step against the full compile's."""
    return {"peak": estimate.peak / full.peak - 1 if full.peak else None,
            "step": estimate.step_seconds / full.step_seconds - 1 if full.step_seconds else None}



def _without_flags(target: Target) -> Target:
    """The target compiled with the compiler's defaults (its flag profile off)."""
    return _NoFlags(target.name, target.kind, target.topology, target.chips)


class _NoFlags(Target):
    @property
    def xla_flags(self) -> dict:
        return {}


@dataclass
class Search:
    results: list[Result] = field(default_factory=list)
    size: int = 0
    compiled: int = 0  # compiles run (not from the cache)
    seconds: float = 0.0
    reduced: bool = False  # depth-reduced compiles asked for

    def ranked(self) -> list[Result]:
        order = {"fits": 0, "over headroom": 1, "out of memory": 2, "failed": 3, "pruned": 4}
        return sorted(self.results, key=lambda r: (order[r.status], r.step_seconds or math.inf))

    @property
    def best(self) -> Result | None:
        return next((r for r in self.ranked() if r.status == "fits"), None)


def priority(seconds: float, memory: float, device_memory: float) -> tuple:
    """A candidate's place in the search by its estimate: what fits, fastest first; then what is estimated over
    memory, closest to fitting first (the fastest of those keeps the most, and is the furthest from fitting)."""
    return (False, seconds, memory) if memory <= device_memory else (True, memory, seconds)


def ordered(candidates: list[Candidate], key, tried: set = frozenset(), leader_first: bool = True) -> list[Candidate]:
    """The search's order: by the estimate (`key`: a candidate's `priority`), alternating with the best of each mesh
    not tried yet, then of each mesh and micro-batch not tried yet (`tried`: the (mesh, micro-batch) pairs compiled),
    so that a small budget sees many meshes, not one mesh's remat policies; while some candidates are estimated to
    fit, only their meshes take turns (the 1.2T MoE's meshes with fewer expert-parallel devices need 2-10 times a
    device's memory). `leader_first` False starts with the estimate's best. The search orders what is left again
    after each compile, alternating which comes first."""
    ranked = sorted(candidates, key=key)
    meshes = {mesh for mesh, _ in tried}
    best: dict = {}
    for c in [c for c in ranked if not key(c)[0]] or ranked:
        if (c.mesh, c.micro_batch) not in tried:
            best.setdefault((c.mesh, c.micro_batch), c)
    leaders = sorted(best.values(), key=lambda c: c.mesh in meshes)  # stable: by the estimate within each
    order, taken = [], set()
    pairs = itertools.zip_longest(leaders, ranked) if leader_first else itertools.zip_longest(ranked, leaders)
    for pair in pairs:
        for c in pair:
            if c is not None and c not in taken:
                taken.add(c)
                order.append(c)
    return order


def tune(config: str, overrides: list[str], target: Target, budget: int, headroom: float = 0.1, jobs: int = 1,
         progress=lambda line: None, reduced: bool = False) -> Search:
    cfg = load_config(config, overrides, target.name)
    candidates = given(space(cfg, target), overrides)
    device_memory = target.accelerator.memory_per_device * (1 - headroom)
    estimate = Estimate(cfg, target)
    estimates = {c: estimate(c) for c in candidates}
    # a mesh -> the compiler's peak over the estimate's (the largest), and the step-time model's prediction over the
    # estimate's (the latest), for the meshes compiled; a mesh not compiled yet takes the median of the others
    scale: dict = {}
    speed: dict = {}

    def learned(table: dict, mesh) -> float:
        known = sorted(table.values())
        return table.get(mesh, known[len(known) // 2] if known else 1.0)

    def key(c: Candidate):
        seconds, memory = estimates[c]
        seconds *= learned(speed, c.mesh)
        memory *= learned(scale, c.mesh)
        # the estimate cannot tell Splash's tiles apart: the config's own first, larger ones after
        tiles = 0 if c.tiles in (None, cfg.impl.attention.splash.block_q) else c.tiles / cfg.data.sequence_length
        return priority(seconds * (1 + tiles), memory, device_memory)

    remaining = ordered(candidates, key)
    progress(f"searching {len(candidates):,} layouts of {config} on {target.name} (remat, mesh, pipeline, ZeRO-1, "
             "micro-batch"
             f"{', Splash tiles' if any(c.tiles for c in candidates) else ''}"
             f"{', XLA flags' if target.xla_flags else ''}): up to {budget} compiles, {jobs} at a time, the most "
             "promising first")
    search = Search(size=len(candidates), reduced=reduced)
    out_of_memory: list[Candidate] = []
    start = time.perf_counter()
    evaluated = 0
    # depth-reduced compiles until a full compile of the first candidate they say fits shows them off by more than
    # TRUSTED (then every compile is whole); None: not checked yet
    trust: list[bool | None] = [None if reduced else False]

    def confirm(result: Result, pool) -> Result:
        """The candidate compiled whole in place of its extrapolation, with the extrapolation's error."""
        progress(f"confirming ({result.candidate.describe()}) by a full compile: extrapolated from "
                 f"{result.depths[0]} and {result.depths[1]} layers, {result.step_seconds:.4g} s, peak {size(result.peak)}")
        with repeating(TICK, lambda: progress(f"still compiling the confirmation ({time.perf_counter() - start:.0f} s "
                                              "so far)"), "olmax tune progress"):
            full = pool.submit(evaluate, config, overrides, target.name, result.candidate, headroom).result()
        full.error = extrapolation_error(result, full)
        full.compile_seconds += result.compile_seconds
        search.results[search.results.index(result)] = full
        search.compiled += not full.cached and full.status != "failed"
        misses = ", ".join(f"{name} {100 * e:+.1f}%" for name, e in full.error.items() if e is not None)
        progress(f"confirmed: {full.status}, " + (f"{full.step_seconds:.4g} s, peak {size(full.peak)}; the "
                 f"extrapolation missed by {misses}" if full.step_seconds else full.reason[:100]))
        if trust[0] is None:
            trust[0] = trusted(full.error)
            if not trust[0]:
                progress(f"the extrapolation missed by more than {TRUSTED:.0%}: the rest of the search compiles "
                         "whole layouts")
        return full

    with _pool(jobs) as pool:
        while evaluated < budget and remaining:
            batch = []
            while remaining and len(batch) < min(jobs, budget - evaluated):
                candidate = remaining.pop(0)
                if (by := pruned_by(candidate, out_of_memory)) is not None:
                    search.results.append(Result(candidate, "pruned", by=by,
                                                 reason=f"keeps everything {by.describe()} keeps, which ran out of "
                                                 "memory"))
                    continue
                batch.append(candidate)
            if not batch:
                break
            if not evaluated:
                progress(f"[0/{budget}] compiling {'; '.join(f'({c.describe()})' for c in batch)}")
            before = evaluated

            def waiting() -> str:
                return (f"[{evaluated}/{budget}] still compiling {len(batch) - (evaluated - before)} candidate(s) "
                        f"({time.perf_counter() - start:.0f} s so far)")

            # A compile here or in the workers takes minutes: said from a thread of its own, as the compile may hold
            # this one (an interrupt then comes when it returns).
            with repeating(TICK, lambda: progress(waiting()), "olmax tune progress"):
                at_depths = trust[0] is not False
                futures = [pool.submit(evaluate, config, overrides, target.name, c, headroom, at_depths)
                           for c in batch]
                for future in concurrent.futures.as_completed(futures):
                    result = future.result()
                    if reduced and not result.depths and result.status != "failed":
                        result.whole = SHALLOW if at_depths else MISSED
                    evaluated += 1
                    search.results.append(result)
                    search.compiled += (not result.cached and result.status != "failed") * (2 if result.depths else 1)
                    if result.depths and result.status == "fits" and trust[0] is None:
                        result = confirm(result, pool)
                    if result.status == "out of memory":
                        out_of_memory.append(result.candidate)
                    if result.peak:
                        mesh = result.candidate.mesh
                        scale[mesh] = max(scale.get(mesh, 0.0), result.peak / estimates[result.candidate][1])
                    if result.step_seconds:
                        speed[result.candidate.mesh] = result.step_seconds / estimates[result.candidate][0]
                    elapsed = time.perf_counter() - start
                    eta = elapsed / evaluated * (min(budget, len(candidates)) - evaluated)
                    figure = (f"{result.step_seconds:.4g} s, peak {size(result.peak)}" if result.step_seconds
                              else result.reason[:100])
                    way = f" (extrapolated from {result.depths[0]} and {result.depths[1]} layers)" if result.depths else ""
                    progress(f"[{evaluated}/{budget}] {result.candidate.describe()}: {result.status}, {figure}{way}"
                             f"{' (cached)' if result.cached else ''}; {elapsed:.0f} s so far, about {eta:.0f} s left")
            # what the compiler said reorders the rest; a mesh not tried yet and the estimate's best take turns
            tried = {(r.candidate.mesh, r.candidate.micro_batch) for r in search.results if r.status != "pruned"}
            remaining = ordered(remaining, key, tried, leader_first=evaluated % 2 == 0)
        # the best is a layout compiled whole: an extrapolated best is confirmed, and the next if it does not fit
        for _ in range(CONFIRMED):
            best = search.best
            if best is None or best.depths is None:
                break
            confirm(best, pool)
    search.seconds = time.perf_counter() - start
    return search


def _pool(jobs: int):
    """Worker processes to compile side by side, or this process for one job at a time (no start-up to pay)."""
    if jobs > 1:
        return concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    return _InProcess()


class _InProcess(concurrent.futures.Executor):
    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the caller as a process pool would
            future.set_exception(err)
        return future


CONFIRMED = 3  # full compiles at most to confirm the best of a depth-reduced search
# why a depth-reduced search compiled a layout whole
SHALLOW = "its repeated layers are under 4 units deep (a unit: a layer_pattern period on each stage and chunk)"
MISSED = f"an extrapolation confirmed before missed by more than {TRUSTED:.0%}"
TICK = SILENCE * 5 / 6  # seconds of compiling between two lines that say it goes on (olmax.progress's promise)


def default_jobs() -> int:
    """Compiles side by side: one a core, as many as the host's available memory holds at about 6 GiB each (a
    7B TPU compile's host peak was 4.1-4.3 GiB)."""
    try:
        available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        available = 8 * 2**30
    return max(1, min(len(os.sched_getaffinity(0)), available // (6 * 2**30)))


# --- what it writes -------------------------------------------------------------------------------------------------

def table(search: Search, target: Target, limit: int | None = None) -> str:
    lines = [f"{'#':>3}  {'step s':>9} {'MFU':>7} {'tokens/s/chip':>14} {'peak':>11}  {'status':15} layout"]
    shown = [r for r in search.ranked() if r.status != "pruned"]
    for i, r in enumerate(shown[:limit] if limit else shown, 1):
        step = f"{r.step_seconds:9.4g}" if r.step_seconds else f"{'-':>9}"
        mfu = f"{100 * r.mfu:6.3g}%" if r.mfu else f"{'-':>7}"
        tps = f"{r.tokens_per_chip:14,.0f}" if r.tokens_per_chip else f"{'-':>14}"
        peak = f"{size(r.peak):>11}" if r.peak else f"{'-':>11}"
        lines.append(f"{i:3}  {step} {mfu} {tps} {peak}  {r.status:15} {r.candidate.describe()}"
                     + (f"  ({r.reason})" if r.status == "failed" else "") + _how(r))
    return "\n".join(lines)


def _how(r: Result) -> str:
    """How a row's figures were found, where not by one compile of the whole."""
    if r.depths:
        return f"  (extrapolated from {r.depths[0]} and {r.depths[1]} layers)"
    if r.error:
        return "  (compiled whole; extrapolated " + ", ".join(
            f"{name} {100 * e:+.1f}%" for name, e in r.error.items() if e is not None) + ")"
    return f"  (compiled whole: {r.whole})" if r.whole else ""


def coverage(search: Search) -> str:
    counts = {s: sum(r.status == s for r in search.results)
              for s in ("fits", "over headroom", "out of memory", "failed", "pruned")}
    tried = len(search.results) - counts["pruned"]
    left = search.size - len(search.results)
    return (f"searched {len(search.results)} of {search.size} layouts: {tried} compiled ({search.compiled} programs "
            f"new, {sum(r.cached for r in search.results)} layouts from the cache), {counts['pruned']} pruned as out of memory "
            f"by a layout that keeps less; {counts['fits']} fit, {counts['over headroom']} over the headroom, "
            f"{counts['out of memory']} out of memory, {counts['failed']} failed; {left} not reached within the budget; "
            f"{_depths(search)}{search.seconds:.0f} s")


def _depths(search: Search) -> str:
    """How many layouts a depth-reduced search extrapolated, and why it compiled the others whole."""
    if not search.reduced:
        return ""
    why = {reason: sum(r.whole == reason for r in search.results) for reason in (SHALLOW, MISSED)}
    whole = "; ".join(f"{n} compiled whole as {reason}" for reason, n in why.items() if n)
    return f"{sum(bool(r.depths) for r in search.results)} by depth-reduced compiles{'; ' + whole if whole else ''}; "


def overlay(config: str, overrides: list[str], search: Search, target: Target) -> str:
    """The best layout as a config file: the whole config of the program compiled and ranked (CONFIG with its layout
    for the target, the settings given on the command line, the layout searched), so that it compiles and trains to
    that program, as `olmax train FILE` or merged over CONFIG (`olmax train CONFIG FILE`; its `base:` says which
    config it is for). `layouts: null`: CONFIG's layouts for targets, applied already, do not apply over it again."""
    import yaml

    best = search.best
    cfg = load_config(config, [*overrides, *best.candidate.overrides()], target.name)
    head = (f"# olmax tune {' '.join([config, *overrides])} --target {target.name}: the fastest layout that fits "
            f"({best.candidate.describe()})\n"
            f"# predicted step {best.step_seconds:.4g} s, MFU {100 * best.mfu:.3g}%, peak {size(best.peak)} a device\n"
            "# the whole config of the program ranked: what was given and what was searched, resolved\n")
    flag_note = ("" if best.candidate.flags or not target.xla_flags else
                 f"# compiled with the compiler's default flags: unset the {target.kind} profile on the chips\n")
    return head + flag_note + yaml.safe_dump({"base": config, **cfg.model_dump(mode="json"), "layouts": None},
                                             sort_keys=False)


def main_line(search: Search) -> str:
    best = search.best
    if best is None:
        return "no layout fits within the headroom among those searched; raise --budget or --headroom"
    return f"best: {best.candidate.describe()} at {best.step_seconds:.4g} s a step"


def print_err(line: str) -> None:
    print(f"olmax tune: {line}", file=sys.stderr, flush=True)

