"""OLMo 3 (transformers' Olmo3ForCausalLM): reordered-norm blocks, whole-projection QK-norm, SwiGLU, sliding
and global attention layers with RoPE per layer kind; with mlp: moe, MoE MLPs after `dense_layers` dense
ones (a stack of their own, `dense_blocks`). transformers has no OLMo-3-MoE class: the MoE rows carry no HF
names, and such a model is not exportable."""

from __future__ import annotations

from olmax.config import ModelConfig, RopeConfig, RunConfig
from olmax.errors import InteropError
from olmax.model.families.base import ATTENTION_NAMES, DENSE_MLP_NAMES, Param, block_rows, ends, signature

HF_CLASS = "Olmo3ForCausalLM"
HF_LOAD_ARGS: dict = {}
NORM_PLACEMENT = "reordered"  # h = x + norm(attn(x)), out = h + norm(mlp(h)): no input norms
QK_NORM = "projection"
EMBEDDINGS = ("untied",)
LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "global"}  # HF layer type -> olmax kind
HF_LAYER_TYPES = {kind: name for name, kind in LAYER_KINDS.items()}
ROPE_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "truncate"}


def check_config(m: ModelConfig) -> None:
    """Every OLMo 3 variant olmax builds is allowed (an MoE one is not exportable: check_exportable)."""


def table(cfg: ModelConfig) -> list[Param]:
    names = ATTENTION_NAMES | DENSE_MLP_NAMES | {"attn_norm": ("post_attention_layernorm", "attention_norm"),
                                                 "mlp_norm": ("post_feedforward_layernorm", "feed_forward_norm")}
    if cfg.mlp == "dense":
        return ends(cfg) + block_rows(cfg, "blocks", 0, cfg.n_layers, "dense", names, QK_NORM)
    blocks = block_rows(cfg, "dense_blocks", 0, cfg.dense_layers, "dense", names, QK_NORM) if cfg.dense_layers else []
    shared = {k: (None, olmo_core) for k, (_, olmo_core) in names.items() if k not in DENSE_MLP_NAMES}
    blocks += block_rows(cfg, "blocks", cfg.dense_layers, cfg.n_layers - cfg.dense_layers, "moe", shared, QK_NORM)
    return ends(cfg) + blocks


def check_exportable(m: ModelConfig) -> None:
    if m.mlp != "dense":
        raise InteropError("model.mlp moe with family olmo3 has no transformers class (Olmo3ForCausalLM is dense); "
                           "HF interop of a mixture of experts is OlmoeForCausalLM, model.family olmoe")


# --- HF config.json <-> olmax ----------------------------------------------------------------------


