"""The run config: one typed, validated object that fully describes a run.

A config is a YAML preset (a name under `olmax/configs/` or a path) plus
`key=value` overrides on dotted paths. Unknown keys, wrong types and
inconsistent shapes are errors that name the field and the fix, raised before
anything is compiled or written.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import json
import math
import os
import string
import types
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from olmax.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "configs"
MAX_STEPS = 2**31 - 1  # the step counter (and the LR schedule's arithmetic) is int32 on the device
REMAT_NAMES = ("qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "context")
DType = Literal["float32", "bfloat16"]
SEED_LIMIT = 2**63  # seeds are int64: jax.random.key and numpy's PCG64 take no larger
NAME_MAX, PATH_MAX = 255, 4096  # bytes in a path component and in a whole path, as Linux file systems take them


def declared_above(module: str, check: str):
    """A config check declared where what it checks is defined, in a package above this one: a model family's
    rules in its module (olmax.model.families), a pipeline schedule's in olmax.parallel.schedules. Looked up by
    name when a config is validated, so every config is checked whatever was imported first, and those packages
    import this one, not the other way round."""
    return getattr(importlib.import_module(module), check)


def check_placeholders(value: str) -> str:
    """ValueError unless `value`'s only placeholder is a bare {name} (str.format would reach attributes of the name,
    `{name.__doc__}`, or pad it, `{name:>300}`)."""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(value)
                  if name is not None]
    except ValueError:
        fields = [(None, None, None)]
    if any(field != ("name", "", None) for field in fields):
        raise ValueError("the one placeholder is {name}, the run's name, as it is (write a brace as {{ or }})")
    return value


def check_path_length(path: str, field: str) -> None:
    """ValueError when `path` (a local path or a URL) is longer than a file system or a bucket takes."""
    parts = path.split("://", 1)[-1].split("/")
    if too_long := [part for part in parts if len(part.encode()) > NAME_MAX]:
        raise ValueError(f"{field} {path[:80]}...: {too_long[0][:40]}... is {len(too_long[0].encode())} bytes, over "
                         f"the {NAME_MAX} a name in a path can have; shorten it (or the run's name in it)")
    if len(path.encode()) > PATH_MAX:
        raise ValueError(f"{field} {path[:80]}... is {len(path.encode())} bytes, over the {PATH_MAX} of a path; "
                         "shorten it")


class Section(BaseModel):
    # Every float must be finite (`optim.lr=inf` would make every parameter NaN at the first step).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RopeConfig(Section):
    """RoPE of one layer kind, as transformers' `rope_parameters` entry for it (rotate-half, float32)."""

    theta: float = Field(500000.0, gt=0)
    type: Literal["default", "yarn"] = "default"
    factor: float | None = Field(None, gt=0, description="yarn: context extension factor")
    original_max_position_embeddings: int | None = Field(None, gt=0, description="yarn: the pre-extension context")
    beta_fast: float = Field(32.0, gt=0, description="yarn: rotations where extrapolation ends")
    beta_slow: float = Field(1.0, gt=0, description="yarn: rotations where interpolation starts")
    attention_factor: float | None = Field(None, gt=0, description="yarn: cos/sin scale; None = 0.1 ln(factor) + 1")

    @model_validator(mode="after")
    def _yarn(self):
        if self.type == "yarn" and (self.factor is None or self.original_max_position_embeddings is None):
            raise ValueError("rope type yarn needs factor and original_max_position_embeddings")
        if self.type == "default" and (self.factor is not None or self.original_max_position_embeddings is not None):
            raise ValueError("factor / original_max_position_embeddings are yarn settings; set type: yarn")
        return self


LayerKind = Literal["sliding", "global"]
# Keys that moved out of `model` (architecture) into `impl` (how it runs), or were reshaped: an override or
# YAML key naming the old place is refused with the new one; `upgrade` moves them in an older checkpoint's config.
MOVED_KEYS = {
    "model.compute_dtype": "impl.compute_dtype",
    "model.remat_save": "impl.remat",
    "model.attention_block": "impl.attention.block",
    "model.scan_layers": "impl.scan_layers",
    "model.rope_theta": "model.rope.global.theta and model.rope.sliding.theta",
    "impl.moe_dispatch": "impl.moe.dispatch",
    "impl.moe_block": "impl.moe.block",
    "impl.moe_ep_capacity": "impl.moe.ep_capacity",
}


class MoEConfig(Section):
    """A mixture-of-experts MLP: a router sends each token to top_k of num_experts SwiGLU experts.

    Routing and losses follow OLMo-core's MoE (olmo_core/nn/moe/router.py, loss.py, moe.py): each MoE
    layer's losses are weighted by coefficient / model.n_layers and, like the CE loss, divided by the
    label count of the batch. How the layer is computed is `impl.moe`.
    """

    num_experts: int = Field(64, gt=1)
    top_k: int = Field(8, gt=0)
    expert_hidden: int = Field(1024, gt=0, description="hidden size of each expert's SwiGLU")
    shared_expert_hidden: int | None = Field(
        None, gt=0, description="a SwiGLU every token takes, added to the routed output (n shared experts = n x hidden)"
    )
    gating: Literal["softmax", "sigmoid"] = Field("softmax", description="router scores from its float32 logits")
    normalize_gates: bool = Field(False, description="divide the top-k gate weights by their sum (OLMoE: false)")
    load_balancing_loss: float = Field(0.01, ge=0, description="coefficient of the load balancing loss (OLMoE 0.01)")
    router_z_loss: float = Field(0.001, ge=0, description="coefficient of the router z-loss (OLMoE 0.001)")
    load_balancing_granularity: Literal["global_batch", "micro_batch"] = Field(
        "global_batch",
        description="global_batch: expert counts over the whole micro-batch (all data-parallel ranks; independent "
        "of the device count); micro_batch: per rank's share, averaged (OLMo-core's default `local_batch`)",
    )
    bias_update_rate: float | None = Field(
        None, gt=0, description="auxiliary-loss-free balancing: per-expert selection bias moved by this each step"
    )
    capacity_factor: float | None = Field(
        None, gt=0, description="None = dropless; else each expert takes at most this x its even share per rank"
    )
    routing: Literal["learned", "uniform", "random"] = Field(
        "learned", description="uniform/random: fixed or random experts for system benchmarks (router still runs)"
    )

    @model_validator(mode="after")
    def _routing(self):
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        return self


