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

The search (`Decisions`) is a pure function of the compiles' results: it takes them one at a time, in its own order,
whatever ran them. An engine runs the compiles: this process, worker processes of this host, or Ray tasks on a
cluster (olmax.scale.tune_ray); while the search waits for the result it needs, the compiles it is expected to ask
for next run on the slots left free, so the same results give the same table however many run at once.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

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
    status: str  # one of STATUSES: fits, over headroom (fits the device, not the headroom), ..., lost (its worker lost
    # twice: olmax.scale.tune_ray)
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


STATUSES = ("fits", "over headroom", "out of memory", "failed", "lost", "pruned")  # the table's order


@dataclass
class Search:
    results: list[Result] = field(default_factory=list)
    size: int = 0
    compiled: int = 0  # compiles run (not from the cache)
    seconds: float = 0.0
    ahead: int = 0  # compiles run ahead of the search that it did not need (kept in the compile cache)
    reduced: bool = False  # depth-reduced compiles asked for

    def ranked(self) -> list[Result]:
        order = {status: i for i, status in enumerate(STATUSES)}
        return sorted(self.results, key=lambda r: (order.get(r.status, len(order)), r.step_seconds or math.inf))

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
    # (a space holds up to about a million candidates, the 1.2T MoE's on 512 chips: each keyed once, and told apart
    # by identity, not by their fields' hash)
    keys = [key(c) for c in candidates]
    ranks = sorted(range(len(candidates)), key=keys.__getitem__)  # stable: ties keep their order
    ranked = [candidates[i] for i in ranks]
    meshes = {mesh for mesh, _ in tried}
    best: dict = {}
    for c in [candidates[i] for i in ranks if not keys[i][0]] or ranked:
        if (c.mesh, c.micro_batch) not in tried:
            best.setdefault((c.mesh, c.micro_batch), c)
    leaders = sorted(best.values(), key=lambda c: c.mesh in meshes)  # stable: by the estimate within each
    order, taken = [], set()
    pairs = itertools.zip_longest(leaders, ranked) if leader_first else itertools.zip_longest(ranked, leaders)
    for pair in pairs:
        for c in pair:
            if c is not None and id(c) not in taken:
                taken.add(id(c))
                order.append(c)
    return order


class Task(NamedTuple):
    """A compile the search asks for: a candidate, whole or (`reduced`) at two reduced depths."""

    candidate: Candidate
    reduced: bool


