"""Parameter tables, one per model family: each parameter's shape, logical axes, init, and its name in HF
transformers and OLMo-core checkpoints. Shapes, sharding, init, HF import/export and the parity mapping
all derive from these tables, so a new parameter is one line here.

Matrices are stored [in, out] (HF and OLMo-core store torch Linear weights [out, in]: `hf_transpose`);
block parameters are stacked over layers on a leading `layers` axis (`{layer}` in the names). The
embedding and LM head carry the vocabulary padded to `vocab_pad_multiple`; checkpoints of other
frameworks hold the real vocabulary only (the `vocab` axis is cut to `vocab_size` there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig
from olmax.model import moe


@dataclass(frozen=True)
class Param:
    path: tuple[str, ...]  # where in the params tree
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, mapped onto the mesh by mesh.rules
    init: Literal["normal", "ones", "zeros"] = "normal"  # truncated normal (init_std, cut at 3 std), ones, zeros
    hf: str | None = None  # tensor name in HF safetensors ({layer}, and {expert} for one tensor per expert)
    hf_transpose: bool = False
    olmo_core: str | None = None  # key in OLMo-core's transformer state dict
    active: float = 1.0  # share of it a token's forward pass uses (top_k / n_experts for expert weights)
    first_layer: int = 0  # model layer of index 0 on the `layers` axis (MoE layers after dense ones)
    trained: bool = True  # False: state moved outside the gradient (the MoE selection bias), not a parameter

    @property
    def stacked(self) -> bool:
        return self.axes[0] == "layers"

    def foreign_shape(self, cfg: ModelConfig, index: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one of its tensors in an HF checkpoint (the one at leading `index`): the real vocabulary,
        [out, in]."""
        shape = [cfg.vocab_size if axis == "vocab" else n for axis, n in zip(self.axes, self.shape)][len(index):]
        return tuple(reversed(shape)) if self.hf_transpose else tuple(shape)