class ModelConfig(Section):
    """The architecture: every field changes the function the parameters compute (checked on resume)."""

    family: str = Field(
        "olmo3", description="block structure and parameter names: a module of olmax.model.families (olmo3, olmoe, "
        "...), which checks the fields below for what its architecture allows"
    )
    vocab_size: int = Field(100278, gt=0, description="tokenizer vocabulary size")
    vocab_pad_multiple: int = Field(128, gt=0, description="embedding rows are padded to a multiple of this")
    d_model: int = Field(4096, gt=0)
    n_layers: int = Field(32, gt=0)
    n_heads: int = Field(32, gt=0)
    n_kv_heads: int | None = Field(None, gt=0, description="None = n_heads (no GQA)")
    head_dim: int | None = Field(None, gt=0, description="None = d_model // n_heads")
    mlp: Literal["dense", "moe"] = Field("dense", description="the MLP sublayer: dense SwiGLU or mixture of experts")
    mlp_hidden: int = Field(11008, gt=0, description="hidden size of the dense MLP (and of dense_layers)")
    moe: MoEConfig | None = Field(None, description="the mixture of experts (with mlp: moe)")
    dense_layers: int = Field(0, ge=0, description="with mlp: moe, the first layers keep a dense MLP")
    norm_eps: float = Field(1e-6, gt=0)
    rope: dict[LayerKind, RopeConfig] = Field(
        default_factory=lambda: {"sliding": RopeConfig(), "global": RopeConfig()},
        description="RoPE per layer kind (long-context checkpoints carry YaRN on global layers only)",
    )
    sliding_window: int = Field(4096, gt=0, description="keys visible to a sliding layer, itself included")
    layer_pattern: list[LayerKind] = Field(
        default_factory=lambda: ["sliding", "sliding", "sliding", "global"],
        description="attention kind of consecutive layers, repeated over the depth",
    )
    tie_embeddings: bool = Field(False, description="the LM head is the embedding's transpose (no lm_head weight)")
    init_std: float = Field(0.02, gt=0)
    param_dtype: DType = "float32"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    def layer_kind(self, layer: int) -> str:
        return self.layer_pattern[layer % len(self.layer_pattern)]

    def is_global(self, layer: int) -> bool:
        return self.layer_kind(layer) == "global"

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer sees (None: all before it)."""
        return None if self.is_global(layer) else self.sliding_window

    @model_validator(mode="after")
    def _shapes(self):
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; set head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.kv_heads}")
        if self.n_layers % len(self.layer_pattern):
            raise ValueError(
                f"n_layers {self.n_layers} is not a multiple of the layer_pattern length {len(self.layer_pattern)}"
            )
        if self.head_size % 2:
            raise ValueError(f"head_dim {self.head_size} must be even for rotate-half RoPE")
        if missing := sorted(set(self.layer_pattern) - set(self.rope)):
            raise ValueError(f"rope has no entry for layer kinds {missing}; add model.rope.<kind>")
        return self

    @model_validator(mode="after")
    def _mlp(self):
        if self.mlp == "moe" and self.moe is None:
            raise ValueError("mlp is moe but moe is not set; add model.moe (num_experts, top_k, expert_hidden, ...)")
        if self.mlp == "dense" and (self.moe is not None or self.dense_layers):
            raise ValueError("model.moe / model.dense_layers are set but mlp is dense; set mlp: moe or unset them")
        if self.dense_layers >= self.n_layers or self.dense_layers % len(self.layer_pattern):
            raise ValueError(f"dense_layers {self.dense_layers} must be a multiple of the layer_pattern length "
                             f"{len(self.layer_pattern)} below n_layers {self.n_layers}")
        return self

    @model_validator(mode="after")
    def _family(self):
        declared_above("olmax.model.families", "check_config")(self)
        return self


class SplashConfig(Section):
    """Tile sizes of the Splash kernels, in tokens (multiples of 128): the forward and both backward kernels."""

    block_q: int = Field(512, gt=0, description="queries per tile")
    block_kv: int = Field(512, gt=0, description="keys per tile held in VMEM")
    block_kv_compute: int = Field(512, gt=0, description="keys per inner step (divides block_kv)")

    @model_validator(mode="after")
    def _tiles(self):
        for name in ("block_q", "block_kv", "block_kv_compute"):
            if getattr(self, name) % 128:
                raise ValueError(f"{name} {getattr(self, name)} must be a multiple of 128 (the TPU's lane width)")
        if self.block_kv % self.block_kv_compute:
            raise ValueError(f"block_kv {self.block_kv} must be a multiple of block_kv_compute {self.block_kv_compute}")
        return self


class AttentionImplConfig(Section):
    implementation: Literal["auto", "xla", "splash", "cudnn"] = Field(
        "auto", description="auto: splash on TPU, cudnn on GPU, xla elsewhere; xla: blocked (any platform)"
    )
    block: int = Field(512, gt=0, description="query/key block of the blocked XLA attention")
    splash: SplashConfig = Field(default_factory=SplashConfig)


class PipelineConfig(Section):
    """How the layer stack runs pipelined over the `mesh.stage` stages (when mesh.stage > 1)."""

    microbatches: int | None = Field(
        None, gt=0, description="pipeline micro-batches each train micro-step is cut into; None = one per stage"
    )
    schedule: Literal["gpipe", "circular", "1f1b", "interleaved_1f1b"] = Field(
        "gpipe", description="gpipe: one chunk of consecutive layers per stage; circular: `repeats` chunks per stage, "
        "the micro-batches going round the stages that many times (a smaller bubble); both keep every micro-batch's "
        "activations for autodiff's backward pass. 1f1b / interleaved_1f1b: the same chunks, each micro-batch's "
        "backward run as soon as its loss is known (a stage keeps a bounded number of stage inputs, not M "
        "micro-batches' activations, and recomputes its chunk in the backward); learned MoE routing only"
    )
    repeats: int | None = Field(
        None, gt=1, description="circular, interleaved_1f1b: layer chunks per stage; None = the most the depth "
        "allows (one layer_pattern period per chunk)"
    )

    @model_validator(mode="after")
    def _repeats(self):
        if self.schedule in ("gpipe", "1f1b") and self.repeats is not None:
            raise ValueError("pipeline.repeats is a circular-schedule setting; set schedule: circular (or "
                             "interleaved_1f1b) or unset it")
        return self


class MoEImplConfig(Section):
    """How a mixture of experts runs (model.moe says what it computes)."""

    dispatch: Literal["auto", "blocks", "ragged_dot", "grouped"] = Field(
        "auto", description="the experts: blocks = block-padded grouped matmul (portable: a loop of matmuls); "
        "ragged_dot = jax.lax.ragged_dot (the TPU's grouped-matmul kernel; XLA:CPU and XLA:GPU expand it "
        "densely, every expert on every row); grouped = Pallas Mosaic GPU grouped-matmul kernels (Hopper and "
        "Blackwell GPUs); auto = ragged_dot on TPU, grouped on those GPUs, blocks elsewhere"
    )
    block: int | None = Field(None, gt=0, description="rows per block of the grouped matmul; None = auto")
    ep_capacity: float | None = Field(
        None, gt=0, description="expert parallelism: None = dropless (ragged_all_to_all: each token once to each "
        "peer holding any of its experts; receive buffers sized for the worst case, EP x a device's tokens); a factor = send each peer only its routed rows, up to factor x the mean share (k x tokens / EP), "
        "dropping (and counting, train/dropped rate) the rest: buffers independent of the EP size"
    )
    ep_buffer: float | None = Field(
        None, gt=0, description="expert parallelism, dropless: a device's receive buffer holds this factor x the rows "
        "it is expected to receive (a token goes to the peers holding any of its top_k experts), and the exchange "
        "runs in rounds of that many rows while any device of the group has more: exact whatever the routing, one "
        "round when it fits (train/exchange extra rounds counts the others); None = the worst case in one round"
    )
    exchange_chunks: int = Field(
        1, ge=1, description="expert parallelism, dropless: the tokens of a layer exchanged and run in this many "
        "parts, so that one part's exchange can run while the experts compute another's (XLA's asynchronous "
        "collectives); each part's receive buffer is the worst case of its tokens"
    )


class ImplConfig(Section):
    """How the model runs: free to change between runs and on resume (the function stays the same)."""

    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on accelerators, float32 on CPU (XLA's CPU bf16 matmuls are slower)"
    )
    remat: list[str] | Literal["full", "none"] = Field(
        "none", description="'none': no matmul or attention recomputed (with bf16 compute the elementwise work "
        "between them is: norms, RoPE, SwiGLU's gate); 'full': save nothing; or the named activations to save"
    )
    attention: AttentionImplConfig = Field(default_factory=AttentionImplConfig)
    scan_layers: bool = Field(
        True, description="scan over layer groups (compile time independent of depth); false unrolls them"
    )
    logits_grad: Literal["float32", "compute"] = Field(
        "float32", description="the dtype the LM head's backward takes the float32 logits' gradient in: float32, or "
        "compute (the compute dtype: a bfloat16 autocast head's backward, as OLMo-core's; its two matmuls over "
        "[tokens, vocab] at the bfloat16 rate, not float32's)"
    )
    loss_chunk: int | None = Field(
        1024, gt=0, description="sequence positions per chunk of LM head + loss (never all logits); null = all"
    )
    fp8: bool | Literal["mxfp8"] = Field(
        False, description="true: block projections (q, k, v, o, dense MLP) as float8 matmuls, per-tensor current "
        "scaling: e4m3 inputs and weights, e5m2 gradients; mxfp8: the block projections and the MoE experts in MXFP8 "
        "(e4m3 in blocks of 32 along each product's contraction, e8m0 scales; cuDNN on GPUs of compute capability "
        "10.x, emulated on CPU); the embedding, LM head, router and attention stay as they are"
    )
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    shard_optimizer: bool = Field(
        False, description="ZeRO-1: the optimizer state of each parameter is also sharded over the mesh axes the "
        "parameter is replicated on (mesh.data...); the update runs on shards, the parameters are all-gathered after"
    )
    moe: MoEImplConfig = Field(default_factory=lambda: MoEImplConfig())

    @model_validator(mode="after")
    def _names(self):
        if isinstance(self.remat, list) and (bad := set(self.remat) - set(REMAT_NAMES)):
            raise ValueError(f"remat has unknown names {sorted(bad)}; known: {list(REMAT_NAMES)}")
        return self


class RepetitionFilterConfig(Section):
    enabled: bool = False
    min_period: int = Field(1, gt=0)
    max_period: int = Field(13, gt=0)
    max_count: int = Field(32, gt=1, description="an instance with a period repeated this often is masked")


class SourceConfig(Section):
    """A source of a mid-training mix (OLMo-core's SourceMixtureConfig)."""

    name: str = Field(min_length=1)
    ratio: float = Field(gt=0, le=1, description="the source's share of data.requested_tokens")
    paths: list[str] = Field(
        default_factory=list, description="its token shards; empty = the data.mix_file lines labeled `name`"
    )
    max_repetition_ratio: float = Field(1.0, ge=1, description="passes over the source allowed (upsampling)")
    max_source_fraction: float = Field(1.0, gt=0, le=1, description="share of the source's tokens allowed")


class DataConfig(Section):
    paths: list[str] = Field(default_factory=list, description="token shards in mix order")
    mix_file: str | None = Field(None, description="OLMo-core mix file of `label,path` lines (instead of paths)")
    mix_base_dir: str | None = Field(None, description="where relative mix paths start (default: the mix file's dir)")
    mix_tokenizer: str | None = Field(None, description="replaces {TOKENIZER} in mix paths (allenai/dolma2-tokenizer)")
    sources: list[SourceConfig] = Field(
        default_factory=list, description="a mix by per-source ratios of requested_tokens (instead of paths)"
    )
    requested_tokens: int | None = Field(None, gt=0, description="tokens the sources' mix is built to hold")
    sequence_length: int = Field(8192, gt=1)
    seed: int = Field(34521, ge=0, lt=SEED_LIMIT)
    eos_id: int = Field(100257, ge=0)
    pad_id: int = Field(100277, ge=0)
    token_dtype: Literal["uint16", "uint32"] = "uint32"
    repetition_filter: RepetitionFilterConfig = Field(default_factory=RepetitionFilterConfig)
    num_workers: int = Field(0, ge=0, description="prefetch threads (0 = read in the training loop's thread)")
    allow_fingerprint_change: bool = False

    @model_validator(mode="after")
    def _mixture(self):
        if not self.sources:
            if self.requested_tokens is not None:
                raise ValueError("data.requested_tokens is set but data.sources is empty; list the sources")
            return self
        if self.requested_tokens is None:
            raise ValueError("data.sources needs data.requested_tokens, the tokens the mix is built to hold")
        if self.paths:
            raise ValueError("set either data.paths or data.sources, not both")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources: names must be unique, got {names}")
        total = sum(s.ratio for s in self.sources)
        if abs(total - 1.0) > 1e-8 + 1e-5:  # np.allclose's tolerance, as OLMo-core
            raise ValueError(f"data.sources: ratios must sum to 1, got {total}")
        unlisted = [s.name for s in self.sources if not s.paths]
        if unlisted and not self.mix_file:
            raise ValueError(f"data.sources {unlisted} list no paths; set their paths or a data.mix_file labeling them")
        if self.mix_file and not unlisted:
            raise ValueError("data.mix_file is unused: every source lists its paths; unset data.mix_file")
        return self


class SkipStepConfig(Section):
    enabled: bool = True
    window: int = Field(128, gt=1, description="previous values kept")
    min_values: int = Field(64, gt=1, description="values, current included, before the check starts")
    sigma: float = Field(6.0, gt=0)


class OptimConfig(Section):
    lr: float = Field(3e-4, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    no_decay: list[str] = Field(default_factory=lambda: ["embed"], description="param path prefixes not decayed")
    grad_clip: float | None = Field(1.0, gt=0)
    moment_dtype: DType = "float32"
    allow_low_precision_moments: bool = False
    skip_step: SkipStepConfig = Field(default_factory=SkipStepConfig)


class ScheduleConfig(Section):
    kind: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(2000, ge=0, le=MAX_STEPS)
    final_lr_fraction: float = Field(0.1, ge=0, le=1)
    horizon_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="steps the decay spans; None = train.steps")
    decay_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="wsd: length of the final linear decay")


