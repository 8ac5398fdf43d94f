"""`olmax eval`, `convert` and `parity` read their checkpoints, models and token shards from buckets and write
their outputs there, with the results they give on local files; only committed checkpoint steps are read."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from olmax import storage
from olmax.cli import main
from olmax.model.weights import load_olmax


def _equal_trees(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _equal_trees(a[k], b[k]) if isinstance(a[k], dict) else np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_eval_convert_and_parity_on_buckets(stores, base_run, synth_mix, capsys):
    s3, gs = f"s3://{stores.bucket}", f"gs://{stores.bucket}"
    shard = synth_mix.parent / "part-00000.npy"
    storage.upload(synth_mix.parent, f"{s3}/data")
    storage.upload_committed(base_run / "checkpoints" / "6", f"{s3}/run/checkpoints/6")
    storage.upload(base_run / "checkpoints" / "4", f"{s3}/run/checkpoints/8")  # an upload cut short: no marker

    assert main(["eval", "heldout", str(base_run), "--data", str(shard), "--tokens", "2048"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["eval", "heldout", f"{s3}/run", "--data", f"{s3}/data/part-00000.npy", "--tokens", "2048",
                 "--out", f"{gs}/eval/heldout.json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote["model"] == f"{s3}/run/checkpoints/6"  # the latest committed step, not the torn 8
    assert remote["sets"] == local["sets"] and remote["tokens"] == local["tokens"] > 0
    assert json.loads(storage.read_text(f"{gs}/eval/heldout.json")) == remote

    assert main(["convert", "olmax-to-hf", f"{s3}/run", f"{gs}/hf"]) == 0
    assert "config.json" in storage.listdir(f"{gs}/hf")
    assert main(["convert", "hf-to-olmax", f"{gs}/hf", f"{s3}/back"]) == 0
    assert storage.committed(f"{s3}/back/0")
    _, before, _ = load_olmax(base_run / "checkpoints" / "6")
    _, after, step = load_olmax(f"{s3}/back")
    assert step == 0 and _equal_trees(before, after)
    capsys.readouterr()
    assert main(["convert", "hf-to-olmax", f"{gs}/hf", f"{s3}/back"]) == 2  # not a new output
    assert f"{s3}/back exists and is not empty" in capsys.readouterr().err

    assert main(["parity", "--olmax", f"{s3}/back", "--hf", f"{gs}/hf", "--tokens", f"{s3}/data/part-00000.npy",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["comparisons"]["hf"]["reference"] == f"{gs}/hf"
    assert report["inputs"] == f"token shard {s3}/data/part-00000.npy"


def test_a_step_without_its_commit_marker_is_named(stores, base_run, capsys, caplog):
    run = f"s3://{stores.bucket}/run"
    storage.upload(base_run / "checkpoints" / "4", f"{run}/checkpoints/4")
    with caplog.at_level(logging.WARNING):
        assert main(["eval", "heldout", f"{run}/checkpoints/4", "--data", "unused.npy"]) == 2
    err = capsys.readouterr().err
    assert f"{run}/checkpoints/4 is not a committed checkpoint (committed: none)" in err
    assert f"{run}/checkpoints/4 has no commit marker" in caplog.text


def test_an_unreadable_step_in_a_bucket_is_named_by_its_url(stores, base_run, tmp_path, capsys):
    """Not by the temporary copy it was read from (which is gone when the line is read)."""
    run = f"s3://{stores.bucket}/run"
    step = tmp_path / "6"
    shutil.copytree(base_run / "checkpoints" / "6", step)
    (step / "meta" / "metadata").write_text("{not json")
    storage.upload_committed(step, f"{run}/checkpoints/6")
    for argv in (["eval", "heldout", run, "--data", "unused.npy"],
                 ["convert", "olmax-to-hf", run, "--out", str(tmp_path / "hf")]):
        assert main(argv) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert f"checkpoint {run}/checkpoints/6 is unreadable" in line and f"({run}/checkpoints/N)" in line, line
        assert "olmax-ckpt-" not in line


def test_a_report_goes_to_a_bucket(stores, tmp_path, monkeypatch, capsys):
    """`--report s3://...` writes the page into the bucket (it was a local directory named `s3:`)."""
    monkeypatch.chdir(tmp_path)
    url = f"s3://{stores.bucket}/reports/tiny"
    assert main(["plan", "tiny", "--target", "tpu:v5p:2x2x2", "--report", url]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == f"olmax: report {url}/index.html"  # after the progress lines
    assert storage.read_text(f"{url}/index.html").startswith("<!DOCTYPE html>")
    assert json.loads(storage.read_text(f"{url}/report.json"))["target"] == "tpu:v5p:2x2x2"
    assert not list(tmp_path.iterdir())
