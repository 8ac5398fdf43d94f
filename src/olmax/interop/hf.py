"""HF transformers checkpoints <-> olmax: safetensors I/O and streaming conversion. The HF `model_type` is the
olmax model family (olmax.model.families): config.json is translated, and tensor names and layouts come,
from the family's module and parameter table; nothing here knows one family from another.

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
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from olmax import storage
from olmax.checkpoint import Checkpointer, run_meta
from olmax.config import CheckpointConfig, ModelConfig, RunConfig
from olmax.errors import EvalError
from olmax.interop import InteropError, stream
from olmax.model import families
from olmax.model.weights import Model, load_olmax
from olmax.outputs import check_new_output, new_output_dir
from olmax.run_dir import RunDir

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}  # safetensors dtype codes the import accepts
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# --- config.json -----------------------------------------------------------------------------------


def read_hf_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise InteropError(f"{src} is not an HF model directory: {path.name} is missing")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise InteropError(f"{path} holds {type(config).__name__}, not the object of settings an HF config.json is")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in families.HF_CLASSES or architectures not in ([], [families.HF_CLASSES[model_type]]):
        known = ", ".join(f"{cls} (model_type {t!r})" for t, cls in families.HF_CLASSES.items())
        raise InteropError(f"{path}: unsupported architecture (model_type {model_type!r}, architectures "
                           f"{architectures}); olmax converts {known}")
    return config


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
        lines = [f"{src}: the tensors do not match config.json ({families.HF_CLASSES[m.family]}: {m.n_layers} layers, "
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
    files = hf_tensor_files(src)
    found = _tensor_headers(files)
    # Counted before they are listed (check_hf_tensors names each one missing): num_hidden_layers 1e9 listed 11e9
    # names, 19 GB, before the kernel killed the process.
    if (implied := families.foreign_tensor_count(m)) > 2 * len(found):
        raise InteropError(f"{src}: config.json implies {implied:,} tensors ({families.HF_CLASSES[m.family]}: "
                           f"{m.n_layers:,} layers), more than twice the {len(found):,} the safetensors files hold; "
                           "check config.json's num_hidden_layers (and experts) against the weights")
    tensors = families.foreign_tensors(m)
    check_hf_tensors(found, src, m)
    params = jax.tree.map(lambda shape: np.zeros(shape, np.float32), families.param_shapes(m),
                          is_leaf=lambda s: isinstance(s, tuple))
    for path in sorted(set(files.values())):
        header, start = stream.read_header(path)
        with open(path, "rb") as f:
            for name, entry in header.items():
                stream.read_into(f, start, name, entry, families.foreign_view(params, *tensors[name], m))
    return params


def load_model(path: str | Path) -> Model:
    """An HF Olmo3 directory (config.json + safetensors), an olmax checkpoint directory (its latest
    step), one step of it (`.../checkpoints/STEP`), or a run directory (its `checkpoints/`); local or in a
    bucket (a checkpoint's step is read from there alone, an HF directory copied whole)."""
    if not storage.exists(str(path)):
        raise EvalError(f"{path} does not exist; give an olmax checkpoint or run directory, or an HF model directory")
    if storage.exists(storage.join(path, "config.json")):
        with storage.local_copy(path) as local:
            cfg = families.from_hf(read_hf_config(local), name=storage.basename(path),
                                   where=storage.join(path, "config.json"))
            return Model(str(path), cfg, load_hf_params(local, cfg))
    cfg, params, step = load_olmax(path)
    name = str(path).rstrip("/")
    if not storage.basename(name).isdigit():
        checkpoints = RunDir(name).checkpoints
        name = storage.join(checkpoints, str(step)) if storage.is_dir(checkpoints) else storage.join(name, str(step))
    return Model(name, cfg, params)


# --- conversions -----------------------------------------------------------------------------------


def hf_to_olmax(src: str | Path, out: str | Path, origin: str | None = None) -> RunConfig:
    """Convert an HF Olmo3 / OLMoE directory into a weights-only olmax checkpoint at OUT (step 0: OUT/0/), a new
    directory or bucket prefix; `origin` is where SRC was copied from (a bucket), recorded in the meta instead of
    SRC."""
    src = Path(src)
    with new_output_dir(out, "convert hf-to-olmax", InteropError, checkpoint=True) as partial:
        cfg = families.from_hf(read_hf_config(src), name=src.absolute().name, where=str(src / "config.json"))
        params = load_hf_params(src, cfg)
        meta = run_meta(cfg, 0, {})
        meta["converted_from"] = {"format": "hf", "architecture": families.HF_CLASSES[cfg.model.family],
                                  "path": origin or str(src.absolute())}
        checkpointer = Checkpointer(partial, CheckpointConfig())
        try:
            checkpointer.save_params(0, params, meta)
        finally:
            checkpointer.close()
    return cfg


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
    (`Olmo3ForCausalLM` / `OlmoeForCausalLM`.from_pretrained), and a copy of `tokenizer` (a tokenizer.json), in
    `out`, a new directory or bucket prefix."""
    families.check_exportable(cfg.model)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise InteropError(f"tokenizer {tokenizer} is not a file; give the run's tokenizer.json")
    check_new_output(out, "convert olmax-to-hf", InteropError)
    if dtype not in EXPORT_DTYPES:
        raise InteropError(f"export dtype {dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    np_dtype = np.dtype(EXPORT_DTYPES[dtype])
    with new_output_dir(out, "convert olmax-to-hf", InteropError) as partial:
        _write_hf_files(cfg, params, partial, dtype, np_dtype, max_shard_bytes)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / "tokenizer.json")
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
    (out / "config.json").write_text(json.dumps(families.to_hf(cfg, dtype), indent=2) + "\n")


def olmax_to_hf(ckpt: str | Path, out: str | Path, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30, tokenizer: str | Path | None = None) -> tuple[RunConfig, int]:
    """Export the latest step of an olmax checkpoint as an HF Olmo3 / OLMoE directory (with a copy of
    `tokenizer`); (config, step)."""
    check_new_output(out, "convert olmax-to-hf", InteropError)  # before the checkpoint is read
    cfg, params, step = load_olmax(ckpt)
    write_hf(cfg, params, out, dtype, max_shard_bytes, tokenizer)
    return cfg, step