class LossConfig(Section):
    z_loss: float = Field(1e-5, ge=0)
    mask_pad: bool = Field(False, description="ignore labels equal to data.pad_id")


class TrainConfig(Section):
    steps: int = Field(100, gt=0, le=MAX_STEPS, description="length of the run (and of its LR schedule)")
    stop_after: int | None = Field(None, gt=0, le=MAX_STEPS, description="end this invocation after this step (checkpointed)")
    global_batch_instances: int = Field(512, gt=0)
    micro_batch_per_device: int | None = Field(
        None, gt=0, description="instances per device per micro-step; None = whole global batch in one micro-step"
    )
    seed: int = Field(0, ge=-SEED_LIMIT, lt=SEED_LIMIT)
    log_every: int = Field(1, gt=0)
    hang_timeout: float = Field(
        600.0, ge=10, le=7 * 86400, description="seconds without a finished step after which a multi-process run is "
        "taken for stopped and exits 75 (at least 5 x the slowest step so far; olmax.train.watchdog): from 10 (the "
        "watchdog reads the processes' heartbeats over 3 s) to a week (JAX's heartbeat timeout, 10 x this, is a "
        "C int of seconds)")


MESH_AXES = ("data", "stage", "fsdp", "expert", "tensor")  # outermost first: neighbours share the inner axes
DEFAULT_RULES = {
    "batch": ["data", "fsdp", "expert"],
    "vocab": ["tensor"],
    "embed": ["fsdp"],
    "q_heads": ["tensor"],
    "kv_heads": ["tensor"],
    "mlp": ["tensor"],
    "experts": ["expert"],
    "expert_embed": [],  # expert weights are sharded over experts only: resident, never gathered
    "expert_mlp": [],
    "router": [],
    "layers": ["stage"],
    "length": [],
    "norm": [],
}


