"""One transformer block for training, evaluation and decoding; what differs is passed in.

    h   = x + norm(attn(x))          reordered norm (OLMo 2/3, model.family olmo3): no input norms
    out = h + norm(mlp(h))
    h   = x + attn(norm(x))          pre-norm (OLMoE, model.family olmoe)
    out = h + mlp(norm(h))
(each family module's NORM_PLACEMENT says which)
    attn: q = rope(norm(x Wq)), k = rope(norm(x Wk)), v = x Wv
the QK-norm over the whole projection (OLMo 3, OLMoE), over each head (Qwen 3), or none: the family's QK_NORM.

`attention(q, k, v) -> (context, state)` is the layer's attention: blocked over the sequence in
training, over a KV cache in decoding (its state is the updated cache). `mlp(p, h) -> (out, aux)` is the
MLP sublayer chosen by `model.mlp` (dense SwiGLU, model/mlp.py, or the mixture of experts of model/moe/);
`aux` (a dict of arrays, {} for dense) is stacked over layers by the model and read by the sublayer's
training hooks, which the train step calls (auxiliary losses, load metrics). Matmuls run in the dtype of x;
norms, RoPE and softmax in float32. Named activations (`qkv_proj`, `out_proj`, `mlpwi_0`, `mlpwi_1`,
`mlpwo`, `context`) let a remat policy be a list of names. `dense` is the projections' matmul (float8
with impl.fp8: q, k, v, o and the MLP's, never the attention's own products; with impl.fp8=mxfp8 the
experts' grouped matmuls too).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from olmax.config import ImplConfig, ModelConfig
from olmax.model import families, fp8
from olmax.model.mlp import DenseTraining, dense_mlp
from olmax.model.moe import selfcheck, sublayer
from olmax.model.moe.kernels.chip import Chip
from olmax.model import rope as rope_lib
from olmax.parallel.mesh import Layout, constrain, platform

ACTIVATION = ("batch", "length", "embed")


def compute_dtype(impl: ImplConfig, layout: Layout | None = None):
    """`auto`: bfloat16 where the layout's devices are accelerators (not where JAX runs: see mesh.platform)."""
    if impl.compute_dtype == "auto":
        return jnp.float32 if platform(layout) == "cpu" else jnp.bfloat16
    return jnp.dtype(impl.compute_dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array, name: str, matmul: Callable = jnp.matmul) -> jax.Array:
    # As one 2-D matmul over all tokens: XLA's CPU backend runs [B, T, D] x [D, F] and its
    # transposes in the backward pass about 1.8x slower than [B*T, D] x [D, F].
    y = matmul(x.reshape(-1, x.shape[-1]), w.astype(x.dtype))
    return checkpoint_name(y.reshape(*x.shape[:-1], w.shape[-1]), name)


def dense_for(impl: ImplConfig, layout: Layout | None = None) -> Callable:
    """The block projections' `dense`: float8 matmuls with impl.fp8 (MXFP8 ones for the layout's platform with
    impl.fp8=mxfp8)."""
    if impl.fp8 == "mxfp8":
        fp8.check_mxfp8(layout)
        where = platform(layout)

        # On a GPU the weight is gathered whole (in the compute dtype) before it is quantized: gathered quantized,
        # its e8m0 scales would go through NCCL, which has no such type (XLA refuses the program).
        whole = layout.replicated if where == "gpu" and layout is not None else None
        return functools.partial(dense, matmul=functools.partial(fp8.mx_matmul, platform=where, whole=whole))
    return functools.partial(dense, matmul=fp8.matmul) if impl.fp8 else dense


