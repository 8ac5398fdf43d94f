"""HF transformers' Qwen3ForCausalLM <-> olmax: configs, per-head QK-norm, tied embeddings, round trips, logit
parity judged against HF's float64 logits, and the tiny_qwen3 preset from training to transformers."""

import argparse
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from olmax.checkpoint import Checkpointer, run_meta
from olmax.config import CheckpointConfig, ConfigError, load_config
from olmax.interop import InteropError
from olmax.interop.cli import add_commands
from olmax.interop.hf import hf_to_olmax, olmax_to_hf
from olmax.interop.parity import run_parity
from olmax.model import families
from olmax.model.weights import load_olmax
from olmax.train.trainer import train
from test_interop import randomize_norms, read_tensors


def make_qwen3_model(directory, *, tied=False, vocab=300, hidden=64, heads=4, kv_heads=2, head_dim=32, mlp=96,
                     layers=3, theta=1000000.0, seed=0, scale=1.0):
    """A random Qwen3ForCausalLM saved with save_pretrained; norms random too (a misplaced or whole-projection
    QK-norm shows); every weight times `scale`."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        initializer_range=0.1, eos_token_id=0, pad_token_id=1, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    randomize_norms(Qwen3ForCausalLM(config), scale).save_pretrained(directory)
    return directory


def _parser():
    parser = argparse.ArgumentParser(prog="olmax")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("tied", [False, True])
def test_config_and_tensors_are_read_as_qwen3(tmp_path, tied):
    hf_dir = make_qwen3_model(tmp_path / "hf", tied=tied)
    m = hf_to_olmax(hf_dir, tmp_path / "olmax").model
    family = families.of(m)
    assert (m.family, family.NORM_PLACEMENT, family.QK_NORM, m.tie_embeddings) == ("qwen3", "pre", "head", tied)
    assert (m.layer_pattern, m.head_size, m.kv_heads, m.rope["global"].theta) == (["global"], 32, 2, 1000000.0)
    _, params, _ = load_olmax(tmp_path / "olmax")
    tensors = read_tensors(hf_dir)
    blocks = params["blocks"]
    assert blocks["q_norm"].shape == blocks["k_norm"].shape == (3, 32)  # one head's width, not the projection's
    np.testing.assert_array_equal(blocks["q_norm"][1], tensors["model.layers.1.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(blocks["k_norm"][2], tensors["model.layers.2.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(blocks["attn_norm"][0], tensors["model.layers.0.input_layernorm.weight"])
    np.testing.assert_array_equal(blocks["mlp_norm"][0], tensors["model.layers.0.post_attention_layernorm.weight"])
    assert ("lm_head" in params) != tied and ("lm_head.weight" in tensors) != tied


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, tied):
    hf_dir = make_qwen3_model(tmp_path / "hf", tied=tied)
    args = _parser().parse_args(["convert", "hf-to-olmax", str(hf_dir), "--out", str(tmp_path / "olmax")])
    args.func(args)
    args = _parser().parse_args(["convert", "olmax-to-hf", str(tmp_path / "olmax"), "--out", str(tmp_path / "back")])
    args.func(args)
    original, back = read_tensors(hf_dir), read_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert np.array_equal(back[name], tensor), name
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.tie_word_embeddings == tied
    for name, tensor in Qwen3ForCausalLM.from_pretrained(hf_dir).state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("spec", [
    dict(tied=False, heads=4, kv_heads=2, head_dim=32, scale=2.0),  # GQA, head_dim != hidden / heads, peaked
    dict(tied=True, heads=4, kv_heads=1, head_dim=16, layers=4),  # MQA, head_dim == hidden / heads, tied
])
def test_float32_parity_with_hf_judged_against_its_float64_logits(tmp_path, spec):
    hf_dir = make_qwen3_model(tmp_path / "hf", **spec)
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    report = run_parity(tmp_path / "olmax", hf_dir=hf_dir, seq_len=40, batches=2, batch_size=2)
    result = report["comparisons"]["hf"]
    assert result["kl_mean"] <= 1e-9 and result["top1_agreement"] == 1.0, result
    assert result["max_abs_logit_delta_float64"] <= 3.0 * result["reference_float32_error"], result
    assert report["passed"] and result["tokens"] == 160


def test_parity_fails_on_a_whole_projection_qk_norm(tmp_path):
    """The per-head gains spread over the projection (what OLMo's QK-norm would compute with them): refused by
    the comparison, so the parity test above can fail."""
    hf_dir = make_qwen3_model(tmp_path / "hf")
    cfg = hf_to_olmax(hf_dir, tmp_path / "olmax")
    _, params, _ = load_olmax(tmp_path / "olmax")
    params["blocks"]["q_norm"][0] = params["blocks"]["q_norm"][0][::-1]  # one layer's gains reversed
    Checkpointer(tmp_path / "off", CheckpointConfig()).save_params(0, params, run_meta(cfg, 0, {}))
    assert run_parity(tmp_path / "off", hf_dir=hf_dir, seq_len=24)["comparisons"]["hf"]["failed"]
    with pytest.raises(InteropError, match="olmo-core reference builds dense OLMo 3"):
        run_parity(tmp_path / "olmax", olmo_core=True)


def test_tiny_qwen3_trains_and_its_checkpoint_is_what_transformers_computes(tmp_path, synth_mix):
    cfg = load_config("tiny_qwen3", [f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run",
                                     "mesh.fsdp=1", "train.steps=30", "checkpoint.every=30"])
    history = train(cfg, quiet=True)
    losses = [h["train/CE loss"] for h in history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    olmax_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"]) == (["Qwen3ForCausalLM"], True)
    report = run_parity(tmp_path / "run" / "checkpoints", hf_dir=tmp_path / "hf", seq_len=32, batches=1,
                        batch_size=2)
    assert report["passed"], report


@pytest.mark.parametrize("overrides, message", [
    (["model.layer_pattern=[sliding,global]"], "family qwen3 .* global attention in every layer"),
    (["model.mlp=moe", "model.moe.top_k=2"], "family qwen3 .* dense MLP"),
    (["model.family=olmo3"], "family olmo3 .* tie_embeddings false"),
    (["model.family=llama"], r"family 'llama' is not a model family; families: \['olmo3', 'olmoe', 'qwen3'\]"),
])
def test_bad_qwen3_configs_are_named_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_qwen3", overrides)


def test_hf_configs_olmax_cannot_read_as_qwen3_are_named(tmp_path):
    config = json.loads((make_qwen3_model(tmp_path / "hf") / "config.json").read_text())
    for change, message in (({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
                            ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling"),
                            ({"attention_bias": True}, "attention_bias")):
        with pytest.raises(InteropError, match=message):
            families.from_hf(config | change, name="x")


def _damaged_tensor(directory, name, value):
    tensors = read_tensors(directory)
    tensors[name][3 % len(tensors[name])] = value
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


# An HF directory that cannot be converted: what is done to it, and the words of the one line that says so
BAD_HF = {
    "a NaN weight": (lambda d: _damaged_tensor(d, "model.layers.1.mlp.up_proj.weight", np.nan),
                     "tensor model.layers.1.mlp.up_proj.weight holds nan (at [3, 0])"),
    "an infinite weight": (lambda d: _damaged_tensor(d, "model.norm.weight", -np.inf),
                           "tensor model.norm.weight holds -inf (at [3])"),
    "a billion layers": (lambda d: _config(d, num_hidden_layers=10**9),
                         "config.json implies 11,000,000,003 tensors (Qwen3ForCausalLM: 1,000,000,000 layers), more "
                         "than twice the 25 the safetensors files hold"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2, 3]"),
                           "config.json holds list, not the object of settings"),
    "no attention heads": (lambda d: _config(d, num_attention_heads=0), "num_attention_heads is 0; it is a size"),
    "a vocabulary size in quotes": (lambda d: _config(d, vocab_size="512"), "vocab_size is '512'; it is a size"),
}


def _config(directory, **change):
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_qwen3_model(tmp_path_factory.mktemp("qwen3") / "hf", layers=2)


@pytest.mark.parametrize("damage", BAD_HF)
def test_an_hf_model_that_cannot_be_converted_is_one_line_exit_2(tmp_path, qwen3_dir, capsys, damage):
    """Refused before anything is written, naming the field or the tensor (NaN weights were converted with exit 0,
    a billion layers grew the process to 19 GB before the kernel killed something, the rest were tracebacks)."""
    from olmax.cli import main

    edit, words = BAD_HF[damage]
    shutil.copytree(qwen3_dir, tmp_path / "hf")
    edit(tmp_path / "hf")
    assert main(["convert", "hf-to-olmax", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("olmax: InteropError: ") and words in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
