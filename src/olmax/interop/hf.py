"""HF transformers `Olmo3ForCausalLM` / `OlmoeForCausalLM` <-> olmax: configs, tensor names, streaming
conversion. The HF `model_type` is the olmax model family (olmo3, olmoe); tensor names and layouts come
from the family's parameter table (OLMoE's experts: one tensor per expert, as on the Hub).

Needs neither torch nor transformers: config.json is read as JSON and tensors
as safetensors (never pickle, never remote code). Both directions stream a slab
at a time (`olmax.interop.stream`) between the files and one copy of the olmax
parameters, and Orbax writes that copy one array at a time, so the peak is about
one copy of the model plus its largest array.

Layout: olmax stores matrices as [in, out] stacked over layers ([L, in, out]);
HF stores torch Linear weights [out, in] per layer. The embedding and LM head
carry the vocab padded to `vocab_pad_multiple`; HF has the real vocab only.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from olmax.checkpoint import Checkpointer, read_params, run_meta
from olmax.config import CheckpointConfig, ConfigError, ModelConfig, RunConfig, validate, writable_dir
from olmax.interop import InteropError, stream
from olmax.model import families

ARCHITECTURES = {"olmo3": "Olmo3ForCausalLM", "olmoe": "OlmoeForCausalLM"}  # model_type (= family) -> class
LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "global"}
HF_LAYER_TYPES = {kind: name for name, kind in LAYER_KINDS.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}  # safetensors dtype codes the import accepts
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}



# --- configs ---------------------------------------------------------------------------------------


def read_hf_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise InteropError(f"{src} is not an HF model directory: {path.name} is missing")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"{path} is not valid JSON: {err}") from None
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES or architectures not in ([], [ARCHITECTURES[model_type]]):
        known = ", ".join(f"{cls} (model_type {t!r})" for t, cls in ARCHITECTURES.items())
        raise InteropError(f"{path}: unsupported architecture (model_type {model_type!r}, architectures "
                           f"{architectures}); olmax converts {known}")
    return config


ROPE_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "truncate"}


def _rope(hf: dict, where: str) -> dict:
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


def _token_id(hf: dict, field: str, vocab_size: int, where: str) -> int | None:
    value = hf.get(field)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and not 0 <= value < vocab_size:
        raise InteropError(f"{where}: {field} {value} is outside the vocabulary (vocab_size {vocab_size})")
    return value


def _olmoe_model(hf: dict, where: str) -> dict:
    """olmax model fields of an HF OLMoE config beyond the shared ones: MoE in every layer, global attention,
    one unscaled RoPE (`OlmoeConfig`'s defaults where config.json omits a field)."""
    if hf.get("clip_qkv") is not None:
        raise InteropError(f"{where}: clip_qkv {hf['clip_qkv']} is not implemented (olmax does not clip q, k, v)")
    rope = dict(hf.get("rope_parameters") or {}) | (hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise InteropError(f"{where}: RoPE scaling {rope} is not implemented for OLMoE (olmax reads default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {
        "family": "olmoe", "mlp": "moe", "layer_pattern": ["global"], "rope": {"global": {"theta": float(theta)}},
        "moe": {"num_experts": hf.get("num_experts", 64), "top_k": hf.get("num_experts_per_tok", 8),
                "expert_hidden": hf["intermediate_size"], "normalize_gates": hf.get("norm_topk_prob", False),
                "load_balancing_loss": hf.get("router_aux_loss_coef", 0.01)},
    }


def _olmo3_model(hf: dict, where: str) -> dict:
    pattern = _layer_pattern(hf, hf["num_hidden_layers"], where)
    window = hf.get("sliding_window")
    if "sliding" in pattern and not window:
        raise InteropError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    return {"mlp_hidden": hf["intermediate_size"], "rope": _rope(hf, where), "layer_pattern": pattern} | (
        {"sliding_window": window} if window else {})


def run_config_from_hf(hf: dict, name: str, where: str = "config.json") -> RunConfig:
    """The olmax run config of an HF Olmo3 / OLMoE config: the model derived from it, the rest the 7B recipe."""
    unsupported = {
        "attention_bias": (hf.get("attention_bias", False), False),
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", False), False),
    }
    if bad := {k: got for k, (got, want) in unsupported.items() if got != want}:
        raise InteropError(f"{where}: unsupported settings {bad} (OLMo 3 and OLMoE: no biases, SiLU MLP, "
                           "untied LM head)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise InteropError(f"{where}: missing fields {missing}")
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
    }
    model |= (_olmoe_model if hf.get("model_type") == "olmoe" else _olmo3_model)(hf, where)
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
    """Refuse a model its family's transformers class cannot express (it would load, and compute another function)."""
    if m.family == "olmo3" and m.mlp != "dense":
        raise InteropError("model.mlp moe with family olmo3 has no transformers class (Olmo3ForCausalLM is dense); "
                           "HF interop of a mixture of experts is OlmoeForCausalLM, model.family olmoe")
    if m.family == "olmoe":
        e = m.moe
        bad = {"moe.gating": e.gating != "softmax", "moe.shared_expert_hidden": e.shared_expert_hidden is not None,
               "moe.bias_update_rate": e.bias_update_rate is not None, "moe.capacity_factor": e.capacity_factor
               is not None, "moe.routing": e.routing != "learned", "rope": m.rope["global"].type != "default"}
        if fields := [k for k, b in bad.items() if b]:
            raise InteropError(f"OlmoeForCausalLM has a softmax router, dropless learned top-k routing, no shared "
                               f"expert or selection bias, and unscaled RoPE; this model sets model.{fields}")


def _hf_olmoe(cfg: RunConfig) -> dict:
    m = cfg.model
    theta = m.rope["global"].theta
    return {"intermediate_size": m.moe.expert_hidden, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "clip_qkv": None,
            "num_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.top_k,
            "norm_topk_prob": m.moe.normalize_gates, "router_aux_loss_coef": m.moe.load_balancing_loss,
            "output_router_logits": False}


def _hf_olmo3(cfg: RunConfig) -> dict:
    """RoPE as `rope_parameters` per layer type (transformers 5), and as `rope_theta` too when both kinds share
    an unscaled theta (transformers 4 reads that)."""
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


def hf_config_from_run(cfg: RunConfig, dtype: str = "float32") -> dict:
    """config.json for the family's transformers class (Olmo3ForCausalLM, OlmoeForCausalLM)."""
    m = cfg.model
    check_exportable(m)
    return {
        "architectures": [ARCHITECTURES[m.family]],
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
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": cfg.data.eos_id,
        "pad_token_id": cfg.data.pad_id,
        "use_cache": True,
        "dtype": dtype,
    } | (_hf_olmoe if m.family == "olmoe" else _hf_olmo3)(cfg)


# --- tensors ---------------------------------------------------------------------------------------


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def hf_tensor_files(src: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single file or a sharded checkpoint with an index."""
    src = Path(src)
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InteropError(f"{index}: no weight_map")
        files = {name: src / file for name, file in weight_map.items()}
        if missing := sorted({str(f.name) for f in files.values() if not f.is_file()}):
            raise InteropError(f"{index} names shard files that do not exist: {missing}")
        return files
    if (src / SINGLE_FILE).is_file():
        return dict.fromkeys(stream.read_header(src / SINGLE_FILE)[0], src / SINGLE_FILE)
    others = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt*"))
    hint = f" (found {others}: olmax reads safetensors only, never pickle)" if others else ""
    raise InteropError(f"{src}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _tensor_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype), from the file headers only; the index must match the files."""
    found, where = {}, {}
    for path in sorted(set(files.values())):
        for name, entry in stream.read_header(path)[0].items():
            found[name] = (tuple(entry["shape"]), entry["dtype"])
            where[name] = path
    listed_elsewhere = sorted(n for n in found if n in files and files[n] != where[n])
    not_listed = sorted(n for n in found if n not in files)
    absent = sorted(n for n in files if n not in found)
    if listed_elsewhere or not_listed or absent:
        lines = [f"the index {INDEX_FILE} disagrees with the shard files:"]
        lines += _listing("in no shard its index names", absent)
        lines += _listing("in a shard other than the index says", listed_elsewhere)
        lines += _listing("in a shard but not in the index", not_listed)
        raise InteropError("\n".join(lines))
    return found


def _listing(title: str, items: list[str], limit: int = 24) -> list[str]:
    if not items:
        return []
    items = sorted(items, key=_natural_key)
    shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
    return [f"  {title} ({len(items)}): {shown}"]


def check_hf_tensors(found: dict, src: Path, m: ModelConfig) -> None:
    """Every tensor the config implies, nothing else, each with the implied shape and a float dtype."""
    specs = {name: p.foreign_shape(m, index) for name, (p, index) in families.foreign_tensors(m).items()}
    missing = [n for n in specs if n not in found]
    extra = [n for n in found if n not in specs]
    mismatched = [f"{n} is {list(found[n][0])}, config implies {list(shape)}"
                  for n, shape in specs.items() if n in found and found[n][0] != shape]
    not_float = [f"{n} ({found[n][1]})" for n in specs if n in found and found[n][1] not in FLOAT_DTYPES]
    if missing or extra or mismatched or not_float:
        mlp = f"MLP {m.mlp_hidden}" if m.mlp == "dense" else f"{m.moe.num_experts} experts of {m.moe.expert_hidden}"
        lines = [f"{src}: the tensors do not match config.json ({ARCHITECTURES[m.family]}: {m.n_layers} layers, "
                 f"hidden {m.d_model}, {m.n_heads} heads / {m.kv_heads} KV heads of {m.head_size}, {mlp}, "
                 f"vocab {m.vocab_size})"]
        lines += _listing("missing tensors", missing)
        lines += _listing("unexpected tensors", extra)
        lines += _listing("shape mismatches", mismatched)
        lines += _listing("not floating point", not_float)
        raise InteropError("\n".join(lines))


def load_hf_params(src: Path, cfg: RunConfig) -> dict:
    """olmax float32 params (numpy) from the safetensors files, one slab of a tensor in flight at a time."""
    m = cfg.model
    tensors = families.foreign_tensors(m)
    files = hf_tensor_files(src)
    check_hf_tensors(_tensor_headers(files), src, m)
    params = jax.tree.map(lambda shape: np.zeros(shape, np.float32), families.param_shapes(m),
                          is_leaf=lambda s: isinstance(s, tuple))
    for path in sorted(set(files.values())):
        header, start = stream.read_header(path)
        with open(path, "rb") as f:
            for name, entry in header.items():
                stream.read_into(f, start, entry, families.foreign_view(params, *tensors[name], m))
    return params


# --- conversions -----------------------------------------------------------------------------------


def hf_to_olmax(src: str | Path, out: str | Path) -> RunConfig:
    """Convert an HF Olmo3 / OLMoE directory into a weights-only olmax checkpoint at OUT (step 0: OUT/0/)."""
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose a new output directory")
    writable_dir(out, "output directory")
    cfg = run_config_from_hf(read_hf_config(src), name=src.absolute().name, where=str(src / "config.json"))
    params = load_hf_params(src, cfg)
    meta = run_meta(cfg, 0, {})
    meta["converted_from"] = {"format": "hf", "architecture": ARCHITECTURES[cfg.model.family],
                              "path": str(src.absolute())}
    checkpointer = Checkpointer(out, CheckpointConfig())
    try:
        checkpointer.save_params(0, params, meta)
    finally:
        checkpointer.close()
    return cfg


def load_olmax(ckpt: str | Path, step: int | None = None) -> tuple[RunConfig, dict, int]:
    """(config, params as numpy arrays, step) of an olmax checkpoint (a run directory, its checkpoints/ or one
    step of it), training or weights-only."""
    def host_arrays(cfg: RunConfig) -> dict:
        return jax.tree.map(lambda shape: np.empty(shape, cfg.model.param_dtype), families.param_shapes(cfg.model),
                            is_leaf=lambda s: isinstance(s, tuple))
    return read_params(ckpt, host_arrays, step)


def _plan_shards(cfg: RunConfig, itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name, (p, index) in families.foreign_tensors(cfg.model).items():
        nbytes = math.prod(p.foreign_shape(cfg.model, index)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf(cfg: RunConfig, params: dict, out: str | Path, dtype: str = "float32",
             max_shard_bytes: int = 5 * 2**30, tokenizer: str | Path | None = None) -> Path:
    """safetensors (one file, or shards + index) and config.json for the family's transformers class
    (`Olmo3ForCausalLM` / `OlmoeForCausalLM`.from_pretrained), and a copy of `tokenizer` (a tokenizer.json)."""
    out = Path(out)
    check_exportable(cfg.model)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise InteropError(f"tokenizer {tokenizer} is not a file; give the run's tokenizer.json")
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose a new output directory")
    if dtype not in EXPORT_DTYPES:
        raise InteropError(f"export dtype {dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    np_dtype = np.dtype(EXPORT_DTYPES[dtype])
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        _write_hf_files(cfg, params, partial, dtype, np_dtype, max_shard_bytes)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / "tokenizer.json")
        os.replace(partial, out)  # the directory appears complete or not at all
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write_hf_files(cfg: RunConfig, params: dict, out: Path, dtype: str, np_dtype, max_shard_bytes: int) -> None:
    m = cfg.model
    tensors = families.foreign_tensors(m)
    shards = _plan_shards(cfg, np_dtype.itemsize, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        views = {name: families.foreign_view(params, *tensors[name], m) for name in shard}
        stream.write_file(out / file, views, np_dtype, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        total = sum(math.prod(p.foreign_shape(m, index)) for p, index in tensors.values()) * np_dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config_from_run(cfg, dtype), indent=2) + "\n")


def olmax_to_hf(ckpt: str | Path, out: str | Path, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30, tokenizer: str | Path | None = None) -> tuple[RunConfig, int]:
    """Export the latest step of an olmax checkpoint as an HF Olmo3 / OLMoE directory (with a copy of
    `tokenizer`); (config, step)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose a new output directory")
    writable_dir(out, "output directory")
    cfg, params, step = load_olmax(ckpt)
    write_hf(cfg, params, out, dtype, max_shard_bytes, tokenizer)
    return cfg, step
