"""Parameter tables, one per model family: each parameter's shape, logical axes, init, and its name in HF
transformers and OLMo-core checkpoints. Shapes, sharding, init, HF import/export and the parity mapping
all derive from these tables, so a new parameter is one line here.

Matrices are stored [in, out] (HF and OLMo-core store torch Linear weights [out, in]: `hf_transpose`);
block parameters are stacked over layers on a leading `layers` axis (`{layer}` in the names). The
embedding and LM head carry the vocabulary padded to `vocab_pad_multiple`; checkpoints of other
frameworks hold the real vocabulary only (the `vocab` axis is cut to `vocab_size` there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig


@dataclass(frozen=True)
class Param:
    path: tuple[str, ...]  # where in the params tree
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, mapped onto the mesh by mesh.rules
    init: Literal["normal", "ones"] = "normal"  # truncated normal (init_std, cut at 3 std) or ones (norm gains)
    hf: str | None = None  # tensor name in HF safetensors
    hf_transpose: bool = False
    olmo_core: str | None = None  # key in OLMo-core's transformer state dict
    active: float = 1.0  # share of it a token's forward pass uses (top_k / n_experts for expert weights)

    @property
    def stacked(self) -> bool:
        return self.axes[0] == "layers"

    def foreign_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """Shape of one of its tensors in an HF checkpoint: per layer, the real vocabulary, [out, in]."""
        shape = [cfg.vocab_size if axis == "vocab" else n for axis, n in zip(self.axes, self.shape)]
        shape = shape[1:] if self.stacked else shape
        return tuple(reversed(shape)) if self.hf_transpose else tuple(shape)



def _olmo3(cfg: ModelConfig) -> list[Param]:
    """OLMo 3 (transformers' Olmo3ForCausalLM): reordered-norm blocks, whole-projection QK-norm, SwiGLU."""
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.padded_vocab
    q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size

    def block(name, shape, axes, hf, olmo_core, init="normal"):
        return Param(("blocks", name), (L, *shape), ("layers", *axes), init, f"model.layers.{{layer}}.{hf}.weight",
                     len(shape) == 2, f"blocks.{{layer}}.{olmo_core}.weight")

    return [
        Param(("embed",), (V, D), ("vocab", "embed"), hf="model.embed_tokens.weight", olmo_core="embeddings.weight"),
        block("q_proj", (D, q), ("embed", "q_heads"), "self_attn.q_proj", "attention.w_q"),
        block("k_proj", (D, kv), ("embed", "kv_heads"), "self_attn.k_proj", "attention.w_k"),
        block("v_proj", (D, kv), ("embed", "kv_heads"), "self_attn.v_proj", "attention.w_v"),
        block("o_proj", (q, D), ("q_heads", "embed"), "self_attn.o_proj", "attention.w_out"),
        block("q_norm", (q,), ("norm",), "self_attn.q_norm", "attention.q_norm", "ones"),
        block("k_norm", (kv,), ("norm",), "self_attn.k_norm", "attention.k_norm", "ones"),
        block("attn_norm", (D,), ("norm",), "post_attention_layernorm", "attention_norm", "ones"),
        block("w1", (D, F), ("embed", "mlp"), "mlp.gate_proj", "feed_forward.w1"),
        block("w3", (D, F), ("embed", "mlp"), "mlp.up_proj", "feed_forward.w3"),
        block("w2", (F, D), ("mlp", "embed"), "mlp.down_proj", "feed_forward.w2"),
        block("mlp_norm", (D,), ("norm",), "post_feedforward_layernorm", "feed_forward_norm", "ones"),
        Param(("final_norm",), (D,), ("norm",), "ones", hf="model.norm.weight", olmo_core="lm_head.norm.weight"),
        Param(("lm_head",), (D, V), ("embed", "vocab"), hf="lm_head.weight", hf_transpose=True,
              olmo_core="lm_head.w_out.weight"),
    ]


FAMILIES = {"olmo3": _olmo3}


def table(cfg: ModelConfig) -> list[Param]:
    return FAMILIES[cfg.family](cfg)


def _tree(cfg: ModelConfig, value) -> dict:
    tree: dict = {}
    for p in table(cfg):
        node = tree
        for key in p.path[:-1]:
            node = node.setdefault(key, {})
        node[p.path[-1]] = value(p)
    return tree


def param_shapes(cfg: ModelConfig) -> dict:
    return _tree(cfg, lambda p: p.shape)


def param_axes(cfg: ModelConfig) -> dict:
    return _tree(cfg, lambda p: p.axes)


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(p.shape) for p in table(cfg))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass uses (all of them in a dense model)."""
    return round(sum(math.prod(p.shape) * p.active for p in table(cfg)))


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """OLMo-core's init: every linear and the embedding ~ N(0, init_std) truncated at +-3 std; norm gains 1.
    One key per parameter, in the params tree's flattening order."""
    specs = _tree(cfg, lambda p: p)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda s: isinstance(s, Param))
    dtype = jnp.dtype(cfg.param_dtype)

    def one(p: Param, k):
        if p.init == "ones":
            return jnp.ones(p.shape, dtype)
        return (cfg.init_std * jax.random.truncated_normal(k, -3.0, 3.0, p.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(p, k) for p, k in zip(leaves, jax.random.split(key, len(leaves)))])


def foreign_tensors(cfg: ModelConfig, naming: str = "hf") -> dict[str, tuple[Param, int | None]]:
    """Tensor name in another framework's checkpoint (`naming`: "hf" or "olmo_core") -> (parameter, layer)."""
    out = {}
    for p in table(cfg):
        template = getattr(p, naming)
        for layer in range(cfg.n_layers) if p.stacked else [None]:
            out[template.format(layer=layer)] = (p, layer)
    return out


def foreign_view(params: dict, p: Param, layer: int | None, cfg: ModelConfig, cut_vocab: bool = True):
    """The view of an olmax (numpy) array holding one foreign tensor, in the foreign layout: the layer's
    slice, the real vocabulary (`cut_vocab`), [out, in]; writing into it writes the olmax array."""
    array = params
    for key in p.path:
        array = array[key]
    axes = p.axes
    if p.stacked:
        array, axes = array[layer], axes[1:]
    if cut_vocab:
        array = array[tuple(slice(0, cfg.vocab_size) if axis == "vocab" else slice(None) for axis in axes)]
    return array.T if p.hf_transpose else array