class MeshConfig(Section):
    """Device mesh sizes (-1 on one of data/fsdp: all devices left over) and the rules table mapping each
    logical axis name of parameters and activations onto mesh axes."""

    data: int = Field(1, ge=-1, description="pure data parallelism (replicated params)")
    stage: int = Field(1, ge=1, description="pipeline stages")
    fsdp: int = Field(-1, ge=-1, description="data parallelism with sharded params and optimizer state")
    expert: int = Field(1, ge=1, description="expert parallelism (batch is split over it too)")
    tensor: int = Field(1, ge=1, description="tensor parallelism (heads, MLP hidden, vocab)")
    rules: dict[str, list[str]] = Field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()},
        description="logical axis -> mesh axes; entries given replace the default's, the rest stay",
    )

    @field_validator("rules", mode="before")
    @classmethod
    def _over_defaults(cls, rules):
        return {**DEFAULT_RULES, **rules} if isinstance(rules, dict) else rules

    @model_validator(mode="after")
    def _rules(self):
        for name, axes in self.rules.items():
            if bad := [a for a in axes if a not in MESH_AXES]:
                raise ValueError(f"mesh.rules.{name}: {bad} are not mesh axes {list(MESH_AXES)}")
        if self.expert > 1 and "expert" not in self.rules["batch"]:
            raise ValueError(f"mesh.rules.batch must include expert with mesh.expert {self.expert} (got "
                             f"{self.rules['batch']}): each device of an expert group brings its own tokens")
        if self.rules["experts"] != ["expert"]:
            raise ValueError(f"mesh.rules.experts must be [expert] (got {self.rules['experts']}): the experts' "
                             "exchange runs over the expert mesh axis, so their weights must be sharded over it; set "
                             "mesh.expert for expert parallelism")
        if self.stage > 1:
            if self.rules["layers"] != ["stage"]:
                raise ValueError(f"mesh.stage {self.stage} pipelines the layers over the stages: mesh.rules.layers "
                                 f"must be [stage] (got {self.rules['layers']})")
            if others := sorted(name for name, axes in self.rules.items() if "stage" in axes and name != "layers"):
                raise ValueError(f"mesh.rules {others} use the stage axis; with mesh.stage > 1 it holds the "
                                 "pipeline stages only (layers)")
        return self


