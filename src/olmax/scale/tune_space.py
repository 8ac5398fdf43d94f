"""The layouts `olmax tune` searches: every way to lay the config's step out on the target. The remat policy (which
named activations the backward pass keeps: none of them, any set of them, or everything), the mesh (the target's
devices factored over pipeline stages, data, fsdp and tensor, and expert for an MoE), with stages the pipeline's
schedule, its micro-batches and chunks, ZeRO-1, the micro-batch a device runs, Splash's tiles on a TPU, and the
target's XLA flag profile against the compiler's defaults: a `Candidate` each. A candidate that keeps everything an
out-of-memory one keeps, and more (`keeps_at_least`), is out of memory too (`pruned_by`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from olmax.config import PipelineConfig, RunConfig
from olmax.errors import ConfigError
from olmax.parallel import schedules
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
    for schedule, microbatches in itertools.product(schedules.SCHEDULES, (stage, 2 * stage)):
        tried |= {(schedule, microbatches, repeats) for repeats in ((None, 2) if schedule in ("circular",
                  "interleaved_1f1b") else (None,))}
    found = set()
    for schedule, microbatches, repeats in tried:
        try:
            chunks = schedules.schedule_for(configured(cfg, stage, (schedule, microbatches, repeats))).repeats
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
