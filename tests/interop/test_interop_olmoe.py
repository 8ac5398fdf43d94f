"""HF transformers' OlmoeForCausalLM <-> olmax: configs, per-expert tensors, round trips, logit parity."""

import argparse
import json

import numpy as np
import pytest
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

from olmax.config import CheckpointConfig, load_config
from olmax.interop import InteropError
from olmax.interop.cli import add_commands
from olmax.interop.hf import hf_to_olmax, olmax_to_hf, write_hf
from olmax.model.weights import load_olmax
from olmax.interop.parity import run_parity
from olmax.checkpoint import Checkpointer, check_model_compatible, run_meta
from olmax.model import families
from test_interop import randomize_norms, read_tensors


def make_olmoe_model(directory, *, vocab=300, hidden=64, heads=4, kv_heads=2, expert_hidden=32, experts=8, top_k=2,
                     layers=3, normalize=False, theta=10000.0, seed=0, scale=1.0):
    """A random OlmoeForCausalLM saved with save_pretrained (one tensor per expert); norms random too, so a
    swapped norm shows; every weight times `scale` (peaked predictions)."""
    torch.manual_seed(seed)
    config = OlmoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=normalize, rms_norm_eps=1e-6, initializer_range=0.1, eos_token_id=0, pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    randomize_norms(OlmoeForCausalLM(config), scale).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return make_olmoe_model(tmp_path_factory.mktemp("olmoe") / "tiny")


def test_config_and_tensors_are_read_as_olmoe(olmoe_dir, tmp_path):
    cfg = hf_to_olmax(olmoe_dir, tmp_path / "olmax")
    m = cfg.model
    assert (m.family, families.of(m).NORM_PLACEMENT, m.mlp, m.layer_pattern) == ("olmoe", "pre", "moe", ["global"])
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden, m.moe.normalize_gates) == (8, 2, 32, False)
    assert (m.rope["global"].theta, m.norm_eps, m.kv_heads) == (10000.0, 1e-6, 2)
    _, params, _ = load_olmax(tmp_path / "olmax")
    tensors = read_tensors(olmoe_dir)
    blocks = params["blocks"]
    np.testing.assert_array_equal(blocks["router"][1], tensors["model.layers.1.mlp.gate.weight"].T)
    np.testing.assert_array_equal(blocks["w1"][2, 5], tensors["model.layers.2.mlp.experts.5.gate_proj.weight"].T)
    np.testing.assert_array_equal(blocks["w3"][0, 7], tensors["model.layers.0.mlp.experts.7.up_proj.weight"].T)
    np.testing.assert_array_equal(blocks["w2"][1, 3], tensors["model.layers.1.mlp.experts.3.down_proj.weight"].T)
    np.testing.assert_array_equal(blocks["attn_norm"][2], tensors["model.layers.2.input_layernorm.weight"])
    np.testing.assert_array_equal(blocks["mlp_norm"][2], tensors["model.layers.2.post_attention_layernorm.weight"])


def test_round_trip_is_bit_identical_and_loads_in_transformers(olmoe_dir, tmp_path):
    hf_to_olmax(olmoe_dir, tmp_path / "olmax")
    olmax_to_hf(tmp_path / "olmax", tmp_path / "back", max_shard_bytes=60_000)
    original, back = read_tensors(olmoe_dir), read_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert np.array_equal(back[name], tensor), name
    reloaded = OlmoeForCausalLM.from_pretrained(tmp_path / "back")
    for name, tensor in OlmoeForCausalLM.from_pretrained(olmoe_dir).state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_olmoe_preset_survives_the_hf_config_round_trip():
    """olmoe_1b_7b -> config.json -> transformers' OlmoeConfig -> olmax: the same model (HF's own reading)."""
    cfg = load_config("olmoe_1b_7b")
    hf = OlmoeConfig(**families.to_hf(cfg)).to_dict()
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], hf["norm_topk_prob"]) == (
        64, 8, 1024, False)
    assert hf["rope_parameters"]["rope_theta"] == 10000.0 and hf["rms_norm_eps"] == 1e-5
    back = families.from_hf(hf, name="olmoe")
    check_model_compatible(back.model_dump(mode="json"), cfg.model, "converted")


