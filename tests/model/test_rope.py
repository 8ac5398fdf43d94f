"""RoPE per layer kind, default and YaRN, against transformers' own computation."""

import math

import numpy as np
import pytest
import torch
from transformers import Olmo3Config
from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

from olmax.config import RopeConfig
from olmax.model import rope

YARN_CASES = [
    dict(theta=500000.0, factor=8.0, original=8192, head_dim=128),  # OLMo 3 long context: 8192 -> 65536
    dict(theta=10000.0, factor=4.0, original=2048, head_dim=64),
    dict(theta=500000.0, factor=8.0, original=8192, head_dim=128, beta_fast=16.0, beta_slow=2.0,
         attention_factor=1.1),
]


def _hf(case: dict | None, head_dim: int, theta: float):
    full = {"rope_type": "default", "rope_theta": theta}
    if case:
        full = {"rope_type": "yarn", "rope_theta": theta, "factor": case["factor"],
                "original_max_position_embeddings": case["original"]}
        full |= {k: case[k] for k in ("beta_fast", "beta_slow", "attention_factor") if k in case}
    config = Olmo3Config(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, num_hidden_layers=4,
                         max_position_embeddings=65536,
                         rope_parameters={"full_attention": full,
                                          "sliding_attention": {"rope_type": "default", "rope_theta": theta}})
    return Olmo3RotaryEmbedding(config)


def _ours(case: dict | None, theta: float) -> RopeConfig:
    if not case:
        return RopeConfig(theta=theta)
    extra = {k: case[k] for k in ("beta_fast", "beta_slow", "attention_factor") if k in case}
    return RopeConfig(theta=theta, type="yarn", factor=case["factor"],
                      original_max_position_embeddings=case["original"], **extra)


@pytest.mark.parametrize("case", [None, *YARN_CASES])
def test_inverse_frequencies_and_scale_equal_transformers(case):
    head_dim, theta = (case or {}).get("head_dim", 128), (case or {}).get("theta", 500000.0)
    hf = _hf(case, head_dim, theta)
    inv_freq, scale = rope.inverse_frequencies(_ours(case, theta), head_dim)
    assert np.array_equal(inv_freq, hf.full_attention_inv_freq.numpy())
    assert scale == pytest.approx(hf.full_attention_attention_scaling, rel=1e-15)
    if case and "attention_factor" not in case:
        assert scale == pytest.approx(0.1 * math.log(case["factor"]) + 1)


@pytest.mark.parametrize("case", [None, YARN_CASES[0]])
def test_cos_sin_tables_equal_transformers_far_out(case):
    hf = _hf(case, 128, 500000.0)
    positions = np.array([0, 1, 4095, 8191, 16383, 65535])
    cos, sin = rope.tables(_ours(case, 500000.0), 128, positions)
    hf_cos, hf_sin = hf(torch.zeros(1), torch.from_numpy(positions)[None], "full_attention")
    np.testing.assert_allclose(cos, hf_cos[0].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, hf_sin[0].numpy(), rtol=0, atol=2e-6)
