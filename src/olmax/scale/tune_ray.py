"""The `ray` engine of `olmax tune`: each compile a Ray task on the cluster at --address, or on a local Ray started
for the command (olmax.data.tokenize_ray's `joined`); the search is olmax.scale.tune's, unchanged: this engine only
says where its compiles run. Imported only for `--engine ray`: nothing else needs Ray installed.

- Before the search every node with a CPU is asked, by a task pinned to it, whether it can compile the search's
  programs: the target's extra installed, the driver's JAX version, the config readable. One that cannot refuses
  the search, one line naming it and what it lacks; one that joins later and cannot is said and left unused. Tasks
  run only on the nodes that can (a label selector on Ray's node id).
- A task declares to Ray the host memory a compile holds, so that a node runs only the compiles it can hold: until
  a compile of this search has been measured, just over half the smallest node's memory (one compile a node); then
  the most a compile held (its worker's peak resident memory, reset before it) and a quarter more.
- A task whose worker process or node is lost is run again once, on another node (its first yield names the node it
  runs on); lost again, its candidate is reported lost, and the search goes on.
- Each task keeps its program in the compile cache when it ends: the driver's `OLMAX_COMPILE_CACHE` where it is set
  (a directory every node sees, or a bucket URL), else each node's own.
- What still runs when the search ends, or is interrupted (Ctrl-C), is cancelled: its workers are ended.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from olmax.errors import ClusterError, ConfigError, OlmaxError
from olmax.figures import size

if TYPE_CHECKING:
    from olmax.scale.tune import Result, Task

# JAX and the search are imported where they are used: a node's worker asked only whether it can compile
# (`_unable`) loads neither.

POLL_S = 1.0  # how long a wait for the tasks lasts before it is begun again (an interrupt comes between two)
TASK_NAME = "olmax-tune-compile"  # its worker's process title is ray::TASK_NAME while it runs one (-again: a rerun)
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
MEASURED_MARGIN = 1.25  # a compile's declared memory over the most one held so far
LOST = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError,
        ray.exceptions.ObjectLostError)  # a task's worker process, or its node, gone while it ran
TRIES = 2  # runs of a task whose worker is lost: once more, on another node
# The tasks' workers run JAX on the host's CPU from their start, as a compile does anyway (olmax.scale.targets'
# compile_only_devices): no accelerator backend is probed when they import JAX.
WORKERS = {"env_vars": {"JAX_PLATFORMS": "cpu"}}


@contextlib.contextmanager
def on_ray(address: str | None, jobs: int | None, args: tuple, progress):
    """olmax.scale.tune's engine on the Ray cluster at `address` (or a local Ray of `jobs` CPUs), its compiles
    `evaluate(*args[:3], candidate, args[3], reduced)`; what runs when the block ends is cancelled."""
    from olmax.data.tokenize_ray import joined

    # Ray's driver prints what the cluster tells it (a node marked dead, a worker killed) to stdout, which holds
    # the table (or --json) after the search: to stderr with the progress lines instead.
    with contextlib.redirect_stdout(sys.stderr), joined(address, jobs, error=ClusterError):
        compiles = RayCompiles(f"the Ray cluster at {address}" if address else "a local Ray", args, progress)
        try:
            yield compiles
        finally:
            compiles.cancel()


def _compile(config: str, overrides: list[str], target: str, candidate, headroom: float, reduced: bool,
             cache: str | None):
    """A Ray task, a generator: the id of the node it runs on first (so that a loss can name the node), then the
    candidate's Result and the most host memory its worker held while compiling it (bytes; 0 where not known)."""
    yield ray.get_runtime_context().get_node_id()
    import jax

    from olmax.scale.tune import evaluate

    if cache is not None:
        os.environ["OLMAX_COMPILE_CACHE"] = cache
    with contextlib.suppress(OSError):  # Linux: the peak resident memory (VmHWM) starts again from what is resident
        Path("/proc/self/clear_refs").write_text("5")
    result = evaluate(config, overrides, target, candidate, headroom, reduced)
    try:
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        peak = 0
    jax.clear_caches()  # the worker runs the next compile: what this one traced goes
    yield result, peak


def _unable(config: str, overrides: list[str], target: str, jax_version: str) -> str | None:
    """Why the node this runs on cannot compile the search's programs, or None."""
    from olmax.config import load_config
    from olmax.scale.targets import aot_missing, parse_target

    if reason := aot_missing(parse_target(target).platform):
        return reason
    if (here := importlib.metadata.version("jax")) != jax_version:
        return (f"it has JAX {here}, the driver {jax_version} (its programs would differ): install the same olmax "
                "on every node")
    try:
        load_config(config, overrides, target)
    except ConfigError as err:
        return f"{str(err).splitlines()[0]} (give a preset, or a config file at the same path on every node)"
    return None


