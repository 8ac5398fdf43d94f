"""The compile cache in a bucket (`OLMAX_COMPILE_CACHE=s3://...`, `gs://...`), against real S3 and GCS servers on
127.0.0.1: an entry stored there is found again by its program, and one that cannot prove it is this program's,
stored whole, is compiled again, said, and stored whole again, as in a directory."""

import gzip

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax import storage
from olmax.cli import main
from olmax.scale import compile_cache
from olmax.scale.compile import compiled_program
from olmax.scale.targets import aot_missing, compile_only_devices, parse_target

needs_tpu = pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))


def _lowered(target, extra: bool):
    mesh = Mesh(np.asarray(compile_only_devices(target)), ("fsdp",))
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    return jax.jit((lambda a: jnp.tanh(a @ a.T) @ a) if extra else (lambda a: jnp.tanh(a @ a.T))).trace(x).lower()


@needs_tpu
@pytest.mark.parametrize("kind, how", [("s3", "result.json cut short"), ("gs", "program.hlo.gz garbled"),
                                       ("s3", "a copy of another program's entry"), ("gs", "program.hlo.gz gone")])
def test_a_bucket_entry_is_found_again_and_one_not_this_programs_whole_is_compiled_again(stores, monkeypatch,
                                                                                        caplog, kind, how):
    cache = f"{kind}://{stores.bucket}/compiles"
    monkeypatch.setenv("OLMAX_COMPILE_CACHE", cache)
    target = parse_target("tpu:v5p:2x2x2")
    lowered, other_lowered = _lowered(target, False), _lowered(target, True)
    first, other = compiled_program(lowered, target), compiled_program(other_lowered, target)
    assert not first["cached"] and compiled_program(lowered, target) == {**first, "cached": True}
    entries = storage.listdir(cache)
    assert len(entries) == 2 and all(storage.listdir(f"{cache}/{e}") == ["program.hlo.gz", "result.json"]
                                     for e in entries)
    entry, other_entry = (f"{cache}/{compile_cache.key(x.as_text(), target)}" for x in (lowered, other_lowered))
    if how == "result.json cut short":
        text = storage.read_text(f"{entry}/result.json")
        storage.write_bytes(f"{entry}/result.json", text[: len(text) // 2].encode())
    elif how == "program.hlo.gz garbled":
        stored = storage.read_bytes(f"{entry}/program.hlo.gz")
        storage.write_bytes(f"{entry}/program.hlo.gz", stored[:20] + bytes(b ^ 0xFF for b in stored[20:40]) + stored[40:])
    elif how == "a copy of another program's entry":
        for name in ("program.hlo.gz", "result.json"):
            storage.write_bytes(f"{entry}/{name}", storage.read_bytes(f"{other_entry}/{name}"))
    else:
        assert how == "program.hlo.gz gone"
        storage.remove(f"{entry}/program.hlo.gz")
    caplog.clear()
    again = compiled_program(lowered, target)
    assert not again["cached"] and again["peak"] == first["peak"] and again["text"] == first["text"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"the compile cache entry {entry} cannot be used" in said[0], said
    assert compiled_program(lowered, target)["cached"]  # stored whole again
    assert gzip.decompress(storage.read_bytes(f"{entry}/program.hlo.gz")).decode() == first["text"]
    assert compiled_program(other_lowered, target) == {**other, "cached": True}  # the other entry untouched


def test_a_bucket_that_is_not_there_is_refused_before_anything_is_compiled(stores, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("OLMAX_COMPILE_CACHE", "s3://no-such-bucket/compiles")
    assert main(["compile", "tiny", "--target", "tpu:v5p:2x2x1", "--report", str(tmp_path / "page")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("olmax: ConfigError: OLMAX_COMPILE_CACHE s3://no-such-bucket/compiles: ") and \
        "no-such-bucket" in line.split(": ", 3)[3] and line.endswith("; set another OLMAX_COMPILE_CACHE"), line
    assert not (tmp_path / "page").exists()
