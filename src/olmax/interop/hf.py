"""HF transformers `Olmo3ForCausalLM` <-> olmax: configs, tensor names, streaming conversion.

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
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from olmax.checkpoint import Checkpointer, read_params, run_meta
from olmax.config import CheckpointConfig, ConfigError, ModelConfig, RunConfig, validate
from olmax.interop import InteropError, stream
from olmax.model import olmo3

ARCHITECTURE = "Olmo3ForCausalLM"
MODEL_TYPE = "olmo3"
LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "global"}
HF_LAYER_TYPES = {kind: name for name, kind in LAYER_KINDS.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}  # safetensors dtype codes the import accepts
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# olmax block parameter -> HF tensor name; all but the norms are Linear weights stored transposed.
BLOCK_TENSORS = {
    "q_proj": "model.layers.{}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{}.self_attn.k_norm.weight",
    "attn_norm": "model.layers.{}.post_attention_layernorm.weight",
    "w1": "model.layers.{}.mlp.gate_proj.weight",
    "w3": "model.layers.{}.mlp.up_proj.weight",
    "w2": "model.layers.{}.mlp.down_proj.weight",
    "mlp_norm": "model.layers.{}.post_feedforward_layernorm.weight",
}


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
    if config.get("model_type") != MODEL_TYPE or architectures not in ([], [ARCHITECTURE]):
        raise InteropError(
            f"{path}: unsupported architecture (model_type {config.get('model_type')!r}, "
            f"architectures {architectures}); olmax converts {ARCHITECTURE} (model_type {MODEL_TYPE!r}) only"
        )
    return config


def _rope_theta(hf: dict, where: str) -> float:
    """The one RoPE theta of the model; per-layer-type parameters must agree and be unscaled. A RoPE field olmax
    does not implement is refused wherever it is, never ignored (`rope_scaling` next to `rope_parameters`)."""
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" or set(scaling) - {"rope_type", "type"}:
        raise InteropError(f"{where}: rope_scaling {scaling} is not supported (olmax implements unscaled RoPE only)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise InteropError(f"{where}: partial_rotary_factor {hf['partial_rotary_factor']} is not supported "
                           "(olmax rotates every dimension of a head)")
    params = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 500000.0)}
    per_type = {k: v or {} for k, v in params.items() if k in LAYER_KINDS} or {"all layers": params}
    unsupported = {name: {k: v for k, v in p.items() if k not in ("rope_type", "rope_theta")}
                   | ({"rope_type": p["rope_type"]} if p.get("rope_type", "default") != "default" else {})
                   for name, p in per_type.items()}
    if bad := {name: fields for name, fields in unsupported.items() if fields}:
        raise InteropError(f"{where}: rope_parameters {bad} are not supported (olmax implements unscaled RoPE only)")
    thetas = {name: float(p.get("rope_theta", hf.get("rope_theta", 500000.0))) for name, p in per_type.items()}
    if len(set(thetas.values())) > 1:
        raise InteropError(f"{where}: rope_theta differs between layer types {thetas}; olmax has one rope_theta")
    return next(iter(thetas.values()))


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


def run_config_from_hf(hf: dict, name: str, where: str = "config.json") -> RunConfig:
    """The olmax run config of an HF Olmo3 config: the model derived from it, the rest the 7B recipe."""
    unsupported = {
        "attention_bias": (hf.get("attention_bias", False), False),
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", False), False),
    }
    if bad := {k: got for k, (got, want) in unsupported.items() if got != want}:
        raise InteropError(f"{where}: unsupported settings {bad} (OLMo 3: no biases, SiLU MLP, untied LM head)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise InteropError(f"{where}: missing fields {missing}")
    n_layers, n_heads, d_model = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim")
    pattern = _layer_pattern(hf, n_layers, where)
    window = hf.get("sliding_window")
    if "sliding" in pattern and not window:
        raise InteropError(f"{where}: layer_types has sliding layers but sliding_window is {window!r}")
    model = {
        "vocab_size": hf["vocab_size"],
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": None if hf.get("num_key_value_heads") in (None, n_heads) else hf["num_key_value_heads"],
        "head_dim": None if head_dim in (None, d_model // n_heads) else head_dim,
        "mlp_hidden": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "rope_theta": _rope_theta(hf, where),
        "layer_pattern": pattern,
        "init_std": hf.get("initializer_range", 0.02),
        "param_dtype": "float32",
    }
    if window:
        model["sliding_window"] = window
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


def hf_config_from_run(cfg: RunConfig, dtype: str = "float32") -> dict:
    """config.json for `Olmo3ForCausalLM`; RoPE spelled both ways (rope_theta for transformers 4.x,
    rope_parameters per layer type for 5.x), so every version reads the one theta."""
    m = cfg.model
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.mlp_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.data.sequence_length,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {name: dict(rope) for name in LAYER_KINDS},
        "sliding_window": m.sliding_window,
        "layer_types": [HF_LAYER_TYPES["global" if m.is_global(i) else "sliding"] for i in range(m.n_layers)],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": cfg.data.eos_id,
        "pad_token_id": cfg.data.pad_id,
        "use_cache": True,
        "dtype": dtype,
    }
    if m.head_dim is not None:
        config["head_dim"] = m.head_dim
    return config


# --- tensors ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where one HF tensor lives in the olmax params: `path` in the tree, `layer` on the stacked axis.

    Linear weights are transposed (olmax [in, out], torch [out, in]); the embedding and norms are not.
    """

    path: tuple[str, ...]
    layer: int | None
    hf_shape: tuple[int, ...]

    @property
    def transposed(self) -> bool:
        return len(self.hf_shape) == 2 and self.path != ("embed",)