class RayCompiles:
    """The compiles of one search as Ray tasks: olmax.scale.tune's engine (`submit`, `wait`, `running`, `slots`,
    `plan`)."""

    def __init__(self, where: str, args: tuple, progress):
        self.where, self.args, self.progress = where, args, progress
        self.cache = os.environ.get("OLMAX_COMPILE_CACHE")
        self.nodes: dict[str, dict] = {}  # node id -> ray.nodes()'s record, of the nodes that can compile
        self.unable: set[str] = set()
        self.tasks: dict = {}  # a task's generator -> the Task
        self.node_of: dict = {}  # a task's generator -> the node it runs on, once it has said
        self.losses: dict[Task, list[tuple[str | None, str]]] = {}  # (the node, the error) of each loss of a task
        self.measured = 0  # the most host memory a compile of this search held, bytes
        self.remote = ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD", runtime_env=WORKERS)(_compile)
        self._refresh(first=True)

    @property
    def running(self) -> set[Task]:
        return set(self.tasks.values())

    def _refresh(self, first: bool = False) -> None:
        """The nodes that can compile: those alive with a CPU, each asked once (`_unable`) when first seen. At the
        start one that cannot refuses the search (ConfigError); later it is said, and not used."""
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1}
        new = [i for i in alive if i not in self.nodes and i not in self.unable]
        config, overrides, target, _ = self.args
        probe = ray.remote(num_cpus=0, max_retries=0, runtime_env=WORKERS)(_unable)
        asked = {i: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote(
            config, overrides, target, importlib.metadata.version("jax")) for i in new}
        refused = []
        for i, ref in asked.items():
            try:
                why = ray.get(ref)
            except ray.exceptions.RayTaskError as err:  # olmax itself cannot run there
                why = f"olmax cannot run there ({type(err.cause).__name__}: {str(err.cause).splitlines()[0]})"
            except ray.exceptions.RayError:  # gone meanwhile
                continue
            if why is None:
                continue
            self.unable.add(i)
            refused.append(f"{_name(alive[i])} cannot compile for {target}: {why}")
        if refused and first:
            more = f" (and {len(refused) - 1} other node(s))" if len(refused) > 1 else ""
            raise ConfigError(refused[0] + more)
        for line in refused:
            self.progress(f"{line}; not used")
        self.nodes = {i: node for i, node in alive.items() if i not in self.unable}
        if not self.nodes and first:
            raise ConfigError(f"{self.where} has no node with a CPU to compile on: start one (`ray start "
                              "--address HEAD --num-cpus N`)")

    def declared(self) -> int:
        """The host memory a task declares to Ray (bytes)."""
        memories = [node["Resources"].get("memory", 0) for node in self.nodes.values()] or [0]
        wanted = self.measured * MEASURED_MARGIN if self.measured else min(memories) * 0.51
        return int(min(wanted, max(memories)))

    def slots(self) -> int:
        self._refresh()
        declared = max(self.declared(), 1)
        return sum(min(int(n["Resources"]["CPU"]), int(n["Resources"].get("memory", 0) // declared))
                   for n in self.nodes.values())

    def plan(self) -> str:
        cpus = sum(int(n["Resources"]["CPU"]) for n in self.nodes.values())
        memory = sum(n["Resources"].get("memory", 0) for n in self.nodes.values())
        return (f"{self.slots()} at a time on {self.where} ({len(self.nodes)} node(s): {cpus} CPUs, {size(memory)} of "
                "memory; one compile a node until a compile's host memory is measured)")

    def submit(self, task: Task) -> None:
        lost_on = {node for node, _ in self.losses.get(task, [])}
        allowed = sorted(i for i in self.nodes if i not in lost_on) or sorted(self.nodes)
        where = {"label_selector": {NODE_LABEL: f"in({','.join(allowed)})"}} if allowed else {}  # none: wait for one
        config, overrides, target, headroom = self.args
        name = f"{TASK_NAME}-again" if task in self.losses else TASK_NAME  # (its worker's process title)
        generator = self.remote.options(name=name, memory=self.declared(), **where).remote(
            config, overrides, target, task.candidate, headroom, task.reduced, self.cache)
        self.tasks[generator] = task

    def wait(self) -> list[tuple[Task, Result]]:
        """The tasks that finish next (at least one), with their results; a task lost the first time is run again."""
        finished = []
        while not finished:
            ready, _ = ray.wait(list(self.tasks), num_returns=1, timeout=POLL_S)
            for generator in ready:
                task = self.tasks[generator]
                try:
                    value = ray.get(next(generator))
                except LOST as err:
                    del self.tasks[generator]
                    finished += self._lost(task, self.node_of.pop(generator, None), err)
                    continue
                except ray.exceptions.RayTaskError as err:
                    if isinstance(err.cause, OlmaxError):
                        raise err.cause from None
                    raise
                if generator not in self.node_of:  # its first yield: the node it runs on
                    self.node_of[generator] = value
                    continue
                del self.tasks[generator], self.node_of[generator]
                result, peak = value
                self._measured(result, peak)
                finished.append((task, result))
        return finished

    def _lost(self, task: Task, node: str | None, err: Exception) -> list[tuple[Task, Result]]:
        """A task whose worker or node was lost: run again on another node, or, lost already, reported lost."""
        from olmax.scale.tune import Result

        losses = self.losses.setdefault(task, [])
        losses.append((node, type(err).__name__))
        where = _name(self.nodes[node]) if node in self.nodes else f"node {node[:8]}" if node else "its node"
        if len(losses) < TRIES:
            self.progress(f"lost ({task.candidate.describe()}) on {where} ({type(err).__name__}): compiling it again "
                          "on another node")
            self.submit(task)
            return []
        self.progress(f"lost ({task.candidate.describe()}) again, on {where} ({type(err).__name__}): reported lost")
        said = ", then ".join(f"{name} on node {node[:8] if node else '?'}" for node, name in losses)
        return [(task, Result(task.candidate, "lost", reason=f"its worker was lost {len(losses)} times ({said})"))]

    def _measured(self, result: Result, peak: int) -> None:
        """A compile's host memory: what a task declares from now on, and how many run at a time, said if it
        changed."""
        if result.cached or peak <= self.measured:
            return
        before = self.slots()
        self.measured = peak
        if (now := self.slots()) != before:
            self.progress(f"plan: a compile held up to {size(peak)} of its host's memory: {now} at a time on "
                          f"{self.where} now")

    def cancel(self) -> None:
        """End the tasks still running (their workers killed)."""
        for generator in self.tasks:
            ray.cancel(generator, force=True)
        self.tasks.clear()


def _name(node: dict) -> str:
    return f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
