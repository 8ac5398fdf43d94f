"""No silence over 30 seconds: phases that can take longer say how long they have gone on and what they wait
for (progress.SILENCE is 30 s; a fraction of a second here)."""

import json
import sys
import time

import pytest

from olmax import progress


@pytest.fixture
def short_silence(monkeypatch):
    monkeypatch.setattr(progress, "SILENCE", 0.2)


def _wait_for(capture, stream: str, text: str, timeout: float = 60.0) -> str:
    """What the stream got, once `text` is in it (waits for the ticker, not for a time)."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        out, err = capture.readouterr()
        seen += out if stream == "stdout" else err
    return seen


def test_a_silent_block_is_broken_by_a_line_and_the_stream_is_given_back(short_silence, capsys):
    before = sys.stdout
    with progress.ticking(lambda seconds: f"waiting for the thing ({seconds:.1f} s)", "stdout"):
        seen = _wait_for(capsys, "stdout", "waiting for the thing")
    assert sys.stdout is before
    assert seen.startswith("waiting for the thing (") and seen.endswith(" s)\n"), seen


def test_training_says_what_it_waits_for_in_its_silences(short_silence, tmp_path, shards, capsys):
    """The first step's compile took tens of seconds after `compiling the train step...` with nothing said."""
    from olmax.config import load_config
    from olmax.train.trainer import train

    train(load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/run", "mesh.fsdp=1",
                               "train.steps=2", "checkpoint.every=2"]))
    ticks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("olmax: [")]
    phases = ("restoring the run's state or initializing it", "compiling the train step (step 1)",
              "training: step 2 of 2 running", "writing checkpoint 2", "finishing the last checkpoint's write")
    assert ticks and all(line.split("] ", 1)[1].startswith(phases) for line in ticks), ticks


def test_compile_says_what_it_waits_for_in_its_silences(short_silence, capsys):
    """`olmax compile olmo3_7b --target tpu:v5p:4x4x8` printed nothing for 506 s after `compiling`."""
    from olmax.cli import main

    assert main(["compile", "tiny", "--target", "tpu:v5p:2x2x2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["target"] == "tpu:v5p:2x2x2"  # the lines go to stderr, the JSON stays whole
    assert "olmax compile: [" in err and "] still waiting for XLA (last: " in err, err
