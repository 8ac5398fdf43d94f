"""Stage to stage: a warm start keeps the parameters while the model may change where they do not."""

import json

import pytest

from olmax.config import load_config
from olmax.model import flops
from olmax.checkpoint import CheckpointError
from olmax.train.trainer import train


def _cfg(tmp_path, shards, name, *extra):
    return load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/{name}", "mesh.fsdp=1",
                                "train.steps=3", "checkpoint.every=3", *extra])


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_long_context_stage_starts_from_a_checkpoint_without_yarn(tmp_path, shards, caplog):
    train(_cfg(tmp_path, shards, "short"), quiet=True)
    yarn = "{theta: 500000.0, type: yarn, factor: 4.0, original_max_position_embeddings: 32}"
    extended = train(_cfg(tmp_path, shards, "long", f"model.rope.global={yarn}", "data.sequence_length=128",
                          f"checkpoint.init_from={tmp_path}/short/checkpoints"), quiet=True)
    assert [h["step"] for h in extended] == [1, 2, 3]
    assert "model.rope" in caplog.text and "its parameters stay" in caplog.text
    with pytest.raises(CheckpointError, match="model.d_model"):
        train(_cfg(tmp_path, shards, "wider", "model.d_model=128",
                   f"checkpoint.init_from={tmp_path}/short/checkpoints"), quiet=True)


def test_stage3_preset_is_the_long_context_recipe():
    cfg = load_config("olmo3_7b_stage3")
    rope = cfg.model.rope
    assert (rope["global"].type, rope["global"].factor, rope["global"].original_max_position_embeddings) == (
        "yarn", 8.0, 8192)
    assert rope["sliding"].type == "default" and cfg.data.sequence_length == 65536
    assert cfg.train.global_batch_instances * cfg.data.sequence_length == 2**22
    assert cfg.train.steps * 2**22 >= 50e9 > (cfg.train.steps - 1) * 2**22
    assert (cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.optim.lr) == ("linear", 200, 2.0712e-4)
    assert flops.count(cfg.model, 65536).params == 7_298_617_344
