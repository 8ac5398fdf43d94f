"""`olmax tune`: the fastest layout that fits, found before the hardware exists.

The space is every way to lay the config's step out on the target: the remat policy (which named activations
the backward pass keeps: none of them, any set of them, or everything), the mesh (the target's devices factored
over pipeline stages, data, fsdp and tensor, and expert for an MoE), with stages the pipeline's schedule, its
micro-batches and chunks, ZeRO-1, the micro-batch a device runs, Splash's tiles on a TPU, and the target's XLA
flag profile against the compiler's defaults. Each candidate is compiled ahead of time
(`olmax compile`'s step; programs cached by their text, so a rerun or a longer search compiles only what is new),
judged by the compiler's peak memory (it fits with `headroom` to spare) and by the step-time model's prediction.

The search takes candidates in the order a quick estimate puts them (the recipe's FLOPs plus what the remat
policy recomputes, the weights and tokens the mesh moves, and the memory a device keeps: an MoE's experts where the
mesh puts them, with their optimizer state and routed rows): what fits fastest first, then what is estimated over
memory closest to fitting first. It compiles up to `budget` of them, and prunes by memory as it learns: a candidate that keeps everything an out-of-memory one keeps, and more (a superset
of its saved activations, a larger micro-batch, the same mesh and flags; Splash's tiles live in VMEM, not HBM), is
out of memory too, and is not compiled; and the estimate is rescaled by what the compiler and the step-time model
said of the candidates so far (its memory and its time, per mesh), so the search moves to what
fits and runs fast. What did not compile for another reason is listed with the reason.
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

from jax.sharding import AbstractMesh

from olmax.config import MESH_AXES, PipelineConfig, RunConfig, load_config
from olmax.errors import ConfigError
from olmax.figures import size
from olmax.model import families, flops
from olmax.parallel import expert as expert_parallel
from olmax.parallel import pipeline
from olmax.parallel.mesh import Layout, spec_axes
from olmax.progress import SILENCE, repeating
from olmax.scale import anatomy
from olmax.scale.targets import Target

NAMED = ("qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "context")  # what a remat policy can keep
EVERYTHING = frozenset({*NAMED, "*"})  # remat none: every activation kept, named or not


@dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]  # (axis, size) for data, fsdp, tensor, expert
    saved: frozenset  # the activations kept for the backward pass (EVERYTHING: remat none)
    micro_batch: int  # instances a device runs a micro-step
    tiles: int | None  # Splash's query and key tile, None where it has none
    flags: bool  # the target's XLA flag profile
    pipeline: tuple[str, int, int | None] | None = None  # with stages: (schedule, micro-batches, repeats or None)
    zero1: bool = False  # the optimizer state sharded over the axes its parameter is replicated on

    @property
    def remat(self):
        if self.saved == EVERYTHING:
            return "none"
        return [n for n in NAMED if n in self.saved] if self.saved else "full"

    def overrides(self) -> list[str]:
        remat = self.remat if isinstance(self.remat, str) else "[" + ",".join(self.remat) + "]"
        found = [f"mesh.{axis}={size}" for axis, size in self.mesh] + [
            f"impl.remat={remat}", f"train.micro_batch_per_device={self.micro_batch}",
            f"impl.shard_optimizer={str(self.zero1).lower()}"]
        if self.pipeline:
            schedule, microbatches, repeats = self.pipeline
            found += [f"impl.pipeline.schedule={schedule}", f"impl.pipeline.microbatches={microbatches}",
                      f"impl.pipeline.repeats={'null' if repeats is None else repeats}"]
        if self.tiles:
            found += [f"impl.attention.splash.block_q={self.tiles}", f"impl.attention.splash.block_kv={self.tiles}",
                      f"impl.attention.splash.block_kv_compute={self.tiles}"]
        return found

    def describe(self) -> str:
        mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh if size > 1) or "one device"
        remat = self.remat if isinstance(self.remat, str) else "+".join(self.remat)
        tiles = f", tiles {self.tiles}" if self.tiles else ""
        stages = ""
        if self.pipeline:
            schedule, microbatches, repeats = self.pipeline
            stages = f"{schedule}{f' x {repeats} chunks' if repeats else ''}, {microbatches} pipeline micro-batches; "
        return (f"{mesh}; {stages}remat {remat}; micro-batch {self.micro_batch}{tiles}; "
                f"{'ZeRO-1; ' if self.zero1 else ''}flags {'on' if self.flags else 'off'}")

    def same_but_memory(self, other: Candidate) -> bool:
        """The same layout but for what it keeps (Splash's tiles live in the cores' VMEM, not in HBM)."""
        return (self.mesh, self.flags, self.pipeline) == (other.mesh, other.flags, other.pipeline)

    def keeps_at_least(self, other: Candidate) -> bool:
        """Everything `other` keeps in memory, this keeps too: its saved activations, its micro-batch and its
        optimizer state (whole where `other` holds it whole)."""
        return (self.same_but_memory(other) and self.saved >= other.saved and self.micro_batch >= other.micro_batch
                and self.zero1 <= other.zero1)


def pruned_by(candidate: Candidate, out_of_memory: list[Candidate]) -> Candidate | None:
    """The out-of-memory candidate that proves this one out of memory too, if any."""
    return next((o for o in out_of_memory if candidate.keeps_at_least(o)), None)


# --- the space ----------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stages(cfg: RunConfig, devices: int) -> list[int]:
    """Pipeline stages to search: the config's, none, and 2 to 16 that divide the devices and the layer_pattern
    periods of the depth (a model with dense layers first runs unpipelined: one stack of like layers a pipeline)."""
    groups = cfg.model.n_layers // len(cfg.model.layer_pattern)
    found = {cfg.mesh.stage, 1}
    if not cfg.model.dense_layers:
        found |= {s for s in (2, 4, 8, 16) if devices % s == 0 and groups % s == 0}
    return sorted(found)


def pipelines(cfg: RunConfig, stage: int) -> list[tuple[str, int, int | None] | None]:
    """The pipeline settings searched with `stage` stages: each schedule the config can run (a random routing
    runs no 1F1B), with one and two micro-batches a stage, the circular ones with 2 chunks a stage and with the
    most the depth allows; the config's own among them."""
    if stage == 1:
        return [None]
    own = cfg.impl.pipeline
    tried = {(own.schedule, own.microbatches or stage, own.repeats)} if stage == cfg.mesh.stage else set()
    for schedule, microbatches in itertools.product(pipeline.SCHEDULES, (stage, 2 * stage)):
        tried |= {(schedule, microbatches, repeats) for repeats in ((None, 2) if schedule in ("circular",
                  "interleaved_1f1b") else (None,))}
    found = set()
    for schedule, microbatches, repeats in tried:
        try:
            chunks = pipeline.schedule_for(configured(cfg, stage, (schedule, microbatches, repeats))).repeats
        except ConfigError:
            continue
        found.add((schedule, microbatches, chunks if chunks > 1 else None))  # as many chunks, the same schedule
    return sorted(found, key=str)


