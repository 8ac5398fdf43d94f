"""Metrics every step, with OLMo-core's names, to TensorBoard events, a JSONL file and the console.

TensorBoard event files are the source of truth for long runs; metrics.jsonl is
the same stream for scripts, each record with its step and its wall time (`wall_time`, Unix seconds, as the
event files keep it). On resume at step N both drop whatever a previous
attempt logged after step N, so the logs describe one run. A metric may be a
vector (say tokens per expert): a list in metrics.jsonl, and in the event files a
histogram of its values plus one scalar per index (`name/0`, `name/1`, ...).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import HistogramProto, Summary

from olmax.errors import DiskFull
from olmax.figures import percent
from olmax.run_dir import RunDir, open_own, own_dir, replace_own, writing

log = logging.getLogger(__name__)

# Dense bf16 peak per device (FLOP/s), by jax device_kind prefix.
PEAK_BF16_FLOPS = {
    "NVIDIA H100": 989.4e12,
    "NVIDIA H200": 989.4e12,
    "NVIDIA A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


def measure_matmul_flops(dtype=jnp.float32, size: int = 1024, repeats: int = 10) -> float:
    """Best-of-`repeats` FLOP/s of one jitted size^3 matmul on the default device."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# Float32 FLOPs a core's vector units can do per cycle, by the first of these instruction sets that /proc/cpuinfo
# lists: two FMA units of the vector width on x86 since Haswell and Skylake-SP (fewer on some parts: the peak is
# then generous, never short), four 128-bit FMA pipes on the widest Arm cores. XLA:CPU computes matmuls of every
# dtype in these units (measured on an AVX-512 Xeon with AMX, 2026-12-05: 156 GFLOP/s float32, 160 bfloat16).
FLOPS_PER_CYCLE = (("avx512f", 64), ("fma", 32), ("avx", 16), ("sse2", 8), ("asimd", 32))


def cpu_peak_flops(cpuinfo: str, max_khz: dict[int, int], usable: set[int]) -> float | None:
    """The peak FLOP/s of this process's CPU cores: physical cores x clock x FLOPs a core does per cycle, from
    /proc/cpuinfo's text (`cpuinfo`), each logical CPU's maximum clock in kHz where cpufreq gives it (`max_khz`)
    and the logical CPUs this process may run on (`usable`). A fact of the hardware, the same whatever else the
    machine is doing; None where the text does not say enough (no clock, an unknown instruction set)."""
    processors = [dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines()))
                  for block in cpuinfo.strip().split("\n\n")]
    processors = [p for p in processors if p.get("processor", "").isdigit() and int(p["processor"]) in usable]
    if not processors:
        return None
    cores = len({(p.get("physical id"), p.get("core id", p["processor"])) for p in processors})
    clock_ghz = max(max_khz[int(p["processor"])] / 1e6 if int(p["processor"]) in max_khz
                    else float(p.get("cpu MHz", 0)) / 1e3 for p in processors)
    flags = set((processors[0].get("flags") or processors[0].get("Features") or "").split())
    per_cycle = next((n for flag, n in FLOPS_PER_CYCLE if flag in flags), None)
    return cores * clock_ghz * 1e9 * per_cycle if per_cycle and clock_ghz > 0 else None


