"""Metric writers: scalars and vectors (histograms + per-index scalars) in the event files and metrics.jsonl."""

import json
import time

from testlib import event_histograms as _histograms
from olmax.eval.curves import read_events
from olmax.train.metrics import MetricsWriter


def test_vector_metrics_are_histograms_and_per_index_scalars(tmp_path):
    writer = MetricsWriter(tmp_path, 0)
    writer.write(1, {"train/CE loss": 2.5, "train/tokens per expert": [3.0, 0.0, 5.0, 8.0]})
    writer.close()
    scalars = read_events(tmp_path / "tensorboard")
    assert scalars["train/CE loss"] == {1: 2.5}
    assert [scalars[f"train/tokens per expert/{i}"][1] for i in range(4)] == [3.0, 0.0, 5.0, 8.0]
    histo = _histograms(tmp_path / "tensorboard")[("train/tokens per expert", 1)]
    assert (histo.num, histo.sum, histo.min, histo.max) == (4, 16.0, 0.0, 8.0) and sum(histo.bucket) == 4
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line == {"step": 1, "wall_time": line["wall_time"], "train/CE loss": 2.5,
                    "train/tokens per expert": [3.0, 0.0, 5.0, 8.0]}
    assert abs(line["wall_time"] - time.time()) < 60


XEON = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
cpu MHz\t\t: 2600.000
physical id\t: 0
core id\t\t: {core}
flags\t\t: fpu sse2 avx fma avx2 avx512f amx_bf16
"""


def test_the_cpu_peak_is_the_hardwares_not_a_measurement():
    """Cores x clock x FLOPs a core does per cycle, from /proc/cpuinfo: the same at any moment, however busy the
    machine (a matmul measured while it was busy made the peak small and MFU 211%)."""
    import jax

    from olmax.train.metrics import cpu_peak_flops, device_peak_flops, this_cpu_peak_flops

    two_cores = "\n".join(XEON.format(n=n, core=n) for n in range(2))
    assert cpu_peak_flops(two_cores, {}, {0, 1}) == 2 * 2.6e9 * 64  # AVX-512: 2 FMA units x 16 lanes x 2
    hyperthreads = "\n".join(XEON.format(n=n, core=n // 2) for n in range(4))  # 2 logical CPUs a core
    assert cpu_peak_flops(hyperthreads, {}, {0, 1, 2, 3}) == 2 * 2.6e9 * 64
    assert cpu_peak_flops(hyperthreads, {0: 3_500_000}, {0, 1}) == 3.5e9 * 64  # cpufreq's maximum; one core usable
    assert cpu_peak_flops(two_cores.replace(" avx512f", ""), {}, {0, 1}) == 2 * 2.6e9 * 32  # AVX2 and FMA
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm\n"
    assert cpu_peak_flops(arm, {0: 3_000_000}, {0}) == 3e9 * 32
    assert cpu_peak_flops(arm, {}, {0}) is None  # no clock: no peak, so no MFU figure
    assert device_peak_flops("float32") == this_cpu_peak_flops() / jax.local_device_count()


def test_a_step_is_timed_to_its_own_end_not_to_when_the_loop_looks():
    """The clock's own thread notes when a step's results are ready: a loop that looks a second later (logging, an
    upload) does not lengthen the step, nor, by starting the next one from that late look, shorten the next."""
    import time

    import jax
    import jax.numpy as jnp

    from olmax.train.step_clock import StepClock

    work = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda _, y: jnp.tanh(y @ y), x))
    x = jnp.eye(256) * 0.5
    work(x).block_until_ready()  # compiled
    clock = StepClock()
    seen = []
    for step in (1, 2):
        clock.dispatching(step)
        start = time.perf_counter()
        out = work(x)
        clock.dispatched(step, out)
        out.block_until_ready()
        seen.append(time.perf_counter() - start)
        time.sleep(1.0)  # the loop looks late
    seconds = [clock.seconds(1), clock.seconds(2)]
    clock.close()
    assert all(0 < s < t + 0.5 for s, t in zip(seconds, seen)), (seconds, seen)


def test_an_mfu_above_100_percent_is_a_bug_said_once_never_a_figure(tmp_path, shards, capsys, monkeypatch):
    """A peak far too small (what a matmul measured on a busy machine gave) makes every step's MFU impossible: the
    run says so once, on stderr, and logs no MFU figure (the console lines show none either)."""
    import json

    from olmax.config import load_config
    from olmax.train import trainer

    monkeypatch.setattr(trainer, "device_peak_flops", lambda dtype: 1e6)
    history = trainer.train(load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/run",
                                                 "mesh.fsdp=1", "train.steps=4", "train.log_every=1",
                                                 "checkpoint.every=4"]))
    out, err = capsys.readouterr()
    assert not any("throughput/device/MFU" in h for h in history) and "MFU" not in out, out
    bug = [line for line in err.splitlines() if "MFU came out at" in line]
    assert len(bug) == 1 and bug[0].startswith("olmax: bug: step 2's MFU came out at ") and "above 100%" in bug[0]
