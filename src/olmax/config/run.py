"""A run's config (`RunConfig`): the model and its implementation (olmax.config.model, olmax.config.impl), and the
data, optimizer, LR schedule, loss, training, mesh, checkpoint, evaluation, launch, storage and W&B sections; the
checks that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from olmax.config.impl import ImplConfig
from olmax.config.model import ModelConfig
from olmax.config.section import DType, Section, check_path_length, check_placeholders, declared_above

MAX_STEPS = 2**31 - 1  # the step counter (and the LR schedule's arithmetic) is int32 on the device
SEED_LIMIT = 2**63  # seeds are int64: jax.random.key and numpy's PCG64 take no larger


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
