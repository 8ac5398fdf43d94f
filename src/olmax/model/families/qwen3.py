"""Qwen 3 (transformers' Qwen3ForCausalLM): pre-norm blocks, QK-norm per head (one gain of head_dim shared by
the heads, applied before RoPE), GQA, SwiGLU, global attention with one unscaled RoPE, the LM head tied to the
embedding or not (tie_word_embeddings)."""

from __future__ import annotations

from olmax.config import ModelConfig, RopeConfig, RunConfig
from olmax.errors import InteropError
from olmax.model.families.base import ATTENTION_NAMES, DENSE_MLP_NAMES, Param, block_rows, ends, signature

HF_CLASS = "Qwen3ForCausalLM"
HF_LOAD_ARGS: dict = {}
NORM_PLACEMENT = "pre"  # h = x + attn(norm(x)), out = h + mlp(norm(h))
QK_NORM = "head"
EMBEDDINGS = ("untied", "tied")
olmo_core_config = None  # compared with the HF reference only
HF_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json has none


def check_config(m: ModelConfig) -> None:
    if m.mlp != "dense" or m.layer_pattern != ["global"]:
        raise ValueError("family qwen3 (HF Qwen3ForCausalLM) has a dense MLP and global attention in every layer: "
                         "set mlp: dense, layer_pattern: [global]")


def table(cfg: ModelConfig) -> list[Param]:
    names = {k: hf for k, (hf, _) in (ATTENTION_NAMES | DENSE_MLP_NAMES).items()}
    names |= {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    return ends(cfg) + block_rows(cfg, "blocks", 0, cfg.n_layers, "dense",
                                  {k: (hf, None) for k, hf in names.items()}, QK_NORM)


def check_exportable(m: ModelConfig) -> None:
    if m.rope["global"].type != "default":
        raise InteropError(f"model.rope.global is {m.rope['global'].type}; olmax exports Qwen 3 with unscaled RoPE only")


def from_hf(hf: dict, where: str) -> dict:
    """olmax model fields of an HF Qwen3 config beyond those every family shares (`Qwen3Config`'s defaults where
    config.json omits a field)."""
    if hf.get("use_sliding_window"):
        raise InteropError(f"{where}: use_sliding_window is true; olmax reads Qwen 3 with global attention only")
    rope = dict(hf.get("rope_parameters") or {}) | (hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise InteropError(f"{where}: RoPE scaling {rope} is not implemented for Qwen 3 (olmax reads default RoPE)")
    head_dim = hf.get("head_dim") or HF_HEAD_DIM
    return {"mlp_hidden": hf["intermediate_size"], "layer_pattern": ["global"],
            "rope": {"global": {"theta": float(rope.get("rope_theta", hf.get("rope_theta", 1000000.0)))}},
            "head_dim": None if head_dim == hf["hidden_size"] // hf["num_attention_heads"] else head_dim}


def to_hf(cfg: RunConfig) -> dict:
    """HF Qwen3 config fields beyond those every family shares."""
    m = cfg.model
    theta = m.rope["global"].theta
    return {"intermediate_size": m.mlp_hidden, "head_dim": m.head_size, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers}


def hf_signature(config) -> dict:
    """The parity signature of a transformers Qwen3Config, as transformers resolved it."""
    kinds = ["global" if t == "full_attention" else t for t in config.layer_types]
    rope = {"global": RopeConfig(theta=config.rope_parameters["rope_theta"]).model_dump()}
    return signature(config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers,
                     config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     config.intermediate_size, config.rms_norm_eps, rope, config.sliding_window, kinds,
                     config.tie_word_embeddings)