def test_float32_parity_of_a_peaked_olmoe(tmp_path):
    """Weights x2, renormalized gates: peaked predictions (HF's mean top-1 probability 0.38, entropy 2.5 nats
    against 5.7 for uniform; measured). olmax against HF's float32 OLMoE, its float32 error measured against
    its float64 run (eager experts). At x3 some token's 2nd and 3rd router scores differ by 4e-12 (measured),
    far below float32 rounding, and the comparison fails (mean KL 4.3e-9): the frameworks can route that
    token to different experts."""
    hf_dir = make_olmoe_model(tmp_path / "hf", scale=2.0, normalize=True, layers=4)
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    report = run_parity(tmp_path / "olmax", hf_dir=hf_dir, seq_len=40, batches=2, batch_size=2)
    result = report["comparisons"]["hf"]
    assert result["kl_mean"] <= 1e-9 and result["top1_agreement"] == 1.0, result
    assert result["max_abs_logit_delta_float64"] <= 3.0 * result["reference_float32_error"], result
    assert report["passed"] and result["tokens"] == 160


def test_parity_fails_on_a_wrong_expert_and_refuses_another_router(tmp_path):
    hf_dir = make_olmoe_model(tmp_path / "hf")
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    cfg, params, _ = load_olmax(tmp_path / "olmax")
    params["blocks"]["w2"][1, [2, 3]] = params["blocks"]["w2"][1, [3, 2]]  # two experts' outputs swapped
    Checkpointer(tmp_path / "off", CheckpointConfig()).save_params(0, params, run_meta(cfg, 0, {}))
    off = run_parity(tmp_path / "off", hf_dir=hf_dir, seq_len=24)["comparisons"]["hf"]
    assert off["failed"], off
    other = make_olmoe_model(tmp_path / "top3", top_k=3)
    with pytest.raises(InteropError, match=r"experts: olmax \(8, 2, False\), HF \(8, 3, False\)"):
        run_parity(tmp_path / "olmax", hf_dir=other)
    with pytest.raises(InteropError, match="olmo-core reference builds dense OLMo 3"):
        run_parity(tmp_path / "olmax", olmo_core=True)


def test_parity_cli_on_olmoe(olmoe_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="olmax")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", "hf-to-olmax", str(olmoe_dir), str(tmp_path / "olmax")])
    args.func(args)
    assert "family olmoe" in capsys.readouterr().out
    args = parser.parse_args(["parity", "--hf", str(olmoe_dir), "--olmax", str(tmp_path / "olmax"), "--json",
                              "--seq-len", "24"])
    args.func(args)
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["sliding_window"] is None


@pytest.mark.parametrize("field, value", [("gating", "sigmoid"), ("shared_expert_hidden", 16),
                                          ("bias_update_rate", 1e-3), ("capacity_factor", 1.25)])
def test_export_refuses_what_olmoe_cannot_express(olmoe_dir, tmp_path, field, value):
    hf_to_olmax(olmoe_dir, tmp_path / "olmax")
    cfg, params, _ = load_olmax(tmp_path / "olmax")
    setattr(cfg.model.moe, field, value)
    with pytest.raises(InteropError, match=f"model.*moe.{field}"):
        write_hf(cfg, params, tmp_path / "out")
    with pytest.raises(InteropError, match="no transformers class"):
        write_hf(load_config("tiny_moe"), {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_olmoe_configs_are_named(olmoe_dir, tmp_path):
    import shutil

    for change, message in (({"clip_qkv": 8.0}, "clip_qkv"), ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                                               "RoPE scaling")):
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(olmoe_dir, src)
        config = json.loads((src / "config.json").read_text()) | change
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(InteropError, match=message):
            hf_to_olmax(src, tmp_path / "out")