def _block_rows(cfg: ModelConfig, stack: str, first: int, n: int, mlp: str, names: dict) -> list[Param]:
    """Parameters of layers first..first+n-1, stacked under `stack`; `names` maps each to its (HF, OLMo-core)
    names in a layer, without `.weight` (HF names of expert weights hold `{expert}`)."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    shapes = {
        "q_proj": ((D, q), ("embed", "q_heads")), "k_proj": ((D, kv), ("embed", "kv_heads")),
        "v_proj": ((D, kv), ("embed", "kv_heads")), "o_proj": ((q, D), ("q_heads", "embed")),
        "q_norm": ((q,), ("norm",)), "k_norm": ((kv,), ("norm",)),
        "attn_norm": ((D,), ("norm",)), "mlp_norm": ((D,), ("norm",)),
    }
    if mlp == "dense":
        F = cfg.mlp_hidden
        shapes |= {"w1": ((D, F), ("embed", "mlp")), "w3": ((D, F), ("embed", "mlp")), "w2": ((F, D), ("mlp", "embed"))}
    else:
        shapes |= {k: (shape, moe.param_axes(cfg.moe)[k]) for k, shape in moe.param_shapes(cfg.moe, D).items()}
    rows = []
    for name, (shape, axes) in shapes.items():
        hf, olmo_core = names.get(name, (None, None))
        rows.append(Param(
            (stack, name), (n, *shape), ("layers", *axes),
            init="ones" if "norm" in name else "zeros" if name == "score_bias" else "normal",
            hf=hf and f"model.layers.{{layer}}.{hf}.weight", hf_transpose=len(shape) > 1,
            olmo_core=olmo_core and f"blocks.{{layer}}.{olmo_core}.weight",
            active=cfg.moe.top_k / cfg.moe.num_experts if axes[0] == "experts" else 1.0,
            first_layer=first, trained=name != "score_bias",
        ))
    return rows


ATTENTION_NAMES = {
    "q_proj": ("self_attn.q_proj", "attention.w_q"), "k_proj": ("self_attn.k_proj", "attention.w_k"),
    "v_proj": ("self_attn.v_proj", "attention.w_v"), "o_proj": ("self_attn.o_proj", "attention.w_out"),
    "q_norm": ("self_attn.q_norm", "attention.q_norm"), "k_norm": ("self_attn.k_norm", "attention.k_norm"),
}
DENSE_MLP_NAMES = {"w1": ("mlp.gate_proj", "feed_forward.w1"), "w3": ("mlp.up_proj", "feed_forward.w3"),
                   "w2": ("mlp.down_proj", "feed_forward.w2")}
# One tensor per expert, [out, in], as OLMoE checkpoints on the Hub and transformers' save_pretrained store them.
EXPERT_NAMES = {"router": ("mlp.gate", None), "w1": ("mlp.experts.{expert}.gate_proj", None),
                "w3": ("mlp.experts.{expert}.up_proj", None), "w2": ("mlp.experts.{expert}.down_proj", None)}


def _ends(cfg: ModelConfig) -> list[Param]:
    """The embedding, final norm and LM head (the same names in every family)."""
    D, V = cfg.d_model, cfg.padded_vocab
    return [
        Param(("embed",), (V, D), ("vocab", "embed"), hf="model.embed_tokens.weight", olmo_core="embeddings.weight"),
        Param(("final_norm",), (D,), ("norm",), "ones", hf="model.norm.weight", olmo_core="lm_head.norm.weight"),
        Param(("lm_head",), (D, V), ("embed", "vocab"), hf="lm_head.weight", hf_transpose=True,
              olmo_core="lm_head.w_out.weight"),
    ]


def _olmo3(cfg: ModelConfig) -> list[Param]:
    """OLMo 3 (transformers' Olmo3ForCausalLM): reordered-norm blocks, whole-projection QK-norm, SwiGLU; with
    mlp: moe, MoE MLPs after `dense_layers` dense ones (a stack of their own, `dense_blocks`). transformers has
    no OLMo-3-MoE class: the MoE rows carry no HF names."""
    names = ATTENTION_NAMES | DENSE_MLP_NAMES | {"attn_norm": ("post_attention_layernorm", "attention_norm"),
                                                 "mlp_norm": ("post_feedforward_layernorm", "feed_forward_norm")}
    if cfg.mlp == "dense":
        blocks = _block_rows(cfg, "blocks", 0, cfg.n_layers, "dense", names)
    else:
        blocks = _block_rows(cfg, "dense_blocks", 0, cfg.dense_layers, "dense", names) if cfg.dense_layers else []
        shared = {k: (None, olmo_core) for k, (_, olmo_core) in names.items() if k not in DENSE_MLP_NAMES}
        blocks += _block_rows(cfg, "blocks", cfg.dense_layers, cfg.n_layers - cfg.dense_layers, "moe", shared)
    return _ends(cfg) + blocks


def _olmoe(cfg: ModelConfig) -> list[Param]:
    """OLMoE (transformers' OlmoeForCausalLM): pre-norm blocks (input_layernorm before attention,
    post_attention_layernorm before the MoE), whole-projection QK-norm, an MoE MLP in every layer."""
    names = ATTENTION_NAMES | {"attn_norm": ("input_layernorm", "attention_norm"),
                               "mlp_norm": ("post_attention_layernorm", "feed_forward_norm")}
    names = {k: (hf, None) for k, (hf, _) in (names | EXPERT_NAMES).items()}
    return _ends(cfg) + _block_rows(cfg, "blocks", 0, cfg.n_layers, "moe", names)


FAMILIES = {"olmo3": _olmo3, "olmoe": _olmoe}


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
    """Parameters (OLMo-core's count: the MoE selection bias is state, not a parameter)."""
    return sum(math.prod(p.shape) for p in table(cfg) if p.trained)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass uses (all of them in a dense model)."""
    return round(sum(math.prod(p.shape) * p.active for p in table(cfg) if p.trained))


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """OLMo-core's init: every linear and the embedding ~ N(0, init_std) truncated at +-3 std; norm gains 1;
    the MoE selection bias 0. One key per parameter, in the params tree's flattening order."""
    specs = _tree(cfg, lambda p: p)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda s: isinstance(s, Param))
    dtype = jnp.dtype(cfg.param_dtype)

    def one(p: Param, k):
        if p.init != "normal":
            return (jnp.ones if p.init == "ones" else jnp.zeros)(p.shape, dtype)
        return (cfg.init_std * jax.random.truncated_normal(k, -3.0, 3.0, p.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(p, k) for p, k in zip(leaves, jax.random.split(key, len(leaves)))])


def foreign_tensors(cfg: ModelConfig, naming: str = "hf") -> dict[str, tuple[Param, tuple[int, ...]]]:
    """Tensor name in another framework's checkpoint (`naming`: "hf" or "olmo_core") -> (parameter, index):
    the index of the tensor's slice along the parameter's leading axes (its layer, and expert for a tensor
    per expert)."""
    out = {}
    for p in table(cfg):
        template = getattr(p, naming)
        if template is None:
            if not p.trained:
                continue  # the selection bias: no foreign tensor, checked by the caller's config checks
            raise ValueError(f"{cfg.family} parameter {'/'.join(p.path)} has no {naming} name")
        split = int(p.stacked) + int("{expert}" in template)
        for index in itertools.product(*map(range, p.shape[:split])):
            layer = p.first_layer + index[0] if index else None
            out[template.format(layer=layer, expert=index[1] if split == 2 else None)] = (p, index)
    return out


def foreign_view(params: dict, p: Param, index: tuple[int, ...], cfg: ModelConfig, cut_vocab: bool = True):
    """The view of an olmax (numpy) array holding one foreign tensor, in the foreign layout: the slice at
    `index`, the real vocabulary (`cut_vocab`), [out, in]; writing into it writes the olmax array."""
    array = params
    for key in p.path:
        array = array[key]
    array, axes = array[index], p.axes[len(index):]
    if cut_vocab:
        array = array[tuple(slice(0, cfg.vocab_size) if axis == "vocab" else slice(None) for axis in axes)]
    return array.T if p.hf_transpose else array
