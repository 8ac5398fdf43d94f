"""OLMoE (transformers' OlmoeForCausalLM): pre-norm blocks (input_layernorm before attention,
post_attention_layernorm before the MoE), whole-projection QK-norm, an MoE MLP in every layer, global
attention with one unscaled RoPE. Its experts are stored one tensor per expert, [out, in], as OLMoE
checkpoints on the Hub and transformers' save_pretrained store them."""

from __future__ import annotations

from olmax.config import ModelConfig, RopeConfig, RunConfig
from olmax.errors import InteropError
from olmax.model.families.base import ATTENTION_NAMES, Param, block_rows, ends, signature

HF_CLASS = "OlmoeForCausalLM"
HF_LOAD_ARGS = {"experts_implementation": "eager"}  # transformers' grouped expert kernels have no float64
NORM_PLACEMENT = "pre"  # h = x + attn(norm(x)), out = h + mlp(norm(h))
QK_NORM = "projection"
EMBEDDINGS = ("untied",)
olmo_core_config = None  # compared with the HF reference only
EXPERT_NAMES = {"router": "mlp.gate", "w1": "mlp.experts.{expert}.gate_proj",
                "w3": "mlp.experts.{expert}.up_proj", "w2": "mlp.experts.{expert}.down_proj"}


def check_config(m: ModelConfig) -> None:
    if m.mlp != "moe" or m.dense_layers or "sliding" in m.layer_pattern:
        raise ValueError("family olmoe (HF OlmoeForCausalLM) has MoE MLPs in every layer and global attention "
                         "only: set mlp: moe, dense_layers: 0, layer_pattern: [global]")
    if m.head_dim not in (None, m.d_model // m.n_heads):
        raise ValueError("family olmoe: head_dim must be d_model / n_heads (OLMoE's q_norm is d_model wide)")


def table(cfg: ModelConfig) -> list[Param]:
    names = {k: hf for k, (hf, _) in ATTENTION_NAMES.items()}
    names |= {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"} | EXPERT_NAMES
    return ends(cfg) + block_rows(cfg, "blocks", 0, cfg.n_layers, "moe", {k: (hf, None) for k, hf in names.items()}, QK_NORM)


def check_exportable(m: ModelConfig) -> None:
    """OlmoeForCausalLM would load a model with any of these set, and compute another function."""
    e = m.moe
    bad = {"moe.gating": e.gating != "softmax", "moe.shared_expert_hidden": e.shared_expert_hidden is not None,
           "moe.bias_update_rate": e.bias_update_rate is not None, "moe.capacity_factor": e.capacity_factor
           is not None, "moe.routing": e.routing != "learned", "rope": m.rope["global"].type != "default"}
    if fields := [k for k, b in bad.items() if b]:
        raise InteropError(f"OlmoeForCausalLM has a softmax router, dropless learned top-k routing, no shared "
                           f"expert or selection bias, and unscaled RoPE; this model sets model.{fields}")


def from_hf(hf: dict, where: str) -> dict:
    """olmax model fields of an HF OLMoE config beyond those every family shares: MoE in every layer, global
    attention, one unscaled RoPE (`OlmoeConfig`'s defaults where config.json omits a field)."""
    if hf.get("clip_qkv") is not None:
        raise InteropError(f"{where}: clip_qkv {hf['clip_qkv']} is not implemented (olmax does not clip q, k, v)")
    rope = dict(hf.get("rope_parameters") or {}) | (hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise InteropError(f"{where}: RoPE scaling {rope} is not implemented for OLMoE (olmax reads default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {
        "mlp": "moe", "layer_pattern": ["global"], "rope": {"global": {"theta": float(theta)}},
        "moe": {"num_experts": hf.get("num_experts", 64), "top_k": hf.get("num_experts_per_tok", 8),
                "expert_hidden": hf["intermediate_size"], "normalize_gates": hf.get("norm_topk_prob", False),
                "load_balancing_loss": hf.get("router_aux_loss_coef", 0.01)},
    }


def to_hf(cfg: RunConfig) -> dict:
    """HF OLMoE config fields beyond those every family shares."""
    m = cfg.model
    theta = m.rope["global"].theta
    return {"intermediate_size": m.moe.expert_hidden, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "clip_qkv": None,
            "num_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.top_k,
            "norm_topk_prob": m.moe.normalize_gates, "router_aux_loss_coef": m.moe.load_balancing_loss,
            "output_router_logits": False}


def hf_signature(config) -> dict:
    """The parity signature of a transformers OlmoeConfig, as transformers resolved it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kinds = ["global"] * config.num_hidden_layers
    rope = {"global": RopeConfig(theta=config.rope_parameters["rope_theta"]).model_dump()}
    experts = (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
    return signature(config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers,
                     config.num_attention_heads, config.num_key_value_heads, head_dim, config.intermediate_size,
                     config.rms_norm_eps, rope, None, kinds, config.tie_word_embeddings, experts)