def configured(cfg: RunConfig, stage: int, setting: tuple | None, remat=None) -> RunConfig:
    """`cfg` with these pipeline stages and setting (and remat policy), unvalidated: for estimates and checks."""
    impl = {"pipeline": PipelineConfig(schedule=setting[0], microbatches=setting[1], repeats=setting[2])} if setting else {}
    if remat is not None:
        impl["remat"] = remat
    return cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"stage": stage}),
                                  "impl": cfg.impl.model_copy(update=impl)})


def meshes(cfg: RunConfig, devices: int) -> list[tuple[tuple[str, int], ...]]:
    """The target's devices factored over the mesh axes the model allows: pipeline stages (`stages`), tensor
    parallelism up to 8 (within a host or a torus dimension) dividing the heads, expert parallelism dividing the
    experts (an MoE), the rest data x fsdp; the batch must split over the data-parallel devices."""
    m = cfg.model
    found = []
    heads = math.gcd(m.n_heads, m.kv_heads)
    for stage, tensor in itertools.product(stages(cfg, devices), [t for t in _divisors(min(8, devices))
                                                                  if heads % t == 0 and m.mlp_hidden % t == 0]):
        experts = _divisors(m.moe.num_experts) if m.mlp == "moe" else [1]
        for expert in [e for e in experts if devices % (stage * tensor * e) == 0]:
            rest = devices // (stage * tensor * expert)
            for data in _divisors(rest):
                fsdp = rest // data
                if cfg.train.global_batch_instances % (data * fsdp * expert):
                    continue
                found.append((("data", data), ("fsdp", fsdp), ("tensor", tensor), ("expert", expert),
                              ("stage", stage)))
    return found


