"""Parameter and training-FLOP counts, with causal and sliding-window attention counted exactly.

Training FLOPs per token (forward + backward = 3 x forward, 2 FLOPs per multiply-add):

    6 * N_active_nonembed  +  sum over layers of 12 * n_heads * head_dim * A_layer

N_active_nonembed counts the parameters a token's forward pass multiplies with
(a mixture of experts' top_k of n_experts expert weights), except the input
embedding (the LM head is a matmul, the embedding a lookup; a tied embedding is the LM head's matmul too). A_layer is the number of keys a query attends
to, averaged over the positions of a sequence of length T: (T + 1) / 2 for a
causal global layer, and sum_i min(i + 1, w) / T for a window of w keys. The
attention term is 2 matmuls (QK^T and PV) x 2 FLOPs x 3 for the backward.
Counting every layer as a global one reproduces the figure MaxText reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from olmax.config import ModelConfig
from olmax.model.families import active_param_count, param_count


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.padded_vocab * cfg.d_model


def attended_positions(seq_len: int, window: int | None) -> float:
    """Mean number of keys a query sees in a causal layer (window None = global)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


@dataclass(frozen=True)
class FlopCount:
    params: int
    non_embedding_params: int
    active_params: int  # per token
    per_token: float  # sliding layers counted with their window
    per_token_all_global: float  # every layer counted as full causal attention

    def per_step(self, tokens: int) -> float:
        return self.per_token * tokens


def count(cfg: ModelConfig, seq_len: int) -> FlopCount:
    params, active = param_count(cfg), active_param_count(cfg)
    matmuls = 6 * (active - (0 if cfg.tie_embeddings else embedding_params(cfg)))
    per_position = 12 * cfg.n_heads * cfg.head_size
    attention = per_position * sum(attended_positions(seq_len, cfg.window(i)) for i in range(cfg.n_layers))
    attention_all_global = per_position * cfg.n_layers * attended_positions(seq_len, None)
    return FlopCount(params, params - embedding_params(cfg), active, matmuls + attention, matmuls + attention_all_global)
