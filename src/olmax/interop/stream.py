"""safetensors files read into, and written from, existing arrays a bounded slab at a time.

The format is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, [begin, end) byte offsets into the data that follows, plus
`__metadata__`), then the raw C-order data. Reading with `readinto` and writing
with `write` keeps the file's pages in the page cache, out of the process: the
peak is the destination (or source) arrays plus one slab of `SLAB_BYTES`, where
safetensors' own API maps the whole file into the process and copies each whole
tensor (and writes a whole shard from one dict of arrays).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from olmax.interop import InteropError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
SLAB_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data), checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise InteropError(f"{path}: not a safetensors file (header length {length}, file size {size})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InteropError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise InteropError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    start, data = 8 + length, size - 8 - length
    for name, entry in header.items():
        if isinstance(entry, dict) and entry.get("dtype") not in DTYPES:
            raise InteropError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which olmax does not "
                               f"read (it reads {sorted(DTYPES)}); convert it to F32 or BF16")
        try:
            begin, end = entry["data_offsets"]
            nbytes = math.prod(entry["shape"]) * np.dtype(DTYPES[entry["dtype"]]).itemsize
        except (KeyError, TypeError, ValueError):
            raise InteropError(f"{path}: tensor {name!r} has a malformed header entry {entry}") from None
        if end - begin != nbytes or not 0 <= begin <= end <= data:
            raise InteropError(f"{path}: tensor {name!r} ({entry['dtype']} {entry['shape']}) claims bytes "
                               f"[{begin}, {end}) of {data}; the file is truncated or corrupt")
    return header, start


def _slabs(shape: tuple[int, ...], itemsize: int):
    """[r0, r1) ranges over the first axis (tensors of rank >= 1), each about SLAB_BYTES."""
    rows = max(1, SLAB_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    for r0 in range(0, shape[0], rows):
        yield slice(r0, min(r0 + rows, shape[0]))


def read_into(f, start: int, name: str, entry: dict, target: np.ndarray) -> None:
    """Fill `target` (any strided view of the tensor's shape) with tensor `name`, converting the dtype; its values
    must be finite (a NaN or an infinity in a weight makes every step's loss NaN)."""
    dtype, shape = np.dtype(DTYPES[entry["dtype"]]), tuple(entry["shape"])
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    f.seek(start + entry["data_offsets"][0])
    for rows in _slabs(shape, dtype.itemsize):
        buf = np.empty((rows.stop - rows.start) * row_bytes, np.uint8)
        if f.readinto(buf) != buf.size:
            raise InteropError(f"{f.name}: ended inside a tensor; the file is truncated")
        slab = buf.view(dtype).reshape(-1, *shape[1:])
        if not np.isfinite(slab).all():
            index = np.unravel_index(np.flatnonzero(~np.isfinite(slab))[0], slab.shape)
            at = (index[0] + rows.start, *index[1:])
            raise InteropError(f"{f.name}: tensor {name} holds {slab[index]} (at {list(map(int, at))}); olmax "
                               "imports finite weights only: use a checkpoint that is not damaged")
        target[rows] = slab


def write_file(path: Path, tensors: dict[str, np.ndarray], dtype, metadata: dict | None = None) -> None:
    """One safetensors file of `tensors` (strided views are fine), each cast to `dtype` a slab at a time."""
    dtype = np.dtype(dtype)
    header, offset = {}, 0
    for name, array in tensors.items():
        nbytes = array.size * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data aligned to 8 bytes, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for array in tensors.values():
            for rows in _slabs(array.shape, dtype.itemsize):
                f.write(np.ascontiguousarray(array[rows], dtype=dtype).reshape(-1).view(np.uint8).data)
