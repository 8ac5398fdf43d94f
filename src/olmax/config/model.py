"""The model's section of a config: its architecture, what a checkpoint holds and a resume checks (how it runs on
the devices is the impl section's, olmax.config.impl)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from olmax.config.section import DType, Section, declared_above


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