def mlp_sublayer(cfg: ModelConfig, impl: ImplConfig, layout: Layout | None = None, kind: str | None = None,
                 dense: Callable = dense):
    """The MLP sublayer of `kind` (default model.mlp): `mlp(p, h) -> (out, aux)`; the MoE one also takes
    `key=` (for routing="random"). With a layout, the experts run expert-parallel on its mesh. `dense` is the
    dense MLP's matmul; the experts' grouped matmuls run in the compute dtype, or in MXFP8 with impl.fp8=mxfp8
    (then in blocks of at least 32 rows: the weight gradient contracts them)."""
    if (kind or cfg.mlp) == "dense":
        return functools.partial(dense_mlp, dense=dense)

    dispatch, chip = sublayer.dispatch_for_layout(cfg, impl, layout), None
    if dispatch == "grouped":
        device = sublayer.moe_target(cfg, impl, layout).device
        chip = Chip.of(device)
        if device in jax.devices():  # this process's GPUs, not a compile-only target's: the kernels run here
            check = functools.partial(selfcheck.check, mxfp8=impl.fp8 == "mxfp8")
            dispatch = selfcheck.checked_dispatch(dispatch, chip, compute_dtype(impl, layout), check)
    mx = {}
    if impl.fp8 == "mxfp8":
        mx = {"dot": fp8.MXDot(platform(layout)), "smallest_block": fp8.MX_BLOCK}

    def moe_mlp(p: dict, h: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        return sublayer.moe_mlp(cfg.moe, p, h, key=key, mesh=layout.mesh if layout else None,
                                batch_axes=layout.batch_axes if layout else (), dispatch=dispatch,
                                block_size=impl.moe.block, ep_capacity=impl.moe.ep_capacity,
                                exchange_chunks=impl.moe.exchange_chunks, ep_buffer=impl.moe.ep_buffer,
                                chip=chip, **mx)

    return moe_mlp


def training_hooks(cfg: ModelConfig, seed: int):
    """The training hooks of the model's MLP sublayer kind (olmax.model.mlp describes them); `seed` is
    train.seed."""
    return DenseTraining() if cfg.mlp == "dense" else sublayer.MoETraining(cfg, seed)


def block(cfg: ModelConfig, p: dict, x: jax.Array, *, rope: tuple, attention: Callable, mlp: Callable,
          layout: Layout | None = None, dense: Callable = dense):
    """x [B, T, D] -> (out [B, T, D], mlp aux, attention state); rope = (cos, sin) at the tokens' positions."""
    h, state = attention_sublayer(cfg, p, x, rope=rope, attention=attention, layout=layout, dense=dense)
    out, aux = mlp_residual(cfg, p, h, mlp=mlp, layout=layout)
    return out, aux, state


def attention_sublayer(cfg: ModelConfig, p: dict, x: jax.Array, *, rope: tuple, attention: Callable,
                       layout: Layout | None = None, dense: Callable = dense):
    """The block's first half: x [B, T, D] -> (h = x + its attention's output, normed as the family places the
    norm, the attention state)."""
    B, T, _ = x.shape
    Dh = cfg.head_size
    family = families.of(cfg)
    pre = family.NORM_PLACEMENT == "pre"
    a = rms_norm(x, p["attn_norm"], cfg.norm_eps) if pre else x
    q, k = dense(a, p["q_proj"], "qkv_proj"), dense(a, p["k_proj"], "qkv_proj")
    if family.QK_NORM == "projection":
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    q, k = q.reshape(B, T, cfg.n_heads, Dh), k.reshape(B, T, cfg.kv_heads, Dh)
    if family.QK_NORM == "head":
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    v = dense(a, p["v_proj"], "qkv_proj").reshape(B, T, cfg.kv_heads, Dh)
    q, k = rope_lib.apply(q, *rope), rope_lib.apply(k, *rope)
    q = q * jnp.asarray(1 / math.sqrt(Dh), q.dtype)  # on q in the compute dtype, for every implementation
    with jax.named_scope("attention"):
        context, state = attention(q, k, v)
    context = checkpoint_name(context, "context")
    attn_out = dense(context.reshape(B, T, cfg.n_heads * Dh), p["o_proj"], "out_proj")
    h = constrain(layout, x + (attn_out if pre else rms_norm(attn_out, p["attn_norm"], cfg.norm_eps)), ACTIVATION)
    return h, state


def mlp_residual(cfg: ModelConfig, p: dict, h: jax.Array, *, mlp: Callable, layout: Layout | None = None):
    """The block's second half: h [B, T, D] -> (h + its MLP's output, normed as the family places the norm, aux)."""
    pre = families.of(cfg).NORM_PLACEMENT == "pre"
    mlp_out, aux = mlp(p, rms_norm(h, p["mlp_norm"], cfg.norm_eps) if pre else h)
    out = h + (mlp_out if pre else rms_norm(mlp_out, p["mlp_norm"], cfg.norm_eps))
    return constrain(layout, out, ACTIVATION), aux