class Decisions:
    """The search itself, a pure function of the results it is given: the task it needs next (`next`, which records
    the candidates it prunes on the way), and what a task's result changes (`record`: what is out of memory, the
    estimate's scale per mesh, the order of what is left, whether extrapolations are trusted). Whatever compiles the
    tasks, and however many at once, the same results give the same candidates evaluated, the same table."""

    def __init__(self, cfg: RunConfig, target: Target, candidates: list[Candidate], budget: int, headroom: float,
                 reduced: bool, say=lambda line: None):
        self.cfg, self.budget, self.say = cfg, budget, say
        self.device_memory = target.accelerator.memory_per_device * (1 - headroom)
        estimate = Estimate(cfg, target)
        self.estimates = {c: estimate(c) for c in candidates}
        self.estimated = {id(c): figures for c, figures in self.estimates.items()}  # the same, found fast (`key`)
        # a mesh -> the compiler's peak over the estimate's (the largest), and the step-time model's prediction over
        # the estimate's (the latest), for the meshes compiled; a mesh not compiled yet takes the median of the others
        self.scale: dict = {}
        self.speed: dict = {}
        self.medians = (1.0, 1.0)  # of scale's and of speed's values
        self.remaining = ordered(candidates, self.key)
        self.search = Search(size=len(candidates), reduced=reduced)
        self.out_of_memory: list[Candidate] = []
        self.evaluated = 0
        # depth-reduced compiles until a full compile of the first candidate they say fits shows them off by more
        # than TRUSTED (then every compile is whole); None: not checked yet
        self.trust: bool | None = None if reduced else False
        self.confirming: Result | None = None  # an extrapolated result whose full compile the search waits for
        self.confirmed = 0  # confirmations of the best after the search (CONFIRMED at most)
        self.after = False  # the search is over: what is left is confirming its best
        self.start = time.perf_counter()

    def key(self, c: Candidate):
        seconds, memory = self.estimated.get(id(c)) or self.estimates[c]
        seconds *= self.speed.get(c.mesh, self.medians[1])
        memory *= self.scale.get(c.mesh, self.medians[0])
        # the estimate cannot tell Splash's tiles apart: the config's own first, larger ones after
        block_q, seq = self.cfg.impl.attention.splash.block_q, self.cfg.data.sequence_length
        tiles = 0 if c.tiles in (None, block_q) else c.tiles / seq
        return priority(seconds * (1 + tiles), memory, self.device_memory)

    def copy(self, looking: int) -> Decisions:
        """The search as it stands, to be asked what it would do next (it says nothing), over the first `looking`
        candidates of its order: those it takes next while the results change nothing (the best of each mesh and
        micro-batch not tried yet, in turns with the estimate's best, lead the order)."""
        twin = copy.copy(self)
        twin.say = lambda line: None
        twin.scale, twin.speed, twin.remaining = dict(self.scale), dict(self.speed), self.remaining[:looking]
        twin.out_of_memory = list(self.out_of_memory)
        twin.search = dataclasses.replace(self.search, results=list(self.search.results))
        return twin

    def next(self) -> Task | None:
        """The task whose result the search needs next, or None when it is over."""
        if self.confirming is not None:
            return Task(self.confirming.candidate, False)
        while not self.after and self.evaluated < self.budget and self.remaining:
            candidate = self.remaining.pop(0)
            if (by := pruned_by(candidate, self.out_of_memory)) is not None:
                self.search.results.append(Result(candidate, "pruned", by=by, reason=f"keeps everything "
                                                  f"{by.describe()} keeps, which ran out of memory"))
                continue
            return Task(candidate, self.trust is not False)
        # the best is a layout compiled whole: an extrapolated best is confirmed, and the next if it does not fit
        self.after = True
        best = self.search.best
        if self.confirmed == CONFIRMED or best is None or best.depths is None:
            return None
        self.confirmed += 1
        return self._confirm(best)

    def _confirm(self, result: Result) -> Task:
        self.confirming = result
        self.say(f"confirming ({result.candidate.describe()}) by a full compile: extrapolated from "
                 f"{result.depths[0]} and {result.depths[1]} layers, {result.step_seconds:.4g} s, peak {size(result.peak)}")
        return Task(result.candidate, False)

    def record(self, result: Result) -> Result | None:
        """The result of the task `next` gave; returns the candidate's evaluation when this completes one (a
        depth-reduced one that fits waits for its confirmation, a confirmation after the search completes none)."""
        if self.confirming is not None:
            result = self._confirmed(self.confirming, result)
            if self.after:
                return None
        else:
            self.evaluated += 1
            if self.search.reduced and not result.depths and result.status != "failed":
                result.whole = SHALLOW if self.trust is not False else MISSED
            self.search.results.append(result)
            self.search.compiled += (not result.cached and result.status != "failed") * (2 if result.depths else 1)
            if result.depths and result.status == "fits" and self.trust is None:
                self._confirm(result)
                return None
        if result.status == "out of memory":
            self.out_of_memory.append(result.candidate)
        mesh = result.candidate.mesh
        if result.peak:
            self.scale[mesh] = max(self.scale.get(mesh, 0.0), result.peak / self.estimates[result.candidate][1])
        if result.step_seconds:
            self.speed[mesh] = result.step_seconds / self.estimates[result.candidate][0]
        self.medians = tuple(sorted(t.values())[len(t) // 2] if t else 1.0 for t in (self.scale, self.speed))
        # what the compiler said reorders the rest; a mesh not tried yet and the estimate's best take turns
        tried = {(r.candidate.mesh, r.candidate.micro_batch) for r in self.search.results if r.status != "pruned"}
        self.remaining = ordered(self.remaining, self.key, tried, leader_first=self.evaluated % 2 == 0)
        return result

    def _confirmed(self, extrapolated: Result, full: Result) -> Result:
        """The candidate compiled whole in place of its extrapolation, with the extrapolation's error."""
        self.confirming = None
        full.error = extrapolation_error(extrapolated, full)
        full.compile_seconds += extrapolated.compile_seconds
        self.search.results[self.search.results.index(extrapolated)] = full
        self.search.compiled += not full.cached and full.status != "failed"
        misses = ", ".join(f"{name} {100 * e:+.1f}%" for name, e in full.error.items() if e is not None)
        self.say(f"confirmed: {full.status}, " + (f"{full.step_seconds:.4g} s, peak {size(full.peak)}; the "
                 f"extrapolation missed by {misses}" if full.step_seconds else full.reason[:100]))
        if self.trust is None:
            self.trust = trusted(full.error)
            if not self.trust:
                self.say(f"the extrapolation missed by more than {TRUSTED:.0%}: the rest of the search compiles "
                         "whole layouts")
        return full


def said(result: Result) -> str:
    """A compiled candidate in a progress line: its layout, status and figures, and how they were found."""
    figure = f"{result.step_seconds:.4g} s, peak {size(result.peak)}" if result.step_seconds else result.reason[:100]
    way = f" (extrapolated from {result.depths[0]} and {result.depths[1]} layers)" if result.depths else ""
    return (f"{result.candidate.describe()}: {result.status}, {figure}{way}"
            f"{' (cached)' if result.cached else ''}")


def tune(config: str, overrides: list[str], target: Target, budget: int, headroom: float = 0.1, jobs: int = 1,
         progress=lambda line: None, reduced: bool = False, engine=None) -> Search:
    """The search (`Decisions`), its compiles run `jobs` at a time on this host (one: in this process), or by
    `engine(args, progress)`, a context manager of an engine (olmax.scale.tune_ray's on Ray) whose compiles are
    `evaluate(*args[:3], candidate, args[3], reduced)`."""
    cfg = load_config(config, overrides, target.name)
    candidates = given(space(cfg, target), overrides)
    decisions = Decisions(cfg, target, candidates, budget, headroom, reduced, progress)
    args = (config, overrides, target.name, headroom)
    with (engine(args, progress) if engine else _Processes(jobs, args) if jobs > 1
          else contextlib.nullcontext(_InProcess(args))) as compiles:
        progress(f"searching {len(candidates):,} layouts of {config} on {target.name} (remat, mesh, pipeline, ZeRO-1, "
                 "micro-batch"
                 f"{', Splash tiles' if any(c.tiles for c in candidates) else ''}"
                 f"{', XLA flags' if target.xla_flags else ''}): up to {budget} compiles, {compiles.plan()}, the most "
                 "promising first")
        decisions.search.ahead = drive(decisions, compiles, progress)
    decisions.search.seconds = time.perf_counter() - decisions.start
    return decisions.search


def drive(decisions: Decisions, compiles, progress) -> int:
    """Give the search the result of each task it asks for, from `compiles`; while it waits, the tasks it is
    expected to ask for next start on the slots left free (`_ahead`). Returns how many of those it did not need."""
    done: dict[Task, Result] = {}
    needed = set()
    while (task := decisions.next()) is not None:
        needed.add(task)
        while task not in done:
            starting = _ahead(decisions, task, done, compiles)
            if not done and not compiles.running:
                progress(f"[0/{decisions.budget}] compiling {'; '.join(f'({t.candidate.describe()})' for t in starting)}")

            def waiting() -> str:
                return (f"[{decisions.evaluated}/{decisions.budget}] still compiling {len(compiles.running)} "
                        f"candidate(s) ({time.perf_counter() - decisions.start:.0f} s so far)")

            # A compile here or in the workers takes minutes: said from a thread of its own, as the compile may hold
            # this one (an interrupt then comes when it returns).
            with repeating(TICK, lambda: progress(waiting()), "olmax tune progress"):
                for t in starting:
                    compiles.submit(t)
                finished = compiles.wait()
            for t, result in finished:
                done[t] = result
                if t != task:
                    progress(f"compiled ahead of the search: {said(result)}")
        if (evaluated := decisions.record(done[task])) is not None:
            progress(f"[{decisions.evaluated}/{decisions.budget}] {said(evaluated)}; "
                     + _time_left(decisions, done, needed, compiles.slots()))
    return sum(1 for t, result in done.items() if t not in needed and not result.cached)


def _time_left(decisions: Decisions, done: dict, needed: set, slots: int) -> str:
    """The time so far and the time left: the compiles left to run (those the search has yet to ask for, less those
    run ahead of it already), a slot each, at the mean time of those finished."""
    elapsed = time.perf_counter() - decisions.start
    left = min(decisions.budget, decisions.search.size) - decisions.evaluated - sum(t not in needed for t in done)
    mean = sum(r.compile_seconds for r in done.values()) / len(done)
    eta = mean * math.ceil(max(left, 0) / max(slots, 1))
    return f"{elapsed:.0f} s so far, about {eta:.0f} s left ({elapsed + eta:.0f} s in all)"


def _ahead(decisions: Decisions, need: Task, done: dict, compiles) -> list[Task]:
    """The tasks to start now: `need` unless it runs already, then, while the engine has slots free, those the
    search is expected to ask for next (what it would ask if the results under way changed nothing)."""
    starting = [] if need in compiles.running else [need]
    free = compiles.slots() - len(compiles.running) - len(starting)
    if free <= 0:
        return starting
    twin = decisions.copy(LOOKING_AHEAD)
    twin.record(Result(need.candidate, "compiling"))
    while free > 0 and (task := twin.next()) is not None:
        if task in done:
            twin.record(done[task])
            continue
        if task not in compiles.running and task not in starting:
            starting.append(task)
            free -= 1
        twin.record(Result(task.candidate, "compiling"))
    return starting


class _InProcess:
    """One compile at a time, in this process (no start-up to pay). An engine: `submit(task)`, `wait()` (the tasks
    finished, at least one, with their results), `running` (the tasks under way), `slots()` (how many at a time),
    `plan()` (that, in words)."""

    def __init__(self, args: tuple):
        self.args, self.running, self.finished = args, set(), []

    def slots(self) -> int:
        return 1

    def plan(self) -> str:
        return "1 at a time"

    def submit(self, task: Task) -> None:
        self.running.add(task)
        config, overrides, target, headroom = self.args
        self.finished.append((task, evaluate(config, overrides, target, task.candidate, headroom, task.reduced)))
        self.running.discard(task)

    def wait(self) -> list[tuple[Task, Result]]:
        finished, self.finished = self.finished, []
        return finished


class _Processes:
    """`jobs` compiles side by side, in worker processes of this host; those still running when the search ends
    (compiles it asked for ahead and did not need) are killed with them."""

    def __init__(self, jobs: int, args: tuple):
        spawn = multiprocessing.get_context("spawn")
        self.jobs, self.running, self.todo, self.done = jobs, set(), spawn.Queue(), spawn.Queue()
        self.workers = [spawn.Process(target=_compile_tasks, args=(self.todo, self.done, args), daemon=True)
                        for _ in range(jobs)]
        for worker in self.workers:
            worker.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for worker in self.workers:
            worker.kill()  # SIGKILL: JAX's handler of SIGTERM would print a stack for each
            worker.join()

    def slots(self) -> int:
        return self.jobs

    def plan(self) -> str:
        return f"{self.jobs} at a time"

    def submit(self, task: Task) -> None:
        self.running.add(task)
        self.todo.put(task)

    def wait(self) -> list[tuple[Task, Result]]:
        finished = [self.done.get()]
        while not self.done.empty():
            finished.append(self.done.get())
        for task, outcome in finished:
            self.running.discard(task)
            if isinstance(outcome, BaseException):
                raise outcome
        return finished


def _compile_tasks(todo, done, args: tuple) -> None:
    """A worker process of `_Processes`: the tasks of `todo`, evaluated, onto `done`. Ctrl-C is the command's to
    handle (it ends the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config, overrides, target, headroom = args
    while True:
        task = todo.get()
        try:
            done.put((task, evaluate(config, overrides, target, task.candidate, headroom, task.reduced)))
        except Exception as err:  # noqa: BLE001 - raised in the command, as a pool would
            done.put((task, err))


CONFIRMED = 3  # full compiles at most to confirm the best of a depth-reduced search
# Candidates of the order a guess of the search's next compiles looks at (ordering them all again for each guess
# took 26 s for the 1.2T MoE's 1.25 million on 512 v5p chips): many more than the meshes and micro-batches lead.
LOOKING_AHEAD = 20_000
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


def print_err(line: str) -> None:
    print(f"olmax tune: {line}", file=sys.stderr, flush=True)

