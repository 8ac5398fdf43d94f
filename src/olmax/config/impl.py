"""The impl section of a config: how the model runs on the devices (compute dtype, remat, attention kernels,
pipeline schedule, the experts' matmuls and exchange, float8), none of which a checkpoint depends on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from olmax.config.section import Section

REMAT_NAMES = ("qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "context")
# The dropless exchange's bounds. A round of impl.moe.ep_buffer=F holds F x the rows a device is expected to receive:
# the even routing alone takes about 1 / F rounds a layer (F=1e-30, a round of one row: ~2,000 rounds a step on
# tiny_moe, 0.3 s -> 25-33 s a step). Each of impl.moe.exchange_chunks' parts is compiled on its own (tiny_moe: 40 s
# whole, over 6 minutes in 64 parts).
MIN_EP_BUFFER = 1 / 16
MOST_EXCHANGE_CHUNKS = 8


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
        None, gt=0, description=f"expert parallelism, dropless: a device's receive buffer holds this factor (at least "
        f"{MIN_EP_BUFFER:g}) x the rows it is expected to receive (a token goes to the peers holding any of its top_k experts), and the exchange "
        "runs in rounds of that many rows while any device of the group has more: exact whatever the routing, one "
        "round when it fits (train/exchange extra rounds counts the others); None = the worst case in one round"
    )
    exchange_chunks: int = Field(
        1, ge=1, description="expert parallelism, dropless: the tokens of a layer exchanged and run in this many "
        f"parts (at most {MOST_EXCHANGE_CHUNKS}), so that one part's exchange can run while the experts compute "
        "another's (XLA's asynchronous collectives); each part's receive buffer is the worst case of its tokens"
    )

    @model_validator(mode="after")
    def _exchange_bounds(self):
        if self.ep_buffer is not None and self.ep_buffer < MIN_EP_BUFFER:
            raise ValueError(f"ep_buffer={self.ep_buffer:g} makes a round of the exchange {self.ep_buffer:g} x the rows "
                             f"a device is expected to receive, about {1 / self.ep_buffer:,.3g} rounds a layer even "
                             f"when the routing is even; give at least {MIN_EP_BUFFER:g} ({1 / MIN_EP_BUFFER:.0f} "
                             "rounds), or null for one round of the worst case")
        if self.exchange_chunks > MOST_EXCHANGE_CHUNKS:
            raise ValueError(f"exchange_chunks={self.exchange_chunks}: each part is compiled on its own (tiny_moe: 40 s "
                             f"whole, over 6 minutes in 64 parts); give at most {MOST_EXCHANGE_CHUNKS}")
        return self


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
    batch_split: int = Field(
        1, ge=1, description="each micro-batch's rows (a pipeline micro-batch's) run through the layers as this many "
        "parts, staggered sublayer by sublayer, so that one part's MLP (an MoE's expert exchange) runs while another "
        "part's attention computes (two-batch overlap); a device's rows must divide into them. A load-balancing loss "
        "is then each part's, as a micro-batch's"
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
        if self.logits_grad == "compute" and self.compute_dtype == "float32":
            raise ValueError("logits_grad=compute takes the LM head's gradient in the compute dtype, and compute_dtype "
                             "is float32: it would change nothing; set compute_dtype to bfloat16 (or auto, bfloat16 "
                             "on accelerators), or logits_grad to float32")
        return self