def remat_policies() -> list[frozenset]:
    """Keeping nothing, every set of the named activations, and everything."""
    return ([frozenset(c) for r in range(len(NAMED) + 1) for c in itertools.combinations(NAMED, r)] + [EVERYTHING])


def space(cfg: RunConfig, target: Target) -> list[Candidate]:
    seq = cfg.data.sequence_length
    tiles = [None]
    if target.platform == "tpu" and cfg.impl.attention.implementation in ("auto", "splash"):
        tiles = [t for t in (512, 1024, 2048) if t <= seq and seq % t == 0] or [None]
    flags = [True, False] if target.xla_flags else [False]
    found = []
    for mesh in meshes(cfg, target.devices):
        dp = math.prod(size for axis, size in mesh if axis in ("data", "fsdp", "expert"))
        per_device = cfg.train.global_batch_instances // dp
        # ZeRO-1 where some parameter is replicated: over data, and an MoE's experts over fsdp too
        replicated = dict(mesh)["data"] * (dict(mesh)["fsdp"] if cfg.model.mlp == "moe" else 1)
        sharded = [False, True] if replicated > 1 else [False]
        for setting in pipelines(cfg, dict(mesh)["stage"]):
            split = setting[1] if setting else 1  # a micro-step's rows are cut into the pipeline's micro-batches
            for micro in [b for b in _divisors(per_device) if (b & (b - 1) == 0 or b == per_device) and b % split == 0]:
                for saved, tile, flag, zero1 in itertools.product(remat_policies(), tiles, flags, sharded):
                    found.append(Candidate(mesh, saved, micro, tile, flag, setting, zero1))
    return found


def given(candidates: list[Candidate], overrides: list[str]) -> list[Candidate]:
    """The candidates that agree with the settings given on the command line: a setting given is not searched
    (`mesh.expert=8` searches the layouts with 8-way expert parallelism only). ConfigError where none agrees."""
    def settings(words):
        return dict(w.replace(" ", "").split("=", 1) for w in words if "=" in w)

    pinned = settings(overrides)
    found = [c for c in candidates if all(pinned.get(k, v) == v for k, v in settings(c.overrides()).items())]
    if not found:
        searched = sorted(k for k in pinned if any(k in settings(c.overrides()) for c in candidates))
        raise ConfigError(f"no layout of the target agrees with {', '.join(f'{k}={pinned[k]}' for k in searched)}: "
                          "drop or change those settings")
    return found


# --- a quick estimate, to try the most promising first ---------------------------------------------------------------

