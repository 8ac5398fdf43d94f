"""Pipeline schedules are named objects: each has its tick table, says what a stage keeps, and checks the config
when it is loaded (a command ends with exit 2 before anything starts)."""

import numpy as np
import pytest

from olmax.cli import main
from olmax.config import ConfigError, load_config
from olmax.parallel import schedules

MODEL = ["model.n_layers=8", "model.layer_pattern=[sliding,global]"]


def test_every_configurable_schedule_is_a_named_object():
    assert set(schedules.SCHEDULES) == {"gpipe", "circular", "1f1b", "interleaved_1f1b"}
    for name, kind in schedules.SCHEDULES.items():
        sched = schedules.schedule_for(load_config("tiny", [*MODEL, "mesh.stage=2", f"impl.pipeline.schedule={name}",
                                                           "impl.pipeline.microbatches=4"]))
        assert type(sched) is kind and sched.name == name
        assert sched.loss_inside == name.endswith("1f1b")


@pytest.mark.parametrize("kind, repeats", [(schedules.GPipe, 1), (schedules.Circular, 2)])
def test_autodiff_schedules_tick_table_runs_each_pass_once_and_keeps_every_microbatch(kind, repeats):
    S, M = 4, 8
    sched = kind(S, M, repeats)
    table = sched.ticks()
    assert table.f_mb.shape == (sched.iterations, S) and (table.b_mb < 0).all()
    for s in range(S):
        ran = [(table.f_mb[t, s], table.f_rep[t, s]) for t in range(sched.iterations) if table.f_mb[t, s] >= 0]
        assert ran == [(m, r) for r in range(repeats) for m in range(M)]  # in order, from tick s on
        assert table.f_mb[s, s] == 0 and (table.f_mb[:s, s] < 0).all()
    assert sched.in_flight == table.slots == M


def test_1f1b_keeps_its_tick_tables_slots():
    sched = schedules.OneFOneB(4, 16, 1)
    assert sched.in_flight == sched.ticks().slots == 7 < sched.microbatches
    assert "up to 7 stage inputs kept per stage" in sched.describe()
    assert np.count_nonzero(sched.ticks().b_mb >= 0) == 4 * 16


@pytest.mark.parametrize("preset, overrides, message", [
    ("tiny_moe", ["model.dense_layers=2"], "use dense_layers 0 with mesh.stage > 1"),
    ("tiny_moe", ["impl.pipeline.schedule=1f1b", "model.moe.routing=random"], "runs learned routing"),
    ("tiny", ["impl.pipeline.schedule=interleaved_1f1b", "impl.pipeline.microbatches=3"], "not a multiple of mesh"),
])
def test_config_only_schedule_checks_end_a_command_before_it_starts(tmp_path, capsys, preset, overrides, message):
    run_dir = tmp_path / "run"
    args = [*MODEL, "mesh.stage=2", "mesh.fsdp=1", f"output_dir={run_dir}", *overrides]
    with pytest.raises(ConfigError, match=message):
        load_config(preset, args)
    for command in (["config", "show"], ["train"]):
        assert main([*command, preset, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not run_dir.exists()
