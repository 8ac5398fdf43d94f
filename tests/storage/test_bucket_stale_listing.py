"""A stale listing at a resume (the fault proxy answers the first listing it saw) is listed again, and if it stays
stale the run stops with exit 2 naming both: it never restarts from 0, deletes checkpoints or shortens metrics."""

from __future__ import annotations

import json

import pytest

from olmax import storage
from olmax.cli import main

RUN_LISTING = r"prefix=run%2F(&|$)"
CHECKPOINTS_LISTING = r"prefix=run%2Fcheckpoints%2F(&|$)"


def _train(synth_mix, run, *extra) -> int:
    return main(["train", "tiny", "mesh.fsdp=1", "train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=1",
                 f"data.mix_file={synth_mix}", f"output_dir={run}", *extra])


def _logged_steps(run: str) -> list[int]:
    return [json.loads(line)["step"] for line in storage.read_text(f"{run}/metrics.jsonl").splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("listing", [RUN_LISTING, CHECKPOINTS_LISTING])
def test_a_stale_listing_at_resume_is_listed_again(stores, synth_mix, listing, capsys):
    run = f"s3://{stores.bucket}/run"
    assert _train(synth_mix, run, "train.stop_after=4") == 0
    stale = stores.s3.add("stale", path=listing, times=1)
    assert _train(synth_mix, run) == 0
    assert stale.hits == 1
    assert f"resuming from step 4 (checkpoint {run}/checkpoints/4)" in capsys.readouterr().out
    assert _logged_steps(run) == [1, 2, 3, 4, 5, 6]
    assert storage.listdir(f"{run}/checkpoints") == ["6"]


@pytest.mark.slow
@pytest.mark.parametrize("listing", [RUN_LISTING, CHECKPOINTS_LISTING])
def test_a_listing_that_stays_stale_stops_the_run_naming_both(stores, synth_mix, listing, capsys):
    run = f"s3://{stores.bucket}/run"
    assert _train(synth_mix, run, "train.stop_after=4") == 0
    capsys.readouterr()
    stores.s3.add("stale", path=listing)
    assert _train(synth_mix, run, "storage.retry_seconds=1") == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "the store's listing disagrees with the run" in err
    if listing == RUN_LISTING:
        assert f"it has no metrics.jsonl but {run}/metrics.jsonl exists" in err
    else:
        assert f"its newest committed checkpoint is none but {run}/committed.json records step 4" in err
    stores.s3.clear()
    assert _logged_steps(run) == [1, 2, 3, 4]  # nothing lost
    assert storage.listdir(f"{run}/checkpoints") == ["4"]