class CheckpointConfig(Section):
    model_config = ConfigDict(**Section.model_config, serialize_by_alias=True)

    every: int = Field(1000, gt=0)
    asynchronous: bool = Field(True, alias="async", description="the step waits only for the copy to host memory; "
                               "the write (and upload) goes on in the background")
    keep_last: int = Field(3, gt=0)
    keep_every: int | None = Field(None, gt=0, description="also keep every step divisible by this")
    resume: bool = True
    init_from: str | None = Field(
        None, description="a fresh run starts from this checkpoint (dir or dir/STEP): params, and moments if present"
    )
    init_optimizer: bool = Field(True, description="with init_from: keep Adam's moments and count (warm start)")


class EvalSetConfig(Section):
    label: str = Field(min_length=1, description="metric names use it: eval/lm/{label}/CE loss")
    paths: list[str] = Field(default_factory=list, description="token shards (documents ending with EOS)")
    mix_file: str | None = Field(None, description="a `label,path` mix file instead of paths (its labels ignored)")

    @model_validator(mode="after")
    def _one_source(self):
        if bool(self.paths) == bool(self.mix_file):
            raise ValueError(f"eval set {self.label!r}: set exactly one of paths or mix_file")
        return self


class EvalConfig(Section):
    every: int | None = Field(None, gt=0, description="evaluate `sets` every N steps; None = no in-loop LM eval")
    sets: list[EvalSetConfig] = Field(default_factory=list, description="labeled held-out sets (Paloma-style domains)")
    tokens: int | None = Field(None, gt=0, description="tokens per set: whole documents chosen by `seed`; None = all")
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="the eval order depends on nothing but the set and this seed")
    batch_instances: int | None = Field(None, gt=0, description="rows per eval batch; None = the training micro-batch")
    harness_tasks: list[str] = Field(default_factory=list, description="lm-eval-harness tasks, `name` or `name:shots`")
    harness_every: int | None = Field(None, gt=0, description="run harness_tasks every N steps; None = never")
    harness_limit: int | None = Field(None, gt=0, description="examples per harness task; None = all")
    harness_include_path: str | None = Field(None, description="directory of extra (local) lm-eval task YAMLs")
    tokenizer: str | None = Field(None, description="tokenizer.json the harness uses to turn text into tokens")

    @model_validator(mode="after")
    def _complete(self):
        if self.every is not None and not self.sets:
            raise ValueError("eval.every is set but eval.sets is empty; add labeled sets or unset eval.every")
        if self.harness_every is not None and not (self.harness_tasks and self.tokenizer):
            raise ValueError("eval.harness_every needs eval.harness_tasks and eval.tokenizer (a tokenizer.json)")
        if len({s.label for s in self.sets}) != len(self.sets):
            raise ValueError("eval.sets: labels must be unique")
        return self


