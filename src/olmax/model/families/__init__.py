"""Model families, one module each, declaring:

    HF_CLASS, HF_LOAD_ARGS   its transformers class (= its parity reference) and how to load it
    NORM_PLACEMENT           "reordered" (h = x + norm(attn(x))) or "pre" (h = x + attn(norm(x)))
    QK_NORM                  "projection" (one norm over all heads' q, and k), "head" (per head), "none"
    EMBEDDINGS               ("untied",) or ("untied", "tied"): whether model.tie_embeddings may be set
    check_config(m)          what else its architecture allows of the model config (ValueError naming the fix)
    table(m)                 its parameters: shape, logical axes, init, names in HF (and OLMo-core) checkpoints
    check_exportable(m), from_hf(hf, where), to_hf(cfg), hf_signature(hf config)
    olmo_core_config(m)      OLMo-core's TransformerConfig of the model, or None (no OLMo-core reference)

Shapes, sharding, init, HF import/export and the parity mapping all derive from the tables; adding a family
is one module here, its line in FAMILIES (the only list of families) and its tests. This module holds what
every family shares.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from olmax.config import ConfigError, ModelConfig, RunConfig, validate
from olmax.errors import InteropError
from olmax.model.families import olmo3, olmoe, qwen3
from olmax.model.families.base import Param, signature

FAMILIES = {"olmo3": olmo3, "olmoe": olmoe, "qwen3": qwen3}  # model.family (= HF model_type) -> module
HF_CLASSES = {name: family.HF_CLASS for name, family in FAMILIES.items()}


def of(cfg: ModelConfig):
    """The family module of a model."""
    return FAMILIES[cfg.family]


def check_config(m: ModelConfig) -> None:
    """The model config's family rules (run by ModelConfig's validation): a known family, its embeddings, and
    what its module's check_config says."""
    if m.family not in FAMILIES:
        raise ValueError(f"family {m.family!r} is not a model family; families: {sorted(FAMILIES)}")
    family = FAMILIES[m.family]
    if m.tie_embeddings and "tied" not in family.EMBEDDINGS:
        raise ValueError(f"family {m.family} ({family.HF_CLASS}) has an LM head of its own: set tie_embeddings "
                         "false (HF tie_word_embeddings)")
    family.check_config(m)


def table(cfg: ModelConfig) -> list[Param]:
    return of(cfg).table(cfg)


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


def foreign_tensor_count(cfg: ModelConfig, naming: str = "hf") -> int:
    """len(foreign_tensors(cfg, naming)), counted without listing them."""
    return sum(math.prod(p.shape[:int(p.stacked) + int("{expert}" in getattr(p, naming))])
               for p in table(cfg) if getattr(p, naming) is not None)


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


# --- HF config.json <-> olmax ----------------------------------------------------------------------


def _token_id(hf: dict, field: str, vocab_size: int, where: str) -> int | None:
    value = hf.get(field)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and not 0 <= value < vocab_size:
        raise InteropError(f"{where}: {field} {value} is outside the vocabulary (vocab_size {vocab_size})")
    return value


def from_hf(hf: dict, name: str, where: str = "config.json") -> RunConfig:
    """The olmax run config of an HF config.json of a known family (`model_type`): the model derived from it,
    the rest the 7B recipe."""
    unsupported = {
        "attention_bias": (hf.get("attention_bias", False), False),
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
    }
    if bad := {k: got for k, (got, want) in unsupported.items() if got != want}:
        raise InteropError(f"{where}: unsupported settings {bad} (olmax's families have no biases and a SiLU MLP)")
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if missing := [k for k in sizes if k not in hf]:
        raise InteropError(f"{where}: missing fields {missing}")
    for field in (*sizes, "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok"):
        if field in hf and hf[field] is not None and (type(hf[field]) is not int or hf[field] < 1):
            raise InteropError(f"{where}: {field} is {hf[field]!r}; it is a size: a whole number of at least 1")
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim")
    model = {
        "vocab_size": hf["vocab_size"],
        "d_model": d_model,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": None if hf.get("num_key_value_heads") in (None, n_heads) else hf["num_key_value_heads"],
        "head_dim": None if head_dim in (None, d_model // n_heads) else head_dim,
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "init_std": hf.get("initializer_range", 0.02),
        "param_dtype": "float32",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    family = hf.get("model_type") if hf.get("model_type") in FAMILIES else "olmo3"
    model |= {"family": family} | FAMILIES[family].from_hf(hf, where)
    eos = _token_id(hf, "eos_token_id", hf["vocab_size"], where)
    pad = _token_id(hf, "pad_token_id", hf["vocab_size"], where)
    if eos is None:
        raise InteropError(f"{where}: eos_token_id is missing; olmax's data config needs it")
    data = {"eos_id": eos, "pad_id": eos if pad is None else pad,
            "token_dtype": "uint16" if hf["vocab_size"] <= 2**16 else "uint32"}
    try:
        return validate({"name": name, "model": model, "data": data}, source=where)
    except ConfigError as err:
        raise InteropError(str(err)) from None


def check_exportable(m: ModelConfig) -> None:
    """Refuse a model its family's transformers class cannot express (it would load, and compute another
    function)."""
    of(m).check_exportable(m)


def to_hf(cfg: RunConfig, dtype: str = "float32") -> dict:
    """config.json for the family's transformers class (its HF_CLASS)."""
    m = cfg.model
    check_exportable(m)
    return {
        "architectures": [of(m).HF_CLASS],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.data.sequence_length,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": cfg.data.eos_id,
        "pad_token_id": cfg.data.pad_id,
        "use_cache": True,
        "dtype": dtype,
    } | of(m).to_hf(cfg)


# --- logit parity ----------------------------------------------------------------------------------


def parity_signature(m: ModelConfig) -> dict:
    """What fixes the model's forward pass (families.base.signature), for comparison with a reference's."""
    kinds = ["global" if m.is_global(i) else "sliding" for i in range(m.n_layers)]
    rope = {kind: m.rope[kind].model_dump() for kind in sorted(set(kinds))}
    mlp, experts = m.mlp_hidden, None
    if m.mlp == "moe":
        mlp, experts = m.moe.expert_hidden, (m.moe.num_experts, m.moe.top_k, m.moe.normalize_gates)
    return signature(m.family, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.head_size, mlp,
                     m.norm_eps, rope, m.sliding_window, kinds, m.tie_embeddings, experts)


def hf_signature(config) -> dict:
    """The parity signature of a transformers config object, by its model_type."""
    return FAMILIES[config.model_type].hf_signature(config)
