"""Metric writers: scalars and vectors (histograms + per-index scalars) in the event files and metrics.jsonl."""

import json

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
    assert line == {"step": 1, "train/CE loss": 2.5, "train/tokens per expert": [3.0, 0.0, 5.0, 8.0]}
