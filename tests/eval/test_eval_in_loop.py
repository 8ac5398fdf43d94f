"""In-loop evals: the trainer's hook gives OLMo-core-named metrics at the steps due, equal to `olmax eval heldout`."""

import json
from pathlib import Path

import jax
import pytest

from olmax.config import ConfigError, load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.eval import documents, heldout
from olmax.eval.curves import read_events
from olmax.eval.in_loop import make_in_loop_eval
from olmax.model import families
from olmax.parallel.mesh import make_layout


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    train = write_synthetic_shards(out / "train", vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=2, seed=0)
    held = write_synthetic_shards(out / "held", vocab_size=512, eos_id=0, n_tokens=6_000, n_shards=1, seed=9)
    return train, held


def _cfg(tmp_path, shards, *overrides):
    train, held = shards
    return load_config("tiny", [f"data.paths={json.dumps(train)}", f"output_dir={tmp_path}/run", "mesh.fsdp=8",
                                f"eval.sets=[{{label: held, paths: {json.dumps(held)}}}]", "eval.tokens=1000",
                                *overrides])


def test_in_loop_eval_is_off_by_default_and_checked():
    assert make_in_loop_eval(load_config("tiny"), None) is None
    with pytest.raises(ConfigError, match="eval.sets is empty"):
        load_config("tiny", ["eval.every=5"])
    with pytest.raises(ConfigError, match="exactly one of paths or mix_file"):
        load_config("tiny", ["eval.sets=[{label: x}]"])


def test_hook_reports_the_sets_at_the_steps_due(tmp_path, shards):
    cfg = _cfg(tmp_path, shards, "eval.every=5", "eval.batch_instances=16")
    layout = make_layout(cfg.mesh)
    evaluate = make_in_loop_eval(cfg, layout)
    params = families.init_params(cfg.model, jax.random.key(0))
    assert evaluate(3, params) == {} and not evaluate.due(3) and evaluate.due(10)
    metrics = evaluate(10, params)
    assert set(metrics) == {"eval/lm/held/CE loss", "eval/lm/held/PPL"}
    selection = documents.select([documents.open_eval_set("held", shards[1], token_dtype="uint16", eos_id=0)],
                                 sequence_length=64, tokens=1000, seed=0)
    want = heldout.evaluate(cfg, params, selection, layout, rows_per_batch=16)
    assert metrics["eval/lm/held/CE loss"] == want["sets"]["held"]["CE loss"]


@pytest.mark.slow
def test_in_loop_metrics_are_in_the_event_files_of_a_short_run(tmp_path, shards):
    from olmax.train.trainer import train

    train(_cfg(tmp_path, shards, "train.steps=10", "checkpoint.every=10", "eval.every=5"), quiet=True,
          make_eval=make_in_loop_eval)
    events = read_events(Path(tmp_path, "run", "tensorboard"))
    for name in ("eval/lm/held/CE loss", "eval/lm/held/PPL"):
        assert sorted(events[name]) == [5, 10], name
    logged = [json.loads(line) for line in Path(tmp_path, "run", "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "eval/lm/held/CE loss" in m] == [5, 10]


def test_in_loop_eval_sets_get_the_dtype_check_training_applies(tmp_path, synth_mix, synth_mix32, capsys):
    from olmax.cli import main

    code = main(["train", "tiny", "mesh.fsdp=1", f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run",
                 "eval.every=2", f"eval.sets=[{{label: held, mix_file: {synth_mix32}}}]"])
    err = capsys.readouterr().err
    assert code == 2 and "written as uint32 tokens" in err and "set data.token_dtype=uint32" in err