def this_cpu_peak_flops() -> float | None:
    """cpu_peak_flops of this machine (cpufreq's cpuinfo_max_freq, the clock the cores may reach, where the kernel
    has it; else /proc/cpuinfo's `cpu MHz`, constant on a virtual machine)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    max_khz = {}
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        with contextlib.suppress(OSError, ValueError):
            max_khz[int(path.parent.parent.name.removeprefix("cpu"))] = int(path.read_text())
    return cpu_peak_flops(cpuinfo, max_khz, os.sched_getaffinity(0))


@functools.cache
def device_peak_flops(dtype_name: str) -> float | None:
    """Each device's peak FLOP/s: the datasheet's dense bf16 figure on known accelerators, the measured matmul peak
    on other accelerators, and on a CPU this process's share of its cores' peak (the CPU's devices share its
    cores); None where the CPU does not say what it is."""
    device = jax.local_devices()[0]
    for prefix, peak in PEAK_BF16_FLOPS.items():
        if device.device_kind.startswith(prefix):
            return peak
    if device.platform != "cpu":
        return measure_matmul_flops(jnp.dtype(dtype_name))
    peak = this_cpu_peak_flops()
    return None if peak is None else peak / jax.local_device_count()


class MetricsWriter:
    """Writes synchronously, so that flush() puts every logged step on disk (tensorboardX's SummaryWriter
    hands events to a thread through a queue that its flush() does not drain: a process killed after
    flush() could lose the steps before the checkpoint it then wrote)."""

    def __init__(self, run_dir: Path, start_step: int, enabled: bool = True):
        self.enabled = enabled
        run = RunDir(run_dir)
        self.jsonl = run.metrics
        if not enabled:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        if self.jsonl.exists():
            kept = [ln for ln in run.metric_records() if json.loads(ln)["step"] <= start_step]
            # a crash now leaves the old file or the new one, never half of it
            replace_own(self.jsonl, "".join(ln + "\n" for ln in kept))
        self.tensorboard = own_dir(run.tensorboard)
        # A name no other process can guess (tensorboardX opens it following links): none waits there for it.
        self.events = EventsWriter(str(run.events), filename_suffix=f".{secrets.token_hex(8)}")
        self.file = open_own(self.jsonl, append=True)
        try:
            # TensorBoard's purge marker (as SummaryWriter(purge_step=...)): earlier files' later steps are dropped.
            self.events.write_event(Event(step=start_step + 1, wall_time=time.time(),
                                          session_log=SessionLog(status=SessionLog.START)))
            self.flush()
        except BaseException:
            with contextlib.suppress(OSError, DiskFull):
                self.close()
            raise

    def write(self, step: int, metrics: dict[str, float | list[float]]) -> dict:
        """Log `metrics` at `step`; the record metrics.jsonl keeps of them."""
        now = time.time()
        record = {"step": step, "wall_time": now, **metrics}
        if not self.enabled:
            return record
        # Tags are OLMo-core's metric names verbatim (tensorboardX's scalar() would turn spaces into `_`).
        values = []
        for name, value in metrics.items():
            if isinstance(value, list):
                values.append(Summary.Value(tag=name, histo=_histogram(value)))
                values += [Summary.Value(tag=f"{name}/{i}", simple_value=float(v)) for i, v in enumerate(value)]
            else:
                values.append(Summary.Value(tag=name, simple_value=float(value)))
        with writing(self.tensorboard):
            self.events.write_event(Event(step=step, wall_time=now, summary=Summary(value=values)))
        with writing(self.jsonl):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        return record

    def flush(self) -> None:
        if self.enabled:
            with writing(self.tensorboard):
                self.events.flush()
            with writing(self.jsonl):
                self.file.flush()

    def close(self) -> None:
        if self.enabled:
            try:
                with writing(self.tensorboard):
                    self.events.close()
            finally:
                with writing(self.jsonl):
                    self.file.close()


def _histogram(values: list[float], bins: int = 30) -> HistogramProto:
    x = np.asarray(values, dtype=np.float64)
    counts, edges = np.histogram(x, bins=bins)
    return HistogramProto(min=float(x.min()), max=float(x.max()), num=float(x.size), sum=float(x.sum()),
                          sum_squares=float((x * x).sum()), bucket_limit=edges[1:].tolist(), bucket=counts.tolist())


def console_line(step: int, total: int, m: dict[str, float]) -> str:
    skipped = " skipped" if m.get("optim/step skipped") else ""
    evals = "".join(f"  {k.removeprefix('eval/lm/').removesuffix('/CE loss')} {v:.4f}"
                    for k, v in m.items() if k.startswith("eval/lm/") and k.endswith("/CE loss"))
    experts = (f"  LB {m['train/load balancing loss']:.4f}  load imbalance {m['train/load imbalance']:.2f}"
               if "train/load imbalance" in m else "")
    return (
        f"step {step}/{total}  CE {m['train/CE loss']:.4f}  Z {m['train/Z loss']:.2e}{experts}  "
        f"gnorm {m['optim/total grad norm']:.3f}  lr {m['optim/LR (group 0)']:.3e}  "
        + (f"TPS/dev {m['throughput/device/TPS']:,.0f}" if "throughput/device/TPS" in m
           else "TPS/dev - (this step compiled the train step)")
        + (f"  MFU {percent(m['throughput/device/MFU'] / 100)}" if "throughput/device/MFU" in m else "") + skipped
        + (f"  | held-out CE{evals}" if evals else "")
    )
