"""HF <-> olmax conversion: configs, streaming import, export, round trips, and bad input."""

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import Olmo3Config, Olmo3ForCausalLM

from olmax.checkpoint import CheckpointError, Checkpointer, check_model_compatible, run_meta
from olmax.config import CheckpointConfig, load_config
from olmax.interop import InteropError
from olmax.interop.cli import add_commands
from olmax.interop.hf import hf_to_olmax, olmax_to_hf, read_hf_config
from olmax.model.weights import load_olmax
from olmax.model import families
from olmax.parallel.mesh import make_layout
from olmax.train.step import TrainState


def randomize_norms(model, scale: float):
    """Norm gains drawn from [0.5, 1.5] (an initialized model has ones, which would hide a misplaced norm),
    then every weight times `scale` (larger: a more peaked model)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            p.mul_(scale)
    return model


def make_hf_model(directory, *, layer_types=("sliding_attention",) * 3 + ("full_attention",), vocab=300,
                  hidden=64, heads=4, kv_heads=2, head_dim=None, mlp=96, window=8, theta=10000.0, seed=0,
                  dtype=torch.float32, max_shard_size=None, full_rope=None, max_position=2048, scale=1.0):
    """A random Olmo3ForCausalLM saved with save_pretrained; norms random too, so a swapped norm shows.
    `full_rope` replaces the full-attention layers' RoPE entry; `scale` multiplies every weight (peaked
    predictions)."""
    torch.manual_seed(seed)
    extra = {"head_dim": head_dim} if head_dim else {}
    rope = {t: {"rope_type": "default", "rope_theta": theta} for t in ("full_attention", "sliding_attention")}
    if full_rope:
        rope["full_attention"] = full_rope
    config = Olmo3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, layer_types=list(layer_types),
        sliding_window=window, rms_norm_eps=1e-6, initializer_range=0.1, eos_token_id=0, pad_token_id=1,
        rope_parameters=rope, max_position_embeddings=max_position, **extra,
    )
    model = randomize_norms(Olmo3ForCausalLM(config), scale).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def read_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf") / "tiny")


def test_config_is_derived_from_hf(hf_dir):
    cfg = families.from_hf(read_hf_config(hf_dir), name="tiny")
    m = cfg.model
    assert (m.vocab_size, m.padded_vocab, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.head_size) == (
        300, 384, 64, 4, 4, 2, 16)
    assert (m.mlp_hidden, m.norm_eps, m.sliding_window) == (96, 1e-6, 8)
    assert {kind: (r.type, r.theta) for kind, r in m.rope.items()} == {"sliding": ("default", 1e4),
                                                                       "global": ("default", 1e4)}
    assert m.layer_pattern == ["sliding", "sliding", "sliding", "global"]
    assert (cfg.data.eos_id, cfg.data.pad_id, cfg.data.token_dtype) == (0, 1, "uint16")
    back = families.to_hf(cfg)
    assert Olmo3Config(**back).to_dict()["layer_types"] == read_hf_config(hf_dir)["layer_types"]


@pytest.mark.parametrize("preset", ["olmo3_7b", "olmo3_32b", "olmo3_1b", "tiny"])
def test_preset_models_survive_hf_config_round_trip(preset):
    """olmax -> config.json -> olmax gives the preset's own model config, so a converted checkpoint
    passes the model check of a run using that preset (init_from)."""
    cfg = load_config(preset)
    hf = families.to_hf(cfg)
    resolved = Olmo3Config(**hf).rope_parameters
    assert resolved["sliding_attention"]["rope_theta"] == cfg.model.rope["sliding"].theta
    assert resolved["full_attention"]["rope_theta"] == cfg.model.rope["global"].theta
    back = families.from_hf(hf, name=preset)
    check_model_compatible(back.model_dump(mode="json"), cfg.model, "converted")
    assert (back.data.eos_id, back.data.pad_id) == (cfg.data.eos_id, cfg.data.pad_id)


@pytest.mark.parametrize("layer_types, pattern", [
    (["full_attention"] * 4, ["global"]),
    (["sliding_attention", "full_attention"] * 3, ["sliding", "global"]),
    (["full_attention", "sliding_attention", "sliding_attention"] * 2, ["global", "sliding", "sliding"]),
    (["sliding_attention"] * 4 + ["full_attention"], ["sliding"] * 4 + ["global"]),  # no shorter period: unrolled
])
def test_layer_pattern_is_the_shortest_period(layer_types, pattern):
    hf = {"model_type": "olmo3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": len(layer_types), "num_attention_heads": 4, "layer_types": layer_types,
          "sliding_window": 8, "eos_token_id": 0}
    assert families.from_hf(hf, name="x").model.layer_pattern == pattern


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}


def _resolved(hf: dict) -> dict:
    """transformers' own reading of a config.json's RoPE, per layer type (the keys olmax models)."""
    keys = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor")
    return {t: {k: p.get(k) for k in keys} for t, p in Olmo3Config(**hf).rope_parameters.items()}


def _olmax_rope(cfg) -> dict:
    return {kind: (r.type, r.theta, r.factor, r.original_max_position_embeddings) for kind, r in cfg.model.rope.items()}


@pytest.mark.parametrize("rope_fields", [
    {"rope_parameters": {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # old-style rope_scaling beside rope_parameters: transformers merges it into full attention's entry
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}},
    # a top-level rope_theta reaches full attention only; sliding layers keep 500000
    {"rope_theta": 1e4, "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}},
])
def test_rope_per_layer_kind_is_read_as_transformers_reads_it(hf_dir, rope_fields):
    hf = {k: v for k, v in read_hf_config(hf_dir).items() if k not in ("rope_parameters", "rope_scaling")}
    hf |= rope_fields
    cfg = families.from_hf(hf, name="x")
    want = _resolved(hf)
    got = _olmax_rope(cfg)
    for name, kind in (("full_attention", "global"), ("sliding_attention", "sliding")):
        w = want[name]
        assert got[kind] == (w["rope_type"], w["rope_theta"], w["factor"], w["original_max_position_embeddings"])
    assert got["global"][0] == "yarn"
    back = families.to_hf(cfg)
    assert _resolved(back) == want, "export writes rope_parameters back as they were read"
    assert "rope_theta" not in back  # the two kinds differ: only rope_parameters says it right


def test_legacy_rope_fields_and_default_layer_types():
    """transformers 4.x configs (OLMo 3 on the Hub): rope_theta + rope_scaling, layer_types may be absent."""
    hf = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "vocab_size": 100278, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4, "rope_theta": 500000,
          "rope_scaling": None, "sliding_window": 4096, "eos_token_id": 100257, "pad_token_id": 100277}
    cfg = families.from_hf(hf, name="x")
    assert cfg.model.rope["global"].theta == cfg.model.rope["sliding"].theta == 5e5
    assert cfg.model.padded_vocab == 100352
    assert cfg.model.layer_pattern == ["sliding", "sliding", "sliding", "global"]
    assert cfg.data.token_dtype == "uint32"


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
    ({"architectures": ["Olmo3ForSequenceClassification"]}, "unsupported architecture"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ({"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "'llama3' is not implemented"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 0.7,
                                             "original_max_position_embeddings": 64},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "['mscale']"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0}}, "not layer types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"eos_token_id": 5000}, "eos_token_id 5000"),
    ({"num_attention_heads": 3}, "n_heads"),
])
def test_bad_configs_are_named(hf_dir, tmp_path, change, message):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match=message):
        hf_to_olmax(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite_weights(src, edit):
    tensors = read_tensors(src)
    for path in src.glob("*.safetensors"):
        path.unlink()
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, listed", [
    (lambda t: t.pop("model.layers.2.mlp.up_proj.weight"), ["missing tensors (1)", "model.layers.2.mlp.up_proj"]),
    (lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}),
     ["unexpected tensors (1)", "rotary_emb.inv_freq"]),
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.ones((64, 64), np.float32)}),
     ["shape mismatches (1)", "model.layers.1.self_attn.k_proj.weight is [64, 64], config implies [32, 64]"]),
    (lambda t: t.update({"model.embed_tokens.weight": np.ones((300, 64), np.int32)}), ["not floating point"]),
])
def test_bad_tensors_are_listed(hf_dir, tmp_path, edit, listed):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    _rewrite_weights(src, edit)
    with pytest.raises(InteropError) as err:
        hf_to_olmax(src, tmp_path / "out")
    for text in listed:
        assert text in str(err.value)


def test_config_that_disagrees_with_the_weights(hf_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=config["layer_types"][:2], vocab_size=256)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError) as err:
        hf_to_olmax(src, tmp_path / "out")
    text = str(err.value)
    assert "unexpected tensors (22)" in text and "model.layers.2.mlp.down_proj.weight" in text
    assert "model.embed_tokens.weight is [300, 64], config implies [256, 64]" in text
    assert "lm_head.weight is [300, 64], config implies [256, 64]" in text


def test_index_that_disagrees_with_shards_and_pickle_only(tmp_path):
    src = make_hf_model(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = index["weight_map"]["lm_head.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InteropError, match="in no shard its index names \\(1\\): model.layers.9.mlp.up_proj"):
        hf_to_olmax(src, tmp_path / "out")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(src / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(InteropError, match="safetensors only, never pickle"):
        hf_to_olmax(pickled, tmp_path / "out")


@pytest.mark.parametrize("dtype, export, shard", [
    (torch.float32, "float32", None), (torch.float32, "float32", "100KB"), (torch.bfloat16, "bfloat16", "50KB")])
def test_round_trip_is_bit_identical(tmp_path, dtype, export, shard):
    src = make_hf_model(tmp_path / "src", dtype=dtype, max_shard_size=shard, head_dim=32, kv_heads=1)
    hf_to_olmax(src, tmp_path / "olmax")
    assert (tmp_path / "olmax" / "0").is_dir()
    max_shard = 60_000 if shard else 5 * 2**30
    olmax_to_hf(tmp_path / "olmax", tmp_path / "back", dtype=export, max_shard_bytes=max_shard)
    original, back = read_tensors(src), read_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert np.array_equal(back[name].view(np.uint8), tensor.view(np.uint8)), name
    assert (tmp_path / "back" / "model.safetensors.index.json").exists() == bool(shard)
    reloaded = Olmo3ForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.head_dim == 32 and reloaded.config.num_key_value_heads == 1
    assert reloaded.dtype == dtype
    for name, tensor in Olmo3ForCausalLM.from_pretrained(src).state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_import_pads_the_vocab_with_zeros_and_records_the_source(hf_dir, tmp_path):
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    cfg, params, step = load_olmax(tmp_path / "olmax")
    assert step == 0 and params["embed"].shape == (384, 64) and params["lm_head"].shape == (64, 384)
    assert not params["embed"][300:].any() and not params["lm_head"][:, 300:].any()
    tensors = read_tensors(hf_dir)
    np.testing.assert_array_equal(params["blocks"]["q_proj"][2], tensors["model.layers.2.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(params["blocks"]["mlp_norm"][3],
                                  tensors["model.layers.3.post_feedforward_layernorm.weight"])
    meta = Checkpointer(tmp_path / "olmax", CheckpointConfig()).read_meta(0)
    assert meta["step"] == 0 and meta["converted_from"]["format"] == "hf"
    assert meta["config"]["model"]["vocab_size"] == 300
    with pytest.raises(InteropError, match="not empty"):
        hf_to_olmax(hf_dir, tmp_path / "olmax")


def test_cli_converts_both_ways(hf_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="olmax")
    add_commands(parser.add_subparsers(dest="command", required=True))
    from olmax.data.tokenize import train_tokenizer

    (tmp_path / "text.txt").write_text("the run's own tokenizer goes with its weights " * 20)
    tokenizer = train_tokenizer([str(tmp_path / "text.txt")], tmp_path / "tokenizer.json", vocab_size=280,
                                progress=False)
    for argv in (["convert", "hf-to-olmax", str(hf_dir), str(tmp_path / "olmax")],
                 ["convert", "olmax-to-hf", str(tmp_path / "olmax"), str(tmp_path / "hf"), "--dtype", "bfloat16",
                  "--tokenizer", str(tokenizer)]):
        args = parser.parse_args(argv)
        assert args.func(args) is None
    assert "vocab 300 padded to 384" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == Path(tokenizer).read_bytes()
    back = read_tensors(tmp_path / "hf")
    assert back["lm_head.weight"].dtype == ml_dtypes.bfloat16 and back["lm_head.weight"].shape == (300, 64)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(CheckpointError, match="holds no olmax checkpoint"):
        olmax_to_hf(tmp_path / "hf", tmp_path / "again")


def test_export_of_a_sharded_training_checkpoint(hf_dir, tmp_path):
    """A training checkpoint (params and optimizer state, sharded over 8 devices) exports its latest step."""
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    cfg, params, _ = load_olmax(tmp_path / "olmax")
    layout = make_layout(cfg.mesh)
    assert layout.mesh.shape["fsdp"] == 8
    sharded = jax.device_put(params, layout.shardings(families.param_axes(cfg.model), params))
    assert len(sharded["embed"].sharding.device_set) == 8
    state = TrainState(jnp.int32(7), sharded, {"mu": jax.tree.map(jnp.zeros_like, sharded)})
    checkpointer = Checkpointer(tmp_path / "run", CheckpointConfig())
    for step in (3, 7):
        checkpointer.save(step, state, run_meta(cfg, step, {}))
    checkpointer.close()
    _, step = olmax_to_hf(tmp_path / "run", tmp_path / "hf")
    assert step == 7
    original, back = read_tensors(hf_dir), read_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert np.array_equal(back[name], tensor), name


def test_conversion_in_small_slabs_is_bit_identical(hf_dir, tmp_path, monkeypatch):
    """Streaming a slab of rows at a time (here 1 KB, so every matrix takes many slabs, transposed or not)
    gives the same tensors as reading each whole tensor with safetensors."""
    from olmax.interop import stream
    monkeypatch.setattr(stream, "SLAB_BYTES", 1024)
    hf_to_olmax(hf_dir, tmp_path / "olmax")
    olmax_to_hf(tmp_path / "olmax", tmp_path / "back")
    original, back = read_tensors(hf_dir), read_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert np.array_equal(back[name], tensor), name


def _with_header(data: bytes, edit) -> bytes:
    """The safetensors file `data` with its JSON header edited (and its length prefix rewritten)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data[8 + length:]


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-100], "truncated or corrupt"),
    (lambda data: b"\xff" * 8 + data[8:], "not a safetensors file"),
    (lambda data: data[:8] + b"\x00" + data[9:], "header is not JSON"),
    (lambda data: _with_header(data, lambda h: h["lm_head.weight"].update(dtype="F8_E4M3")),
     "dtype 'F8_E4M3', which olmax does not read"),
])
def test_damaged_safetensors_are_named(hf_dir, tmp_path, damage, message):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    weights = src / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(InteropError, match=message) as err:
        hf_to_olmax(src, tmp_path / "out")
    assert "model.safetensors" in str(err.value) and not (tmp_path / "out").exists()