class SlurmConfig(Section):
    """The batch job `olmax launch --slurm` submits: one srun task per process."""

    nodes: int = Field(1, gt=0)
    tasks_per_node: int = Field(1, gt=0, description="processes per node")
    gpus_per_task: int | None = Field(None, gt=0, description="GPUs each process drives; None = none requested")
    time: str | None = Field(None, description="sbatch --time (2-00:00:00); None = the partition's limit")
    partition: str | None = None
    account: str | None = None
    signal_seconds: int = Field(
        300, gt=0, description="SIGTERM this long before the time limit: the run checkpoints, the job is requeued"
    )
    sbatch_lines: list[str] = Field(default_factory=list, description="more sbatch options, one each (--qos=high)")

    @field_validator("time", mode="before")
    @classmethod
    def _time_as_text(cls, value):
        if isinstance(value, int):
            raise ValueError(f"quote the time limit (\"1:00:00\"): unquoted, YAML reads H:MM:SS as the number {value}")
        return value


class LaunchConfig(Section):
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    records_dir: str | None = Field(
        None, description="where `olmax launch` keeps its records (launch.jsonl, job scripts, manifests, Slurm "
        "output): a filesystem path, {name} allowed; None = the run directory, or for a run in a bucket its URL "
        "mirrored under runs/ here (s3://b/x -> runs/s3/b/x)")

    @field_validator("records_dir")
    @classmethod
    def _on_a_filesystem(cls, value):
        if value is None:
            return value
        if "://" in value:
            raise ValueError("must be a filesystem path (the launcher appends to its records and Slurm writes its "
                             "output there), not a bucket")
        return check_placeholders(value)


class StorageConfig(Section):
    retry_seconds: float = Field(120.0, gt=0, description="how long a bucket request's transient faults (5xx, 429, "
                                 "resets, timeouts) are retried before the run stops")


class WandbConfig(Section):
    """Weights & Biases logging from process 0 (the `wandb` extra), set as OLMo-core's W&B callback is; W&B's own
    variables choose the account and the server (WANDB_API_KEY, WANDB_BASE_URL, WANDB_MODE=offline)."""

    enabled: bool = False
    project: str | None = Field(None, description="None = W&B's default project")
    entity: str | None = Field(None, description="the team or user; None = the API key's default entity")
    group: str | None = None
    name: str | None = Field(None, description="the W&B run's display name; None = the config's name")
    tags: list[str] = Field(default_factory=list)
    notes: str | None = None