def rope_from_hf(hf: dict, where: str) -> dict:
    """olmax `model.rope` (per layer kind) from transformers' Olmo3 RoPE fields, resolved exactly as
    `Olmo3Config` resolves them: `rope_parameters` keyed by layer type; an old-style `rope_scaling` merged
    into the full-attention entry only; a top-level `rope_theta` filling in the full-attention theta only
    (sliding layers default to 500000 whatever it says)."""
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise InteropError(f"{where}: partial_rotary_factor {hf['partial_rotary_factor']} is not supported "
                           "(olmax rotates every dimension of a head)")
    params = hf.get("rope_parameters") or {}
    if ignored := sorted(set(params) - set(LAYER_KINDS)):
        raise InteropError(f"{where}: rope_parameters has keys {ignored} that are not layer types; transformers' "
                           f"Olmo3 reads only {sorted(LAYER_KINDS)} (and would ignore these)")
    entries = {name: dict(params.get(name) or {"rope_type": "default"}) for name in LAYER_KINDS}
    if scaling := dict(hf.get("rope_scaling") or {}):
        if "type" in scaling:  # the legacy name of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        entries["full_attention"].update(scaling)
    entries["full_attention"].setdefault("rope_theta", hf.get("rope_theta", 500000.0))
    entries["sliding_attention"].setdefault("rope_theta", 500000.0)
    rope = {}
    for name, p in entries.items():
        at = f"{where}: rope_parameters[{name!r}]"
        if unknown := sorted(set(p) - ROPE_KEYS - {"type"}):
            raise InteropError(f"{at} has fields olmax does not implement: {unknown}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise InteropError(f"{at}: rope_type {kind!r} is not implemented (olmax has default and yarn)")
        if p.get("truncate", True) is not True:
            raise InteropError(f"{at}: truncate=false is not implemented (and transformers' Olmo3 reads truncate "
                               "from the top level of rope_parameters, so it would not honour it either)")
        entry = {"theta": float(p["rope_theta"]), "type": kind}
        if kind == "yarn":
            original = p.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
            if not original:
                raise InteropError(f"{at}: yarn needs original_max_position_embeddings (or max_position_embeddings)")
            entry |= {"factor": p.get("factor") or hf["max_position_embeddings"] / original,
                      "original_max_position_embeddings": original, "beta_fast": p.get("beta_fast") or 32.0,
                      "beta_slow": p.get("beta_slow") or 1.0, "attention_factor": p.get("attention_factor")}
        rope[LAYER_KINDS[name]] = entry
    return rope


def _hf_rope(rope) -> dict:
    """transformers' `rope_parameters` entry of one olmax RopeConfig."""
    entry = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type == "yarn":
        entry |= {"factor": rope.factor, "original_max_position_embeddings": rope.original_max_position_embeddings,
                  "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow}
        if rope.attention_factor is not None:
            entry["attention_factor"] = rope.attention_factor
    return entry


def _layer_pattern(hf: dict, n_layers: int, where: str) -> list[str]:
    """The shortest period of `layer_types` (a period dividing n_layers; the whole list at worst)."""
    layer_types = hf.get("layer_types")
    if layer_types is None:  # HF's default: every fourth layer global
        layer_types = [HF_LAYER_TYPES["global" if (i + 1) % 4 == 0 else "sliding"] for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise InteropError(f"{where}: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
    if unknown := sorted({t for t in layer_types if t not in LAYER_KINDS}):
        raise InteropError(f"{where}: layer_types has unsupported kinds {unknown}; supported: {sorted(LAYER_KINDS)}")
    kinds = [LAYER_KINDS[t] for t in layer_types]
    period = next(p for p in range(1, n_layers + 1) if n_layers % p == 0 and kinds == kinds[:p] * (n_layers // p))
    return kinds[:period]


def from_hf(hf: dict, where: str) -> dict:
    """olmax model fields of an HF Olmo3 config beyond those every family shares."""
    pattern = _layer_pattern(hf, hf["num_hidden_layers"], where)
    window = hf.get("sliding_window")
    if "sliding" in pattern and not window:
        raise InteropError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    return {"mlp_hidden": hf["intermediate_size"], "rope": rope_from_hf(hf, where), "layer_pattern": pattern} | (
        {"sliding_window": window} if window else {})


def to_hf(cfg: RunConfig) -> dict:
    """HF Olmo3 config fields beyond those every family shares. RoPE as `rope_parameters` per layer type
    (transformers 5), and as `rope_theta` too when both kinds share an unscaled theta (transformers 4 reads
    that)."""
    m = cfg.model
    unscaled = {r.theta for r in m.rope.values() if r.type == "default"}
    single_theta = len(unscaled) == 1 and all(r.type == "default" for r in m.rope.values())
    config = {
        "intermediate_size": m.mlp_hidden,
        "rope_parameters": {name: _hf_rope(m.rope.get(kind, m.rope["global"])) for name, kind in LAYER_KINDS.items()},
        "sliding_window": m.sliding_window,
        "layer_types": [HF_LAYER_TYPES["global" if m.is_global(i) else "sliding"] for i in range(m.n_layers)],
    }
    if single_theta:
        config["rope_theta"] = unscaled.pop()
    if m.head_dim is not None:
        config["head_dim"] = m.head_dim
    return config


def olmo_core_config(m: ModelConfig):
    """OLMo-core's own OLMo 3 transformer config of a dense model with one unscaled RoPE (the parity reference
    built with the olmax weights)."""
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    if m.mlp != "dense":
        raise InteropError("the olmo-core reference builds dense OLMo 3 models; compare a mixture of experts with "
                           "the HF reference")
    if len({(r.type, r.theta) for r in m.rope.values()}) > 1 or any(r.type != "default" for r in m.rope.values()):
        raise InteropError("the olmo-core reference builds unscaled RoPE with one theta for every layer; this model "
                           f"has {dict(m.rope)}: compare it with the HF reference")
    pattern = [-1 if m.is_global(i) else m.sliding_window for i in range(len(m.layer_pattern))]
    sliding = None if all(w == -1 for w in pattern) else SlidingWindowAttentionConfig(
        pattern=pattern, force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False)
    return TransformerConfig.llama_like(
        d_model=m.d_model, vocab_size=m.padded_vocab, n_layers=m.n_layers, n_heads=m.n_heads,
        n_kv_heads=m.kv_heads, head_dim=m.head_dim, block_name=TransformerBlockType.reordered_norm, qk_norm=True,
        rope_theta=m.rope["global"].theta, layer_norm_eps=m.norm_eps,
        feed_forward=FeedForwardConfig(hidden_size=m.mlp_hidden, bias=False),
        attn_backend=AttentionBackendName.torch, sliding_window=sliding,
    )


def hf_signature(config) -> dict:
    """The parity signature of a transformers Olmo3Config, as transformers itself resolved config.json (it may
    read a field differently from olmax)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kinds = [LAYER_KINDS.get(t, t) for t in config.layer_types]
    resolved = rope_from_hf({"rope_parameters": config.rope_parameters,
                             "max_position_embeddings": config.max_position_embeddings},
                            "transformers' resolved config")
    rope = {kind: RopeConfig(**resolved[kind]).model_dump() for kind in sorted(set(kinds))}
    return signature(config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers,
                     config.num_attention_heads, config.num_key_value_heads, head_dim, config.intermediate_size,
                     config.rms_norm_eps, rope, config.sliding_window, kinds, config.tie_word_embeddings)
