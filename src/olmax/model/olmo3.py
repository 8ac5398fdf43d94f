"""OLMo 3: a decoder-only transformer, as pure functions over a parameter pytree.

    h   = x + norm(attn(x))          reordered norm: no input norms
    out = h + norm(mlp(h))
    attn: q = rope(norm(x Wq)), k = rope(norm(x Wk)), v = x Wv   (QK-norm over the whole projection)
    mlp:  w2(silu(w1 x) * w3 x)

Layers repeat `layer_pattern` (3 sliding, 1 global in OLMo 3). Block parameters are
stacked on a leading `layers` axis and the model scans over groups of one pattern
period, so compile time does not grow with depth and each layer's window is static.
Parameters are float32; matmuls run in the compute dtype; norms, RoPE, softmax,
logits and the loss run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from olmax.config import ModelConfig
from olmax.model.attention import attention
from olmax.parallel.mesh import constrain

# Logical axis names of every parameter; parallel/mesh.py maps them onto mesh axes.
BLOCK_AXES = {
    "q_proj": ("layers", "embed", "q_heads"),
    "k_proj": ("layers", "embed", "kv_heads"),
    "v_proj": ("layers", "embed", "kv_heads"),
    "o_proj": ("layers", "q_heads", "embed"),
    "q_norm": ("layers", "norm"),
    "k_norm": ("layers", "norm"),
    "attn_norm": ("layers", "norm"),
    "w1": ("layers", "embed", "mlp"),
    "w3": ("layers", "embed", "mlp"),
    "w2": ("layers", "mlp", "embed"),
    "mlp_norm": ("layers", "norm"),
}


def param_axes(cfg: ModelConfig) -> dict:
    return {
        "embed": ("vocab", "embed"),
        "blocks": dict(BLOCK_AXES),
        "final_norm": ("norm",),
        "lm_head": ("embed", "vocab"),
    }


def param_shapes(cfg: ModelConfig) -> dict:
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.padded_vocab
    q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    blocks = {
        "q_proj": (L, D, q), "k_proj": (L, D, kv), "v_proj": (L, D, kv), "o_proj": (L, q, D),
        "q_norm": (L, q), "k_norm": (L, kv), "attn_norm": (L, D),
        "w1": (L, D, F), "w3": (L, D, F), "w2": (L, F, D), "mlp_norm": (L, D),
    }
    return {"embed": (V, D), "blocks": blocks, "final_norm": (D,), "lm_head": (D, V)}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """OLMo-core's init: every linear and the embedding ~ N(0, std) truncated at +-3 std; norm gains 1."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(cfg.param_dtype)

    def one(path, shape, k):
        if "norm" in path:
            return jnp.ones(shape, dtype)
        return (cfg.init_std * jax.random.truncated_normal(k, -3.0, 3.0, shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(p, s, k) for p, s, k in zip(paths, leaves, keys)])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [seq_len, head_dim] in float32, computed once in numpy: constants of the compiled step.

    Inside the trace, XLA's CPU backend fuses the cos/sin into every consumer and recomputes them per
    element (about 0.7 s of a 6.5 s benchmark step). The angles are float32 products of float32
    positions and correctly rounded float32 inverse frequencies, as torch (OLMo-core, HF) computes them;
    XLA's float32 pow is 1 ulp off, an angle error that grows with position (1.7e-4 in logits at 8192).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float64(theta), exponents.astype(np.float64)).astype(np.float32)
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE in float32 on x [batch, seq, heads, head_dim]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def _dense(x: jax.Array, w: jax.Array, name: str) -> jax.Array:
    # As one 2-D matmul over all tokens: XLA's CPU backend runs [B, T, D] x [D, F] and its
    # transposes in the backward pass about 1.8x slower than [B*T, D] x [D, F].
    y = x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)
    return checkpoint_name(y.reshape(*x.shape[:-1], w.shape[-1]), name)


def block(cfg: ModelConfig, p: dict, x: jax.Array, rope: tuple, window: int | None) -> jax.Array:
    B, T, _ = x.shape
    Dh = cfg.head_size
    q = rms_norm(_dense(x, p["q_proj"], "qkv_proj"), p["q_norm"], cfg.norm_eps)
    k = rms_norm(_dense(x, p["k_proj"], "qkv_proj"), p["k_norm"], cfg.norm_eps)
    v = _dense(x, p["v_proj"], "qkv_proj")
    q = apply_rope(q.reshape(B, T, cfg.n_heads, Dh), *rope)
    k = apply_rope(k.reshape(B, T, cfg.kv_heads, Dh), *rope)
    v = v.reshape(B, T, cfg.kv_heads, Dh)
    context = checkpoint_name(attention(q, k, v, window, cfg.attention_block), "context")
    attn_out = _dense(context.reshape(B, T, cfg.n_heads * Dh), p["o_proj"], "out_proj")
    h = constrain(x + rms_norm(attn_out, p["attn_norm"], cfg.norm_eps), ("batch", "length", "embed"))
    gate = jax.nn.silu(_dense(h, p["w1"], "mlpwi_0"))
    up = _dense(h, p["w3"], "mlpwi_1")
    mlp_out = _dense(gate * up, p["w2"], "mlpwo")
    return constrain(h + rms_norm(mlp_out, p["mlp_norm"], cfg.norm_eps), ("batch", "length", "embed"))


def _remat(cfg: ModelConfig, fn):
    if cfg.remat_save == "none":
        return fn
    if cfg.remat_save == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*cfg.remat_save))


def compute_dtype(cfg: ModelConfig):
    if cfg.compute_dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(cfg.compute_dtype)


def hidden_states(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Final-normed hidden states [batch, seq, d_model] in the compute dtype."""
    dtype = compute_dtype(cfg)
    x = constrain(params["embed"].astype(dtype)[tokens], ("batch", "length", "embed"))
    rope = rope_tables(tokens.shape[1], cfg.head_size, cfg.rope_theta)
    period = len(cfg.layer_pattern)
    windows = [None if cfg.is_global(i) else cfg.sliding_window for i in range(period)]
    groups = jax.tree.map(lambda a: a.reshape(cfg.n_layers // period, period, *a.shape[1:]), params["blocks"])

    def group(x, group_params):
        for i, window in enumerate(windows):
            x = block(cfg, jax.tree.map(lambda a: a[i], group_params), x, rope, window)
        return x, None

    if cfg.scan_layers:
        x, _ = jax.lax.scan(_remat(cfg, group), x, groups)
    else:
        for g in range(cfg.n_layers // period):
            x, _ = _remat(cfg, group)(x, jax.tree.map(lambda a: a[g], groups))
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def logits_from_hidden(params: dict, h: jax.Array) -> jax.Array:
    return jnp.dot(h, params["lm_head"].astype(h.dtype), preferred_element_type=jnp.float32)


def forward(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Logits [batch, seq, padded_vocab] in float32 for int tokens [batch, seq]."""
    return logits_from_hidden(params, hidden_states(cfg, params, tokens))