class RunConfig(Section):
    name: str = "run"
    output_dir: str = Field("runs/{name}", description="checkpoints/ and metrics/ go here")
    model: ModelConfig = Field(default_factory=ModelConfig)
    impl: ImplConfig = Field(default_factory=ImplConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    _output_dir = field_validator("output_dir")(check_placeholders)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))

    @property
    def run_location(self) -> str:
        """output_dir as given: a local path or a bucket URL (which a Path would mangle)."""
        return self.output_dir.format(name=self.name)

    def _check_mxfp8(self):
        """MXFP8 scales blocks of 32 along every contraction: the forward's and the input gradient's (the
        projections' widths both sides), the weight gradient's (tokens, and the experts' rows per block)."""
        m = self.model
        widths = {"model.d_model": m.d_model, "model.n_heads x head size": m.n_heads * m.head_size,
                  "model.kv_heads x head size": m.kv_heads * m.head_size, "data.sequence_length": self.data.sequence_length}
        if m.mlp == "dense" or m.dense_layers:
            widths["model.mlp_hidden"] = m.mlp_hidden
        if m.moe is not None:
            widths["model.moe.expert_hidden"] = m.moe.expert_hidden
            widths["impl.moe.block"] = self.impl.moe.block or 32
        for name, value in widths.items():
            if value % 32:
                raise ValueError(f"impl.fp8=mxfp8 scales blocks of 32 values along each matmul's contraction: {name} "
                                 f"{value} is not a multiple of 32; change it or set impl.fp8 to true or false")
        if m.moe is not None and self.impl.moe.dispatch == "ragged_dot":
            raise ValueError("impl.fp8=mxfp8 runs the experts in the block loop or the grouped kernels (JAX has no "
                             "MXFP8 ragged_dot); set impl.moe.dispatch=auto, blocks or grouped")

    @model_validator(mode="after")
    def _exchange_chunks(self):
        if self.impl.moe.ep_buffer is not None and self.impl.moe.ep_capacity is not None:
            raise ValueError(f"impl.moe.ep_buffer={self.impl.moe.ep_buffer:g} sizes the dropless exchange, and "
                             f"impl.moe.ep_capacity={self.impl.moe.ep_capacity:g} asks for the capacity exchange; "
                             "set one of them to null")
        chunks = self.impl.moe.exchange_chunks
        if chunks > 1 and self.data.sequence_length % chunks:  # a device's tokens: whole sequences
            raise ValueError(f"impl.moe.exchange_chunks={chunks} does not divide data.sequence_length "
                             f"{self.data.sequence_length}, and a device's tokens are whole sequences; choose a "
                             "divisor of it")
        return self

    @model_validator(mode="after")
    def _pipeline(self):
        if self.mesh.stage > 1:  # the schedule's own checks of the config
            declared_above("olmax.parallel.schedules", "schedule_for")(self)
        return self

    @model_validator(mode="after")
    def _consistent(self):
        low = {"float32": False, "bfloat16": True}
        moments_low = low[self.optim.moment_dtype] or low[self.model.param_dtype]
        if moments_low and not self.optim.allow_low_precision_moments:
            raise ValueError(
                "optim.moment_dtype / model.param_dtype would give bfloat16 Adam moments (cost +0.93 loss after "
                "1000 steps in MaxText's OLMo 3 run); keep both float32 or set optim.allow_low_precision_moments=true"
            )
        if self.data.token_dtype == "uint16" and self.model.vocab_size > 2**16:
            raise ValueError(f"data.token_dtype uint16 cannot hold model.vocab_size {self.model.vocab_size}; use uint32")
        for field in ("eos_id", "pad_id"):
            if getattr(self.data, field) >= self.model.vocab_size:
                raise ValueError(f"data.{field} {getattr(self.data, field)} >= model.vocab_size {self.model.vocab_size}")
        if self.schedule.kind == "wsd" and self.schedule.decay_steps is None:
            raise ValueError("schedule.kind=wsd needs schedule.decay_steps")
        if self.impl.fp8 == "mxfp8":
            self._check_mxfp8()
        if self.model.moe is not None and self.model.moe.num_experts % self.mesh.expert:
            raise ValueError(f"model.moe.num_experts {self.model.moe.num_experts} do not divide over mesh.expert "
                             f"{self.mesh.expert}; make the experts a multiple of it")
        check_path_length(self.run_location, "output_dir")
        if self.launch.records_dir is not None:
            check_path_length(self.launch.records_dir.format(name=self.name), "launch.records_dir")
        return self


def _set_path(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    node[leaf] = value


def _known_path(dotted: str) -> None:
    if dotted in MOVED_KEYS:
        raise ConfigError(f"config key {dotted!r} moved: set {MOVED_KEYS[dotted]} instead")
    section: type[BaseModel] = RunConfig
    for i, key in enumerate(dotted.split(".")):
        fields = {field.alias or name: field for name, field in section.model_fields.items()}
        if key not in fields:
            where = ".".join(dotted.split(".")[:i]) or "the top level"
            raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(dotted, list(_config_keys()))}: "
                              f"{where} has {sorted(fields)}")
        annotation = fields[key].annotation
        if isinstance(annotation, types.UnionType):  # an optional section (model.moe)
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            section = annotation
        else:
            return


