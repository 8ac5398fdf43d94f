"""What every family's parameter table is made of: the `Param` row, the attention (with its QK-norm variant),
dense-MLP and MoE rows of a stack of blocks, and the ends (embedding, final norm, LM head unless tied).

Matrices are stored [in, out] (HF and OLMo-core store torch Linear weights [out, in]: `hf_transpose`);
block parameters are stacked over layers on a leading `layers` axis (`{layer}` in the names). The
embedding and LM head carry the vocabulary padded to `vocab_pad_multiple`; checkpoints of other
frameworks hold the real vocabulary only (the `vocab` axis is cut to `vocab_size` there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from olmax.config import ModelConfig, MoEConfig


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


def moe_shapes(e: MoEConfig, D: int) -> dict:
    """One MoE layer's parameters (d_model D): name -> (shape, logical axes). Expert weights keep only the
    `experts` axis sharded: their other dimensions are never sharded over data/fsdp, so nothing gathers them.
    The selection bias (with bias_update_rate) is state, not a trained weight."""
    E, F = e.num_experts, e.expert_hidden
    shapes = {"router": ((D, E), ("embed", "router")),
              "w1": ((E, D, F), ("experts", "expert_embed", "expert_mlp")),
              "w3": ((E, D, F), ("experts", "expert_embed", "expert_mlp")),
              "w2": ((E, F, D), ("experts", "expert_mlp", "expert_embed"))}
    if S := e.shared_expert_hidden:
        shapes |= {"shared_w1": ((D, S), ("embed", "mlp")), "shared_w3": ((D, S), ("embed", "mlp")),
                   "shared_w2": ((S, D), ("mlp", "embed"))}
    if e.bias_update_rate:
        shapes["score_bias"] = ((E,), ("router",))
    return shapes


QKNorm = Literal["projection", "head", "none"]


def block_rows(cfg: ModelConfig, stack: str, first: int, n: int, mlp: str, names: dict,
               qk_norm: QKNorm) -> list[Param]:
    """Parameters of layers first..first+n-1, stacked under `stack`; `names` maps each to its (HF, OLMo-core)
    names in a layer, without `.weight` (HF names of expert weights hold `{expert}`). The QK-norm gains span
    the whole projection (`projection`: all heads' q, and k), one head (`head`: shared by the heads), or are
    absent (`none`)."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    shapes = {
        "q_proj": ((D, q), ("embed", "q_heads")), "k_proj": ((D, kv), ("embed", "kv_heads")),
        "v_proj": ((D, kv), ("embed", "kv_heads")), "o_proj": ((q, D), ("q_heads", "embed")),
    }
    if qk_norm != "none":
        widths = (q, kv) if qk_norm == "projection" else (cfg.head_size, cfg.head_size)
        shapes |= {"q_norm": ((widths[0],), ("norm",)), "k_norm": ((widths[1],), ("norm",))}
    shapes |= {"attn_norm": ((D,), ("norm",)), "mlp_norm": ((D,), ("norm",))}
    if mlp == "dense":
        F = cfg.mlp_hidden
        shapes |= {"w1": ((D, F), ("embed", "mlp")), "w3": ((D, F), ("embed", "mlp")), "w2": ((F, D), ("mlp", "embed"))}
    else:
        shapes |= moe_shapes(cfg.moe, D)
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


def ends(cfg: ModelConfig) -> list[Param]:
    """The embedding, final norm and LM head (the same names in every family; no LM head of its own with
    tie_embeddings: the embedding's transpose computes the logits)."""
    D, V = cfg.d_model, cfg.padded_vocab
    rows = [
        Param(("embed",), (V, D), ("vocab", "embed"), hf="model.embed_tokens.weight", olmo_core="embeddings.weight"),
        Param(("final_norm",), (D,), ("norm",), "ones", hf="model.norm.weight", olmo_core="lm_head.norm.weight"),
    ]
    if not cfg.tie_embeddings:
        rows.append(Param(("lm_head",), (D, V), ("embed", "vocab"), hf="lm_head.weight", hf_transpose=True,
                          olmo_core="lm_head.w_out.weight"))
    return rows


def signature(family, vocab, d_model, n_layers, heads, kv_heads, head_dim, mlp, eps, rope, window, kinds, tied,
              experts=None) -> dict:
    """What fixes a model's forward pass, comparable across config formats (logit parity checks that the
    reference is the same model); experts = (count, top-k, renormalized gates) of a mixture of experts, whose
    expert hidden size is `mlp`."""
    return {
        "family": family, "vocab_size": vocab, "hidden_size": d_model, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": mlp, "rms_norm_eps": eps, "rope": rope,
        "sliding_window": window if "sliding" in kinds else None, "layer_types": kinds, "experts": experts,
        "tie_word_embeddings": bool(tied),
    }