class Estimate:
    """(seconds, bytes a device) of a candidate before compiling: the training FLOPs and what the policy recomputes
    at the matmul rate; the weights the mesh gathers each micro-step, the gradients it reduces and an MoE's tokens
    exchanged, at the links' rate; and the parameters, gradients and optimizer state a device holds (as the config's
    mesh rules shard them: an MoE's experts over the expert and stage axes only, never gathered), the activations
    the policy saves, and an MoE layer's routed rows and its experts' weights in its backward pass. Only an order
    for the search: the compiled program and the step-time model judge. Figures per mesh and per (remat,
    micro-batch) are kept, as the search estimates tens of thousands of candidates."""

    def __init__(self, cfg: RunConfig, target: Target):
        self.cfg, self.target = cfg, target
        self.count = flops.count(cfg.model, cfg.data.sequence_length)
        self.params = families.table(cfg.model)
        self.expert_params = sum(math.prod(p.shape) for p in self.params if "experts" in p.axes)
        self._held: dict = {}
        self._saved: dict = {}
        self._bubble: dict = {}
        self._figures: dict = {}

    def held(self, mesh: dict) -> tuple[int, int]:
        """(dense, expert) parameters one device holds on `mesh`."""
        key = tuple(mesh.items())
        if key not in self._held:
            layout = Layout(AbstractMesh(tuple(mesh[a] for a in MESH_AXES), MESH_AXES),
                            {name: tuple(axes) for name, axes in self.cfg.mesh.rules.items()})
            held = [0, 0]
            for p in self.params:
                spec = layout.spec(p.axes, p.shape)
                held["experts" in p.axes] += math.prod(p.shape) // math.prod(
                    mesh[axis] for entry in spec for axis in spec_axes(entry))
            self._held[key] = tuple(held)
        return self._held[key]

    def saved(self, candidate: Candidate) -> int:
        """The activations one device keeps for the backward pass (before tensor parallelism splits them)."""
        stage = dict(candidate.mesh)["stage"]
        key = (candidate.saved, candidate.micro_batch, stage, candidate.pipeline)
        if key not in self._saved:
            self._saved[key] = anatomy.saved_activation_bytes(
                configured(self.cfg, stage, candidate.pipeline, candidate.remat),
                candidate.micro_batch * self.cfg.data.sequence_length, 2)
        return self._saved[key]

    def layer_tokens(self, candidate: Candidate) -> int:
        """The tokens a device runs a layer on at a time (a stage runs one of the pipeline's micro-batches)."""
        split = candidate.pipeline[1] if candidate.pipeline else 1
        return candidate.micro_batch * self.cfg.data.sequence_length // split

    def bubble(self, candidate: Candidate) -> float:
        """The share of a stage's time idle in the pipeline's fill and drain."""
        if not candidate.pipeline:
            return 0.0
        key = (dict(candidate.mesh)["stage"], candidate.pipeline)
        if key not in self._bubble:
            self._bubble[key] = pipeline.schedule_for(configured(self.cfg, *key)).bubble
        return self._bubble[key]

    def routed(self, candidate: Candidate) -> tuple[int, int, int]:
        """An MoE layer on one device, at a time: (the rows its experts run, the expert outputs it gathers back,
        the rows it receives over the expert axis); zeros for a dense model. Each device of an expert group runs its
        experts on what its peers send: with a capacity a peer, that many rows from each; dropless, every token of
        the group, once for each local expert it chose, or with impl.moe.ep_buffer a round's buffer
        (olmax.parallel.expert, olmax.model.moe.gmm)."""
        cfg, m = self.cfg, self.cfg.model
        if m.mlp != "moe":
            return 0, 0, 0
        tokens, k = self.layer_tokens(candidate), m.moe.top_k
        peers = dict(candidate.mesh)["expert"]
        local = m.moe.num_experts // peers
        if peers == 1:
            return tokens * min(k, local), tokens * k, 0
        if cfg.impl.moe.ep_capacity is not None:
            received = peers * expert_parallel.peer_capacity(tokens, k, peers, cfg.impl.moe.ep_capacity)
            return received, received, received
        if cfg.impl.moe.ep_buffer is not None:  # a round's buffer, the expected routing's one round
            slots = expert_parallel.receive_slots(tokens, m.moe.num_experts, k, peers, cfg.impl.moe.ep_buffer)
            return slots, slots, min(slots, peers * tokens)
        return peers * tokens * min(k, local), peers * tokens * k, peers * tokens

    def __call__(self, candidate: Candidate) -> tuple[float, float]:
        # Splash's tiles and the flag profile do not change the estimate: one figure for all of them
        key = (candidate.mesh, candidate.saved, candidate.micro_batch, candidate.pipeline, candidate.zero1)
        if key not in self._figures:
            self._figures[key] = self._estimate(candidate)
        return self._figures[key]

    def _estimate(self, candidate: Candidate) -> tuple[float, float]:
        cfg, target, count = self.cfg, self.target, self.count
        m, seq = cfg.model, cfg.data.sequence_length
        mesh = dict(candidate.mesh)
        tokens = cfg.train.global_batch_instances * seq / target.devices
        hidden = m.moe.top_k * m.moe.expert_hidden if m.mlp == "moe" else m.mlp_hidden
        per_token = {"qkv_proj": (m.n_heads + 2 * m.kv_heads) * m.head_size * m.d_model,
                     "out_proj": m.n_heads * m.head_size * m.d_model, "mlpwi_0": m.d_model * hidden,
                     "mlpwi_1": m.d_model * hidden, "mlpwo": hidden * m.d_model,
                     "context": 2 * m.n_heads * m.head_size * min(seq, m.sliding_window or seq)}
        kept = NAMED if candidate.saved == EVERYTHING else candidate.saved
        recompute = sum(2 * v for name, v in per_token.items() if name not in kept) * m.n_layers
        a = target.accelerator
        rate = a.peak_flops_per_chip / a.devices_per_chip * a.matmul_efficiency
        compute = tokens * (count.per_token + recompute) / rate / (1 - self.bubble(candidate))
        dense, experts = self.held(mesh)
        weights = 2 * (count.params - self.expert_params)  # bf16 bytes FSDP gathers (experts stay resident)
        micro_steps = cfg.train.global_batch_instances // (candidate.micro_batch * math.prod(
            size for axis, size in candidate.mesh if axis in ("data", "fsdp", "expert")))
        fsdp, data, tensor = mesh["fsdp"], mesh["data"], mesh["tensor"]
        link = max(a.link_bandwidth, a.network_bandwidth, 1.0) * 2
        moved = (2 * micro_steps + 1) * weights / tensor * (fsdp - 1) / max(fsdp, 1) + 2 * weights * (data - 1) / data
        # tensor parallelism: each device sees its group's tokens, and sums the attention's and the MLP's outputs
        # over the group in the forward pass, the backward pass and the recomputation (6 all-reduces a layer)
        moved += 6 * m.n_layers * tokens * tensor * m.d_model * 2 * 2 * (tensor - 1) / tensor
        # an expert's float32 gradient is summed over the devices that hold the same experts (data x fsdp), and
        # the routed tokens go out and come back in the forward pass, the backward pass and the recomputation
        # (none where remat keeps everything: olmax.parallel.expert.EXCHANGED)
        replicas = data * fsdp
        moved += 2 * 4 * experts * (replicas - 1) / replicas
        rows, outputs, received = self.routed(candidate)
        peers = mesh["expert"]
        passes = 4 if candidate.saved == EVERYTHING else 6
        moved += (passes * received / self.layer_tokens(candidate) * tokens * tensor * m.n_layers * m.d_model * 2
                  * (peers - 1) / peers)
        comm = moved / link
        # float32 parameters, gradients and two moments; ZeRO-1 shards the moments over the replicas
        moments = dense / (data if candidate.zero1 else 1) + experts / (replicas if candidate.zero1 else 1)
        state = (dense + experts) * (4 + 4) + moments * (4 + 4)
        memory = state + self.saved(candidate) / tensor
        if rows:
            d, f, local = m.d_model, m.moe.expert_hidden, m.moe.num_experts // peers
            # the routed rows' input, two projections, their product and output, and the gradients of each
            # (bf16); each token's outputs back from its experts, in bf16 and in the float32 of the gated sum;
            # the layer's experts cast to bf16, and their float32 gradients as the backward pass sums them
            memory += rows * (2 * d + 3 * f) * 2 * 2 + outputs * d * (2 + 4) + local * 3 * d * f * (2 + 4)
        return max(compute, comm) + 0.1 * min(compute, comm), memory


