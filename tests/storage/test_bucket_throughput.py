"""The throughput figures of a run in a bucket are what the device did: uploads (slowed here by the fault
proxy) happen while no step is in flight and are in no step's time, nor subtracted from another's."""

from __future__ import annotations

import statistics

import pytest

from olmax.config import load_config
from olmax.train.trainer import train


@pytest.mark.slow
def test_bucket_pushes_leave_mfu_and_tps_true(stores, synth_mix):
    stores.s3.add("delay", method="PUT", seconds=0.2)  # every upload slow: metrics at each step, checkpoints
    history = train(load_config("tiny", ["mesh.fsdp=1", "train.steps=12", "checkpoint.every=3",
                                         f"data.mix_file={synth_mix}", f"output_dir=s3://{stores.bucket}/run"]),
                    quiet=True)
    # Step 1 compiles the train step: it logs no throughput.
    tps = {h["step"]: h["throughput/device/TPS"] for h in history[1:]}
    assert all(h["throughput/device/MFU"] <= 100.0 for h in history[1:]), [h.get("throughput/device/MFU") for h in history]
    median = statistics.median(tps.values())
    assert all(median / 3 <= tps[step] <= 3 * median for step in range(2, 13)), (median, tps)