def _config_keys(section: type[BaseModel] = RunConfig, prefix: str = ""):
    """Every dotted key of the schema, sections and settings."""
    for name, field in section.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        yield key
        annotation = field.annotation
        if isinstance(annotation, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _config_keys(annotation, f"{key}.")


def _did_you_mean(given: str, known: list[str]) -> str:
    """` (did you mean X?)` naming the known names closest to `given`: those ending in its last dotted part (a
    bare `steps` is `train.steps`), else those spelled nearly as it is; empty when none is close."""
    last = given.rsplit(".", 1)[-1]
    close = [k for k in known if k.rsplit(".", 1)[-1] == last and k != given][:3] or difflib.get_close_matches(
        given, [k for k in known if k.count(".") == given.count(".")], n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def presets() -> list[str]:
    """The names of the configs that ship with olmax."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        return path
    path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"no preset {name_or_path!r}{_did_you_mean(str(name_or_path), presets())}; presets: "
                          f"{presets()}, or pass a .yaml path")
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merge keys may be overridden by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in lines:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice, on lines {lines[key]} and {line}; keep one",
                    key_node.start_mark)
            lines[key] = line
        return super().construct_mapping(node, deep)


def _parsed(text: str, where: str):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{where} is not valid YAML ({at}{getattr(err, 'problem', None) or err})") from None


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """The file's settings over those of its `base:` chain; `chain` is the files that named this one."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config files name each other as base in a cycle ({cycle}); break it")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML file or a preset name")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err})") from None
    raw = _parsed(text, f"config file {path}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_yaml(preset_path(base), (*chain, path.resolve()))
    for key, value in _flatten(raw):
        _set_path(merged, key, value)
    return merged


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# What a layout may set: how the step is laid out on the devices, not what it computes.
LAYOUT_KEYS = ("mesh.", "impl.", "train.micro_batch_per_device", "eval.batch_instances")


def _layouts(tree: dict, where: str) -> dict[str, dict]:
    """Pop the config's `layouts:` section: a target (`gpu:b300x8`; a pattern, `tpu:v5p:*`) -> the settings the
    run takes on those devices (mesh, remat, micro-batch: how the step is laid out, not what it computes)."""
    layouts = tree.pop("layouts", None) or {}
    if not isinstance(layouts, dict) or not all(isinstance(v, dict) for v in layouts.values()):
        raise ConfigError(f"{where}: layouts must map a target (gpu:b300x8, tpu:v5p:*) to sections of settings")
    for pattern, settings in layouts.items():
        for key, _ in _flatten(settings):
            try:
                _known_path(key)
            except ConfigError as err:
                raise ConfigError(f"{where}: layouts.{pattern}: {err}") from None
            if not key.startswith(LAYOUT_KEYS):
                raise ConfigError(f"{where}: layouts.{pattern}: {key} is not a layout setting (those are "
                                  f"{', '.join(k + '*' if k.endswith('.') else k for k in LAYOUT_KEYS)}): a run's "
                                  "recipe is the same on every target; set it outside layouts")
    return layouts


def _layout_for(layouts: dict[str, dict], target: str | None, where: str) -> tuple[str, dict] | None:
    found = [pattern for pattern in layouts if target and fnmatch.fnmatchcase(target, pattern)]
    if len(found) > 1:
        raise ConfigError(f"{where}: layouts {found} all match target {target}; narrow them to one")
    return (found[0], layouts[found[0]]) if found else None


def target_layout(name_or_path: str, target: str | None) -> tuple[str, list[str]] | None:
    """The config's layout for `target` (a target name, as `olmax compile --target` takes): its pattern and its
    settings as `a.b=value` lines, or None when it has none (command-line overrides still win over them)."""
    tree = _read_yaml(preset_path(name_or_path))
    found = _layout_for(_layouts(tree, str(name_or_path)), target, str(name_or_path))
    return found and (found[0], [f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                                 for key, value in _flatten(found[1])])


def _overlay(path: str, config: str) -> dict:
    """A file of settings merged over a config (`olmax train CONFIG best.yaml`, as `olmax tune --out` writes it); its
    `base:`, if it names one, must be that config."""
    try:
        raw = _parsed(Path(path).read_text(), f"config file {path}") or {}
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is not None and preset_path(base).resolve() != preset_path(config).resolve():
        raise ConfigError(f"{path} has base {base}, not {config}: merge it over {base}, or drop its base: line")
    return raw


def load_config(name_or_path: str, overrides: list[str] = (), target: str | None = None) -> RunConfig:
    """A preset name or YAML path (which may name a `base:` preset), its layout for `target` if it has one,
    then the overrides in order: `a.b=value`, or a YAML file of settings merged over it."""
    tree = _read_yaml(preset_path(name_or_path))
    layout = _layout_for(_layouts(tree, str(name_or_path)), target, str(name_or_path))
    for key, _ in _flatten(tree):
        _known_path(key)
    for key, value in _flatten(layout[1] if layout else {}):
        _set_path(tree, key, value)
    for item in overrides:
        if "=" not in item and item.endswith((".yaml", ".yml")):
            for key, value in _flatten(_overlay(item, name_or_path)):
                _known_path(key)
                _set_path(tree, key, value)
            continue
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (or be a .yaml file of settings)")
        key, text = item.split("=", 1)
        _known_path(key)
        _set_path(tree, key, _parsed(text, f"override {item!r}: the value"))
    return validate(tree, source=str(name_or_path))


def writable_dir(path: Path, field: str) -> Path:
    """`path`, refused when it, or a directory it would be made in, is an existing file or not writable."""
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ConfigError(f"{field} {path}: {existing} is a file, not a directory; set another {field}")
            if not os.access(existing, os.W_OK):
                raise ConfigError(f"{field} {path}: {existing} is not writable; set another {field}")
            break
    return path


def _nul_bytes(value, where: str):
    """The dotted places of the strings in `value` that hold a NUL byte (which no path, name or command can)."""
    if isinstance(value, str) and "\0" in value:
        yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _nul_bytes(item, f"{where}.{key}".lstrip("."))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nul_bytes(item, f"{where}[{i}]")


def validate(tree: dict, source: str = "config") -> RunConfig:
    if found := next(_nul_bytes(tree, ""), None):
        raise ConfigError(f"{source}: {found} holds a NUL byte, which no name or path can hold; remove it")
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        lines = [f"{source}: invalid config"]
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "(top level)"
            got = e.get("input")
            shown = f" (got {got!r})" if e["loc"] and not isinstance(got, dict) else ""
            lines.append(f"  {where}: {e['msg'].removeprefix('Value error, ')}{shown}")
        if len(lines) == 2:  # one error: one line
            raise ConfigError(f"{lines[0]}: {lines[1].strip().removeprefix('(top level): ')}") from None
        raise ConfigError("\n".join(lines)) from None


def upgrade(tree: dict) -> dict:
    """A config as written by an older olmax (a checkpoint's meta), with moved keys in their new places."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    model, impl = tree.setdefault("model", {}), tree.setdefault("impl", {})
    if "rope_theta" in model:
        theta = model.pop("rope_theta")
        model["rope"] = {kind: {"theta": theta} for kind in ("sliding", "global")}
    for old, new in (("compute_dtype", "compute_dtype"), ("remat_save", "remat"), ("scan_layers", "scan_layers")):
        if old in model:
            impl[new] = model.pop(old)
    if "attention_block" in model:
        impl["attention"] = {"block": model.pop("attention_block")}
    for old in ("dispatch", "block", "ep_capacity"):
        if f"moe_{old}" in impl:
            impl.setdefault("moe", {})[old] = impl.pop(f"moe_{old}")
    return tree


def dump(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