# --- the search -----------------------------------------------------------------------------------------------------

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

    def row(self) -> dict:
        return {"layout": self.candidate.describe(), "overrides": self.candidate.overrides(),
                "flags": self.candidate.flags, "status": self.status, "peak": self.peak,
                "step_seconds": self.step_seconds, "mfu": self.mfu, "tokens_per_second_per_chip": self.tokens_per_chip,
                "compile_seconds": self.compile_seconds, "cached": self.cached, "reason": self.reason,
                "pruned_by": self.by.describe() if self.by else None,
                "extrapolated_from": list(self.depths) if self.depths else None, "extrapolation_error": self.error}


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


# --- depth-reduced compiles -------------------------------------------------------------------------------------------

TRUSTED = 0.05  # the most an extrapolation may miss a full compile's peak or step by for the search to rely on it


def depths(cfg: RunConfig) -> tuple[int, int] | None:
    """The two depths a depth-reduced compile of `cfg` runs at: the dense layers and one, then two, units of the
    repeated stack (a layer_pattern period in each pipeline stage's each chunk, so the schedule is the same), or
    None where that saves little (the stack is under four units deep)."""
    schedule = pipeline.schedule_for(cfg)
    unit = len(cfg.model.layer_pattern) * (schedule.stages * schedule.repeats if schedule else 1)
    base = cfg.model.dense_layers
    return None if cfg.model.n_layers - base < 4 * unit else (base + unit, base + 2 * unit)


