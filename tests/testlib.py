"""Helpers that tests import (`from testlib import ...`; tests/ is on the path through its conftest)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
# How every process of the suite compiles (conftest, child_env): XLA's passes as always, then the machine code
# without LLVM's optimizations. Compiling is half of what the suite costs and -O0 halves it (the pipeline's model
# tests, cold: 547 -> 240 s of compiles, 2026-12-07); the programs are the same HLO, their results the same in
# every process of the suite (they differ from -O2's in the last bits: no fused multiply-adds).
CPU_COMPILE = "--xla_backend_optimization_level=0"


def docs(page: str | None = None) -> str:
    """What the docs say: one page of the docs site (`docs("commands.md")`), or without one the README and every
    page, as one text."""
    if page is not None:
        return (ROOT / "docs" / page).read_text()
    return "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def apt_install(*packages: str, check: bool = True) -> subprocess.CompletedProcess:
    """Debian's packages, as the README's test command gets them on a fresh machine: an `apt-get update` first if
    the install fails; a test installing at the same moment on another worker is waited for (dpkg's lock), not
    failed on. With `check`, a failure is the test's; without, the last try is returned."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-q", "--no-install-recommends", *packages]
    if (out := subprocess.run(install, env=env, capture_output=True, text=True, timeout=1800)).returncode != 0:
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=900", "update", "-q"], env=env, capture_output=True,
                       timeout=1800)
        out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 or not check, f"could not install {' '.join(packages)}: {out.stderr[-2000:]}"
    return out


def child_env(devices: int, **extra) -> dict:
    """The environment of training children: `devices` CPU devices (not the 8 of conftest) and the suite's
    compilation cache (conftest's), so a child compiles only what no test and no earlier child compiled."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_devices(devices), **extra}


def cpu_devices(devices: int) -> str:
    """XLA_FLAGS for a child of `devices` CPU devices, compiling as the suite does."""
    return f"--xla_force_host_platform_device_count={devices} {CPU_COMPILE}"


def signal_once_when(done, sig: int, process: int = 0, watchdog: float = 180, poll: float = 0.01):
    """A Supervisor on_start hook: in the first attempt, send `sig` to `process` as soon as `done()` is true; if
    the attempt has not ended `watchdog` seconds later (a hang), SIGKILL all its processes."""
    import threading
    import time

    attempts = []

    def on_start(procs):
        attempts.append(procs)
        if len(attempts) > 1:
            return

        def send():
            while not done():
                if procs[process].poll() is not None:
                    return
                time.sleep(poll)
            procs[process].send_signal(sig)
            deadline = time.monotonic() + watchdog
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                time.sleep(0.1)
        threading.Thread(target=send, daemon=True).start()
    return on_start


def signal_once_after_checkpoint(run_dir: Path, step: int, sig: int, process: int = 0):
    """An on_start hook: in the first attempt, send `sig` to `process` as soon as checkpoint `step` is committed."""
    return signal_once_when(lambda: (run_dir / "checkpoints" / str(step)).is_dir(), sig, process)


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def tensorboard_steps(log_dir: Path, tag: str = "train/CE loss") -> list[int]:
    """The steps of `tag` as TensorBoard shows them (a resume's purge marker drops later steps of earlier files)."""
    from olmax.eval.curves import read_events

    return sorted(read_events(log_dir).get(tag, {}))


def moe_layer_params(cfg, d_model: int, key, std: float = 0.02) -> dict:
    """One MoE layer's parameters for tests of the layer alone, from the
    families' MoE rows: every matrix ~ N(0, std) truncated at +-3 std, the selection bias 0."""
    import jax
    import jax.numpy as jnp

    from olmax.model.families.base import moe_shapes

    shapes = {name: shape for name, (shape, _) in moe_shapes(cfg, d_model).items()}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {name: jnp.zeros(shape) if name == "score_bias"
            else std * jax.random.truncated_normal(keys[name], -3.0, 3.0, shape, jnp.float32)
            for name, shape in shapes.items()}


def event_histograms(directory) -> dict:
    """{(tag, step): HistogramProto} of the TensorBoard event files in `directory`."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in directory.glob("events*"):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
            out.update({(v.tag, event.step): v.histo for v in event.summary.value if v.HasField("histo")})
    return out


def write_text_corpus(directory: Path, files: int, lines: int) -> list[Path]:
    """`files` files of `lines` JSON lines of random words each (some with non-ASCII text), in turn .jsonl, .jsonl.gz,
    .jsonl.zst and .txt (a .txt file is one document: its lines as they are)."""
    import gzip
    import json

    import numpy as np
    import zstandard

    words = "the a data model token shard ray node worker retry ünïcödé 数据 🙂".split()
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        text = "".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(5, 300))))}) + "\n"
                       for _ in range(lines)).encode()
        suffix, data = [("jsonl", text), ("jsonl.gz", gzip.compress(text)), ("jsonl.zst", zstandard.compress(text)),
                        ("txt", text)][i % 4]
        paths.append(directory / f"part-{i:02d}.{suffix}")
        paths[-1].write_bytes(data)
    return paths