def hf_tensor_specs(m: ModelConfig) -> dict[str, TensorSpec]:
    shapes = olmo3.param_shapes(m)
    specs = {
        "model.embed_tokens.weight": TensorSpec(("embed",), None, (m.vocab_size, m.d_model)),
        "model.norm.weight": TensorSpec(("final_norm",), None, (m.d_model,)),
        "lm_head.weight": TensorSpec(("lm_head",), None, (m.vocab_size, m.d_model)),
    }
    for key, template in BLOCK_TENSORS.items():
        per_layer = shapes["blocks"][key][1:]
        for layer in range(m.n_layers):
            specs[template.format(layer)] = TensorSpec(("blocks", key), layer, tuple(reversed(per_layer)))
    return specs


def _target(params: dict, spec: TensorSpec, m: ModelConfig) -> np.ndarray:
    """The view of the olmax array that holds this HF tensor, in olmax layout."""
    node = params
    for key in spec.path:
        node = node[key]
    if spec.path == ("embed",):
        return node[: m.vocab_size]
    if spec.path == ("lm_head",):
        return node[:, : m.vocab_size]
    return node if spec.layer is None else node[spec.layer]


def _swap(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """olmax layout <-> HF layout (a view)."""
    return array.T if spec.transposed else array


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


def check_hf_tensors(found: dict, specs: dict[str, TensorSpec], src: Path, m: ModelConfig) -> None:
    """Every tensor the config implies, nothing else, each with the implied shape and a float dtype."""
    missing = [n for n in specs if n not in found]
    extra = [n for n in found if n not in specs]
    mismatched = [f"{n} is {list(found[n][0])}, config implies {list(s.hf_shape)}"
                  for n, s in specs.items() if n in found and found[n][0] != s.hf_shape]
    not_float = [f"{n} ({found[n][1]})" for n in specs if n in found and found[n][1] not in FLOAT_DTYPES]
    if missing or extra or mismatched or not_float:
        lines = [f"{src}: the tensors do not match config.json ({ARCHITECTURE}: {m.n_layers} layers, hidden "
                 f"{m.d_model}, {m.n_heads} heads / {m.kv_heads} KV heads of {m.head_size}, MLP {m.mlp_hidden}, "
                 f"vocab {m.vocab_size})"]
        lines += _listing("missing tensors", missing)
        lines += _listing("unexpected tensors", extra)
        lines += _listing("shape mismatches", mismatched)
        lines += _listing("not floating point", not_float)
        raise InteropError("\n".join(lines))


def load_hf_params(src: Path, cfg: RunConfig) -> dict:
    """olmax float32 params (numpy) from the safetensors files, one slab of a tensor in flight at a time."""
    m = cfg.model
    specs = hf_tensor_specs(m)
    files = hf_tensor_files(src)
    check_hf_tensors(_tensor_headers(files), specs, src, m)
    params = jax.tree.map(lambda shape: np.zeros(shape, np.float32), olmo3.param_shapes(m),
                          is_leaf=lambda s: isinstance(s, tuple))
    for path in sorted(set(files.values())):
        header, start = stream.read_header(path)
        with open(path, "rb") as f:
            for name, entry in header.items():
                stream.read_into(f, start, entry, _swap(_target(params, specs[name], m), specs[name]))
    return params


# --- conversions -----------------------------------------------------------------------------------


def hf_to_olmax(src: str | Path, out: str | Path) -> RunConfig:
    """Convert an HF Olmo3 directory into a weights-only olmax checkpoint at OUT (step 0: OUT/0/)."""
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose a new output directory")
    cfg = run_config_from_hf(read_hf_config(src), name=src.absolute().name, where=str(src / "config.json"))
    params = load_hf_params(src, cfg)
    meta = run_meta(cfg, 0, {})
    meta["converted_from"] = {"format": "hf", "architecture": ARCHITECTURE, "path": str(src.absolute())}
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
        return jax.tree.map(lambda shape: np.empty(shape, cfg.model.param_dtype), olmo3.param_shapes(cfg.model),
                            is_leaf=lambda s: isinstance(s, tuple))
    return read_params(ckpt, host_arrays, step)


def _plan_shards(cfg: RunConfig, itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name, spec in hf_tensor_specs(cfg.model).items():
        nbytes = math.prod(spec.hf_shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf(cfg: RunConfig, params: dict, out: str | Path, dtype: str = "float32",
             max_shard_bytes: int = 5 * 2**30) -> Path:
    """safetensors (one file, or shards + index) and config.json for `Olmo3ForCausalLM.from_pretrained`."""
    out = Path(out)
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
        os.replace(partial, out)  # the directory appears complete or not at all
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write_hf_files(cfg: RunConfig, params: dict, out: Path, dtype: str, np_dtype, max_shard_bytes: int) -> None:
    m = cfg.model
    specs = hf_tensor_specs(m)
    shards = _plan_shards(cfg, np_dtype.itemsize, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        views = {name: _swap(_target(params, specs[name], m), specs[name]) for name in shard}
        stream.write_file(out / file, views, np_dtype, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        total = sum(math.prod(s.hf_shape) for s in specs.values()) * np_dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config_from_run(cfg, dtype), indent=2) + "\n")


def olmax_to_hf(ckpt: str | Path, out: str | Path, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30) -> tuple[RunConfig, int]:
    """Export the latest step of an olmax checkpoint as an HF Olmo3 directory; (config, step)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty; choose a new output directory")
    cfg, params, step = load_olmax(ckpt)
    write_hf(cfg, params, out, dtype, max_shard_bytes)
    return cfg, step