def at_depth(cfg: RunConfig, layers: int) -> RunConfig:
    """`cfg` with `layers` layers, its pipeline's chunks a stage kept (the schedule's repeats fixed)."""
    schedule = pipeline.schedule_for(cfg)
    update = {"model": cfg.model.model_copy(update={"n_layers": layers})}
    if schedule and schedule.repeats > 1:
        update["impl"] = cfg.impl.model_copy(update={"pipeline": cfg.impl.pipeline.model_copy(
            update={"repeats": schedule.repeats})})
    return cfg.model_copy(update=update)


def extrapolated(layers: int, at: tuple[int, int] | None, figures: list[float]) -> float:
    """A figure at `layers` from the same figure at the two depths `at`, on the line through them (a step is its
    layers repeated: what the layers add grows with their number, what is outside them stays); the figure
    itself where there was one compile at full depth."""
    if at is None:
        return figures[0]
    (a, b), (fa, fb) = at, figures
    return fa + (fb - fa) * (layers - a) / (b - a)


def extrapolation_error(estimate: Result, full: Result) -> dict:
    """The relative error of an extrapolated peak and step against the full compile's."""
    return {"peak": estimate.peak / full.peak - 1 if full.peak else None,
            "step": estimate.step_seconds / full.step_seconds - 1 if full.step_seconds else None}


def trusted(error: dict) -> bool:
    return all(e is not None and abs(e) <= TRUSTED for e in error.values())


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
    search = Search(size=len(candidates))
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
                futures = [pool.submit(evaluate, config, overrides, target.name, c, headroom, trust[0] is not False)
                           for c in batch]
                for future in concurrent.futures.as_completed(futures):
                    result = future.result()
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
    return ""


def coverage(search: Search) -> str:
    counts = {s: sum(r.status == s for r in search.results)
              for s in ("fits", "over headroom", "out of memory", "failed", "pruned")}
    tried = len(search.results) - counts["pruned"]
    left = search.size - len(search.results)
    return (f"searched {len(search.results)} of {search.size} layouts: {tried} compiled ({search.compiled} programs "
            f"new, {sum(r.cached for r in search.results)} layouts from the cache), {counts['pruned']} pruned as out of memory "
            f"by a layout that keeps less; {counts['fits']} fit, {counts['over headroom']} over the headroom, "
            f"{counts['out of memory']} out of memory, {counts['failed']} failed; {left} not reached within the budget; "
            f"{sum(bool(r.depths) for r in search.results)} by depth-reduced compiles; {search.seconds:.0f} s")


def overlay(config: str, search: Search, target: Target) -> str:
    """The best layout as a config file: `base:` the config tuned (so it runs as it is), its settings over it (so
    it merges: `olmax train CONFIG best.yaml`)."""
    import yaml

    best = search.best
    tree: dict = {}
    for item in best.candidate.overrides():
        key, value = item.split("=", 1)
        node = tree
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    head = (f"# olmax tune {config} --target {target.name}: the fastest layout that fits ({best.candidate.describe()})\n"
            f"# predicted step {best.step_seconds:.4g} s, MFU {100 * best.mfu:.3g}%, peak {size(best.peak)} a device\n")
    flag_note = ("" if best.candidate.flags or not target.xla_flags else
                 f"# compiled with the compiler's default flags: unset the {target.kind} profile on the chips\n")
    return head + flag_note + yaml.safe_dump({"base": config, **tree}, sort_keys=False)


def main_line(search: Search) -> str:
    best = search.best
    if best is None:
        return "no layout fits within the headroom among those searched; raise --budget or --headroom"
    return f"best: {best.candidate.describe()} at {best.step_seconds:.4g} s a step"


def print_err(line: str) -> None:
    print(f"olmax tune: {line}", file=sys.stderr, flush=True)
