"""`olmax tune` on a small target: the pruning rule, the search order, a rerun that compiles nothing new, and the
written layout, which trains and compiles to the layout the table reported."""

import json
import threading

import pytest

from olmax.cli import main
from olmax.config import load_config
from olmax.parallel import schedules
from olmax.scale.cli import format_compile
from olmax.scale import targets, tune, tune_depth, tune_estimate, tune_space, tune_text
from olmax.scale.targets import aot_missing, parse_target
from test_scale_report import check_rendered, chromium  # noqa: F401 (chromium: a fixture)

needs_tpu = pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))
MESH = (("data", 1), ("fsdp", 8), ("tensor", 1), ("expert", 1), ("stage", 1))


def candidate(saved, micro=2, mesh=MESH, tiles=None, flags=False):
    return tune_space.Candidate(mesh, frozenset(saved), micro, tiles, flags)


def test_a_layout_that_keeps_more_than_one_out_of_memory_is_out_of_memory_too():
    oom = candidate({"qkv_proj", "context"}, micro=2)
    assert tune_space.pruned_by(candidate({"qkv_proj", "context", "mlpwo"}, micro=2), [oom]) == oom  # saves a superset
    assert tune_space.pruned_by(candidate({"qkv_proj", "context"}, micro=4), [oom]) == oom  # a larger micro-batch
    assert tune_space.pruned_by(candidate(tune_space.EVERYTHING, micro=2), [oom]) == oom  # remat none keeps everything
    # other Splash tiles change only what the cores' VMEM holds: out of memory as well
    assert tune_space.pruned_by(candidate({"qkv_proj", "context", "mlpwo"}, tiles=1024), [oom]) == oom
    # keeping less, or the same on another mesh or with other flags, is not proven out of memory
    assert tune_space.pruned_by(candidate({"qkv_proj"}, micro=2), [oom]) is None
    assert tune_space.pruned_by(candidate({"qkv_proj", "context"}, micro=1), [oom]) is None
    other = (("data", 2), ("fsdp", 4), ("tensor", 1), ("expert", 1), ("stage", 1))
    assert tune_space.pruned_by(candidate({"qkv_proj", "context", "mlpwo"}, mesh=other), [oom]) is None
    assert tune_space.pruned_by(candidate({"qkv_proj", "context", "mlpwo"}, flags=True), [oom]) is None
    # its optimizer state sharded (ZeRO-1) holds less than it whole; another pipeline schedule is another layout
    sharded = tune_space.Candidate(MESH, frozenset({"qkv_proj", "context"}), 2, None, False, zero1=True)
    assert tune_space.pruned_by(candidate({"qkv_proj", "context", "mlpwo"}), [sharded]) == sharded
    assert tune_space.pruned_by(sharded, [oom]) is None
    gpipe = tune_space.Candidate(MESH, frozenset({"qkv_proj", "context", "mlpwo"}), 2, None, False, ("gpipe", 2, None))
    assert tune_space.pruned_by(gpipe, [oom]) is None


def test_the_space_covers_remat_meshes_and_micro_batches_and_the_order_sees_many_meshes_first():
    cfg, target = load_config("tiny"), parse_target("tpu:v5p:2x2x2")
    space = tune_space.space(cfg, target)
    assert {c.remat if isinstance(c.remat, str) else "some" for c in space} == {"none", "full", "some"}
    assert len({c.saved for c in space}) == 2 ** len(tune_space.NAMED) + 1
    meshes = {c.mesh for c in space}
    # 8 devices over data x fsdp, tensor parallelism up to tiny's 2 KV heads
    assert {dict(m)["tensor"] for m in meshes} == {1, 2}
    assert all(dict(m)["data"] * dict(m)["fsdp"] * dict(m)["tensor"] == 8 for m in meshes)
    assert {c.micro_batch for c in space if dict(c.mesh)["fsdp"] == 8} == {1, 2}  # 16 instances over 8: 2 a device
    estimate = tune_estimate.Estimate(cfg, target)
    key = lambda c: tune.priority(*estimate(c), target.accelerator.memory_per_device)  # noqa: E731
    order = tune.ordered(space, key)
    assert sorted(order, key=id) == sorted(space, key=id) and len(set(order)) == len(space)
    first = order[:8]
    assert len({(c.mesh, c.micro_batch) for c in first}) >= 4
    # the search orders what is left again after each compile: a mesh not compiled yet, and the estimate's best,
    # take turns (it reordered by the estimate alone, so with one compile at a time it stayed on one mesh)
    tried = {(order[0].mesh, order[0].micro_batch)}
    assert tune.ordered(space, key, tried)[0].mesh != order[0].mesh
    assert tune.ordered(space, key, tried, leader_first=False)[0] == sorted(space, key=key)[0]


def test_an_moes_memory_estimate_holds_its_experts_where_the_mesh_puts_them():
    """The quick estimate split an MoE's parameters and optimizer state over every sharded axis, but its experts
    are sharded over the expert (and stage) axis only: a mesh with fewer expert-parallel devices holds more of them
    (the 1.2T's search compiled 24 candidates, all out of memory at 448-7,266 GiB a device, estimated far lower).
    The parameters the estimate puts on a device are those the train step's state holds there, on meshes that
    place the experts differently; with the experts on fewer devices, the estimate grows by their state."""
    import jax

    from olmax.parallel.mesh import make_layout
    from olmax.scale.compile import device_bytes
    from olmax.train.step import abstract_state

    target = parse_target("tpu:v5p:2x2x2")
    base = load_config("tiny_moe", ["model.moe.num_experts=64", "model.moe.expert_hidden=512"], target.name)
    estimate = tune_estimate.Estimate(base, target)
    held = {}
    for fsdp, tensor, expert in ((8, 1, 1), (1, 1, 8), (2, 1, 4), (2, 2, 2)):
        mesh = {"data": 1, "fsdp": fsdp, "tensor": tensor, "expert": expert, "stage": 1}
        cfg = base.model_copy(update={"mesh": base.mesh.model_copy(update=mesh)})
        params = device_bytes(abstract_state(cfg, make_layout(cfg.mesh, jax.devices())).params)
        held[expert] = sum(estimate.held(mesh))
        assert 4 * held[expert] == params, mesh  # float32 parameters
    assert held[1] > 6 * held[8]  # the experts are most of it
    one, eight = (tune_space.Candidate(tuple(mesh.items()), frozenset(), 2, None, False)
                  for mesh in ({"data": 1, "fsdp": 8, "tensor": 1, "expert": 1, "stage": 1},
                               {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8, "stage": 1}))
    assert estimate(one)[1] - estimate(eight)[1] >= 16 * (held[1] - held[8])  # their gradients and moments too


def test_candidates_estimated_over_memory_are_tried_least_memory_first():
    """The 1.2T MoE's search took its candidates estimated over memory fastest first, which are those that keep
    the most, and spent its budget on layouts 6-90 times a device's memory. With every candidate over memory (the
    compiles said twice the estimate), the search's first is the one closest to fitting: the preset's own layout,
    which fits (expert 64 x stage 8, remat full, micro-batch 8: 77.56 GiB, BENCHMARKS.md)."""
    target = parse_target("tpu:v5p:8x8x8")
    cfg = load_config("olmo_moe_1t", [], target.name)
    space, estimate = tune_space.space(cfg, target), tune_estimate.Estimate(cfg, target)
    estimates = {c: estimate(c) for c in space}
    memory = target.accelerator.memory_per_device

    def key(c):
        seconds, bytes_ = estimates[c]
        return tune.priority(seconds, 2 * bytes_, memory)

    first = tune.ordered(space, key)[0]
    assert key(first)[0], "over memory"
    assert dict(first.mesh) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 64, "stage": 8}
    assert (first.remat, first.micro_batch) == ("full", 8)
    # while some are estimated to fit, they all come before any estimated over memory (the meshes that need several
    # times a device's memory take no turns)
    fits = [not tune.priority(*estimates[c], 0.9 * memory)[0] for c in tune.ordered(
        space, lambda c: tune.priority(*estimates[c], 0.9 * memory))]
    assert 0 < sum(fits) < len(fits) and fits == sorted(fits, reverse=True)
    # what fits comes first, fastest first, whatever its memory
    assert tune.priority(1.0, memory, memory) < tune.priority(2.0, 0.5 * memory, memory) < tune.priority(
        0.5, 1.1 * memory, memory)


PIPELINED = ["model.n_layers=8", "model.layer_pattern=[sliding,global]", "mesh.stage=2", "mesh.fsdp=1",
             "impl.pipeline.microbatches=2"]


def test_the_search_varies_pipeline_stages_schedules_and_micro_batches_each_can_cut():
    """Pipeline stages (none, the config's, 2-16 dividing the depth's periods), every schedule with one and two
    micro-batches a stage and the circular ones' chunks join the space; every micro-batch a device runs splits
    into its pipeline's micro-batches (the 1.2T MoE's 8 stages and 8 micro-batches: the search tried
    micro-batches 1 and 2, each a ConfigError instead of a compile); each candidate's settings load."""
    cfg = load_config("tiny", PIPELINED)
    space = tune_space.space(cfg, parse_target("tpu:v5p:2x2x2"))
    settings: dict = {}
    for c in space:
        settings.setdefault(dict(c.mesh)["stage"], set()).add(c.pipeline)
        assert c.micro_batch % (c.pipeline[1] if c.pipeline else 1) == 0
    assert set(settings) == {1, 2, 4} and settings[1] == {None}
    assert {s[0] for s in settings[2]} == {"gpipe", "circular", "1f1b", "interleaved_1f1b"}
    assert {s[1] for s in settings[4]} == {4, 8} and ("circular", 4, 2) in settings[2]
    # ZeRO-1 where a parameter is replicated (a dense model's over data)
    assert {c.zero1 for c in space if dict(c.mesh)["data"] > 1} == {False, True}
    assert not any(c.zero1 for c in space if dict(c.mesh)["data"] == 1)
    for c in space[:: len(space) // 25]:
        loaded = load_config("tiny", [*PIPELINED, *c.overrides()])
        assert loaded.mesh.stage == dict(c.mesh)["stage"]
        assert c.pipeline is None or (c.pipeline[0], c.pipeline[1]) == (loaded.impl.pipeline.schedule,
                                                                       loaded.impl.pipeline.microbatches)
    # a random routing runs no 1F1B; a model with dense layers first no pipeline
    moe = load_config("tiny_moe", ["model.n_layers=16", "model.moe.routing=random"])
    assert {s[0] for s in tune_space.pipelines(moe, 2)} == {"gpipe", "circular"}
    assert tune_space.stages(load_config("tiny_moe", ["model.n_layers=8", "model.dense_layers=4"]), 8) == [1]


def test_a_depth_reduced_compile_runs_one_and_two_units_of_the_repeated_layers():
    """A unit is a layer_pattern period on each stage's each chunk (the schedule unchanged), after the dense
    layers; a stack under four units is compiled whole; a figure is extrapolated on the line through the two."""
    assert tune_depth.depths(load_config("tiny", ["model.n_layers=16"])) == (4, 8)
    assert tune_depth.depths(load_config("tiny", ["model.n_layers=12"])) is None
    moe = load_config("tiny_moe", ["model.n_layers=20", "model.dense_layers=4"])
    assert tune_depth.depths(moe) == (8, 12)
    circular = load_config("tiny", ["model.n_layers=64", "mesh.stage=2", "mesh.fsdp=1",
                                    "impl.pipeline.schedule=circular", "impl.pipeline.microbatches=2"])
    assert tune_depth.depths(circular) is None  # 8 chunks of 4 layers: one unit is 32
    two = load_config("tiny", ["model.n_layers=64", "mesh.stage=2", "mesh.fsdp=1", "impl.pipeline.schedule=circular",
                               "impl.pipeline.microbatches=2", "impl.pipeline.repeats=2"])
    assert tune_depth.depths(two) == (16, 32)
    reduced = tune_depth.at_depth(two, 16)
    assert reduced.model.n_layers == 16 and schedules.schedule_for(reduced).repeats == 2
    assert tune_depth.extrapolated(64, (16, 32), [10.0, 14.0]) == 22.0 and tune_depth.extrapolated(64, None, [3.0]) == 3.0
    assert tune_depth.trusted({"peak": 0.049, "step": -0.05}) and not tune_depth.trusted({"peak": 0.051, "step": 0.0})


@needs_tpu
def test_a_depth_reduced_search_confirms_its_best_by_a_full_compile(capsys):
    """`--depth reduced`: the candidate is compiled at 4 and 8 of its 20 layers (5 periods of the pattern: no
    pipeline stages divide them and the 8 devices), said to fit, and confirmed whole (the first one the
    extrapolation says fits: the check that decides whether the rest may be extrapolated); the report keeps the
    extrapolation's error beside the full compile's figures."""
    args = ["tune", "tiny", "model.n_layers=20", "--target", "tpu:v5p:2x2x2", "--budget", "1", "--jobs", "1",
            "--depth", "reduced", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    best = json.loads(out)["results"][0]
    assert best["status"] == "fits" and best["extrapolated_from"] is None
    assert set(best["extrapolation_error"]) == {"peak", "step"}
    assert "extrapolated from 4 and 8 layers" in err and "confirmed: fits" in err
    missed = max(abs(e) for e in best["extrapolation_error"].values())
    assert ("the rest of the search compiles whole layouts" in err) == (missed > tune_depth.TRUSTED)


def test_a_setting_given_on_the_command_line_is_not_searched(capsys, monkeypatch):
    """`olmax tune CONFIG mesh.expert=8 impl.remat=none` searches the layouts with 8-way expert parallelism and
    nothing recomputed only (it searched every mesh and policy, and the winner overrode what was given); a setting
    no layout agrees with is refused before any compile, and before a missing aot-gpu extra is named (which hid it
    where the extra is not installed)."""
    monkeypatch.setattr(targets, "aot_missing", lambda platform: "the aot-gpu extra is not installed")
    cfg, target = load_config("tiny_moe"), parse_target("gpu:b300x8")
    space = tune_space.space(cfg, target)
    kept = tune_space.given(space, ["mesh.expert=8", "impl.remat=none", "optim.lr=0.1"])
    assert kept and {dict(c.mesh)["expert"] for c in kept} == {8} and {c.remat for c in kept} == {"none"}
    assert set(kept) == {c for c in space if dict(c.mesh)["expert"] == 8 and c.saved == tune_space.EVERYTHING}
    assert tune_space.given(space, ["impl.remat=[qkv_proj, context]"]) == [c for c in space if c.saved == {"qkv_proj",
                                                                                                      "context"}]
    assert main(["tune", "tiny_moe", "--target", "gpu:b300x8", "mesh.expert=8", "mesh.fsdp=2"]) == 2
    err = capsys.readouterr().err
    assert "no layout of the target agrees with mesh.expert=8, mesh.fsdp=2" in err and len(err.strip().splitlines()) == 1, err


def test_tune_refuses_an_out_or_report_it_would_overwrite_or_cannot_write_before_searching(tmp_path, capsys):
    """`--out RUN/metrics.jsonl` (or a link to it) was replaced with the layout's YAML after the search, exit 0; an
    --out in a directory that cannot be made failed with a traceback after every compile; a --report page's files
    were written through links. Each is one line and exit 2 now, before anything is compiled."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train/loss": 3.5}\n')
    (tmp_path / "link.yaml").symlink_to(metrics)
    (tmp_path / "page").mkdir()
    (tmp_path / "page" / "index.html").symlink_to(metrics)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("<p>someone's page</p>")
    (tmp_path / "linked").symlink_to(tmp_path / "site")
    tune_args = ["tune", "tiny", "--target", "tpu:v5p:2x2x2", "--budget", "1", "--jobs", "1"]
    for option, value, why in [("--out", metrics, "a file is there already"),
                               ("--out", tmp_path / "link.yaml", "a symbolic link is there already"),
                               ("--out", metrics / "best.yaml", "is a file, not a directory"),
                               # written in its directory opened through no link: refused after the search before
                               ("--out", tmp_path / "linked" / "best.yaml", f"{tmp_path / 'linked'} is a symbolic link"),
                               ("--report", tmp_path / "linked", f"{tmp_path / 'linked'} is a symbolic link"),
                               ("--report", tmp_path / "page", "its index.html is a symbolic link"),
                               ("--report", tmp_path / "site", "an index.html with no report.json beside it")]:
        assert main([*tune_args, option, str(value)]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
    assert metrics.read_text() == '{"step": 1, "train/loss": 3.5}\n'
    assert (tmp_path / "site" / "index.html").read_text() == "<p>someone's page</p>"


@pytest.mark.parametrize("config, given, target", [
    # settings given on the command line, a pipelined best (the file was refused: 4 layers over 2 stages)
    ("tiny", ["model.n_layers=16", "impl.loss_chunk=null", "mesh.stage=2"], "tpu:v5p:2x2x2"),
    # a config whose layout for the target sets what the search changed: it would apply over the file
    ("olmo3_moe_47b", ["mesh.expert=8"], "gpu:b300x8"),
])
def test_the_written_layout_is_the_whole_program_ranked(tmp_path, config, given, target):
    """`olmax tune tiny model.n_layers=16 mesh.stage=1 impl.loss_chunk=null --out best.yaml` wrote `base: tiny` and
    the searched layout only: `olmax train best.yaml` trained 4 layers with the loss in chunks, another program
    than the one ranked. The file is now that program's whole config: as the config, and merged over the config
    tuned, it loads to exactly what was compiled."""
    target = parse_target(target)
    space = tune_space.given(tune_space.space(load_config(config, given, target.name), target), given)
    layout = load_config(config, [], target.name)
    best = next(c for c in space if c.remat != layout.impl.remat and c.micro_batch != layout.train.micro_batch_per_device)
    search = tune.Search([tune.Result(best, "fits", peak=2**30, step_seconds=1.0, mfu=0.5)])
    (tmp_path / "best.yaml").write_text(tune_text.overlay(config, given, search, target))
    ranked = load_config(config, [*given, *best.overrides()], target.name)
    assert load_config(str(tmp_path / "best.yaml"), [], target.name) == ranked
    assert load_config(config, [str(tmp_path / "best.yaml")], target.name) == ranked
    assert ranked.impl.remat == best.remat and (config != "tiny" or ranked.model.n_layers == 16)


def test_a_depth_reduced_search_says_why_it_compiled_a_layout_whole():
    """`tune --depth reduced` on pipelined candidates said "0 by depth-reduced compiles", and its rows nothing of
    how each was found: each row compiled whole says why, and so does the count."""
    space = tune_space.space(load_config("tiny", PIPELINED), parse_target("tpu:v5p:2x2x2"))
    results = [tune.Result(space[0], "fits", peak=2**30, step_seconds=1.0, mfu=0.5, whole=tune.SHALLOW),
               tune.Result(space[1], "fits", peak=2**30, step_seconds=2.0, mfu=0.4, depths=(4, 8))]
    search = tune.Search(results, size=len(space), reduced=True)
    rows = tune_text.table(search, parse_target("tpu:v5p:2x2x2")).splitlines()[1:]
    assert rows[0].endswith("(compiled whole: its repeated layers are under 4 units deep (a unit: a layer_pattern "
                            "period on each stage and chunk))")
    assert rows[1].endswith("(extrapolated from 4 and 8 layers)")
    assert ("1 by depth-reduced compiles; 1 compiled whole as its repeated layers are under 4 units deep"
            in tune_text.coverage(search))
    assert [r.row()["compiled_whole_because"] for r in search.ranked()] == [tune.SHALLOW, None]
    assert "depth-reduced" not in tune_text.coverage(tune.Search(results[:1], size=len(space)))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tune")
    # settings given on the command line, which the written layout keeps
    args = ["tune", "tiny", "model.n_layers=8", "impl.loss_chunk=null", "--target", "tpu:v5p:2x2x2", "--budget", "3",
            "--jobs", "1", "--json"]
    return directory, args


@needs_tpu
def test_tune_ranks_what_it_compiled_and_a_rerun_compiles_nothing_new(tuned, capsys, chromium, tmp_path):
    directory, args = tuned
    assert main([*args, "--out", str(directory / "best.yaml"), "--report", str(directory / "page")]) == 0
    first = json.loads(capsys.readouterr().out)
    compiled = [r for r in first["results"] if r["status"] != "pruned"]
    # (compiled now, or by an earlier run into the suite's compile cache)
    assert len(compiled) == 3 and first["space"] > 100
    # the estimate's best and the best of a mesh not tried yet take turns: by the third, a second mesh
    assert len({r["layout"].split(";")[0] for r in compiled}) >= 2, "a mesh not tried yet takes every other turn"
    fitting = [r for r in compiled if r["status"] == "fits"]
    assert fitting and fitting == sorted(fitting, key=lambda r: r["step_seconds"])
    assert first["results"][0]["status"] == "fits"
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["compiled"] == 0 and all(r["cached"] for r in again["results"] if r["status"] != "pruned")
    assert [r["layout"] for r in again["results"]] == [r["layout"] for r in first["results"]]
    # the page: every compiled layout a point on the chart of speed against memory, its figures the report's
    report, facts = check_rendered(chromium, directory / "page" / "index.html", tmp_path)
    assert facts.sections == ["chart", "candidates"]
    assert (directory / "page" / "index.html").read_text().count('class="candidate fits"') == len(fitting)


@needs_tpu
def test_the_written_layout_trains_and_compiles_to_the_layout_reported(tuned, capsys, synth_mix, tmp_path):
    directory, args = tuned
    best_file = directory / "best.yaml"
    if not best_file.exists():
        assert main([*args, "--out", str(best_file)]) == 0
        capsys.readouterr()
    assert main(args) == 0
    best = json.loads(capsys.readouterr().out)["results"][0]
    # merged over the config it was tuned for, and as the config itself, it is the program ranked (the settings
    # given included): the same compile (cached: the same program text, target and flags), the same prediction
    assert main(["compile", "tiny", str(best_file), "--target", "tpu:v5p:2x2x2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step_time"]["step_seconds"] == pytest.approx(best["step_seconds"])
    assert report["peak"] == best["peak"] and report["compile_cached"] and report["loss_chunk"] is None
    assert "loss on whole sequences, remat" in format_compile(report)  # it said "loss chunk None"
    assert main(["compile", str(best_file), "--target", "tpu:v5p:2x2x2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compile_cached"]
    assert load_config(str(best_file)).model.n_layers == 8
    overrides = dict(o.split("=", 1) for o in best["overrides"])
    assert report["mesh"] == {k.split(".")[1]: int(v) for k, v in overrides.items() if k.startswith("mesh.")}
    # and it trains: two steps on the suite's 8 devices, the file as the config itself (base: tiny)
    run = tmp_path / "run"
    assert main(["train", str(best_file), "train.steps=2", "checkpoint.every=2", f"data.mix_file={synth_mix}",
                 f"output_dir={run}"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 1
    # a layout file for another config is refused, naming both
    assert main(["train", "tiny_moe", str(best_file), f"output_dir={tmp_path}/other"]) == 2
    assert "has base tiny, not tiny_moe" in capsys.readouterr().err


@needs_tpu
def test_tune_says_at_once_what_it_searches_and_keeps_its_result_when_out_appears_during_it(tmp_path, monkeypatch,
                                                                                            capsys):
    """`olmax tune` printed nothing until its first compile had ended (32 s for the 7B), and with one job at a time
    nothing while a compile ran: its first lines say what it searches and which compile is under way, and a compile
    that goes on is said every TICK seconds (here the compile waits until that line has come). `--out FILE` where
    FILE appeared while the search ran was a FileExistsError traceback, the search's result lost: the results are
    printed and the report written, the file left as it is, the best layout printed (stderr) with one line saying
    where and why, exit 2."""
    out, searches, said = tmp_path / "best.yaml", [], threading.Event()

    def print_err(line: str) -> None:
        printed(line)
        if "still compiling" in line:
            said.set()

    def evaluate_once_said(*args):
        assert said.wait(timeout=60)  # a guard: the line comes after TICK seconds
        return evaluate(*args)

    def search_while_someone_writes_out(*args, **kwargs):
        searches.append(search(*args, **kwargs))
        out.write_text("someone's\n")
        return searches[-1]

    printed, evaluate, search = tune.print_err, tune.evaluate, tune.tune
    monkeypatch.setattr(tune, "TICK", 0.05, raising=False)
    monkeypatch.setattr(tune, "print_err", print_err)
    monkeypatch.setattr(tune, "evaluate", evaluate_once_said)
    monkeypatch.setattr(tune, "tune", search_while_someone_writes_out)
    args = ["tune", "tiny", "--target", "tpu:v5p:2x2x2", "--budget", "1", "--jobs", "1", "--json"]
    assert main([*args, "--out", str(out), "--report", str(tmp_path / "page")]) == 2
    captured = capsys.readouterr()
    (result,) = searches[0].results
    assert json.loads(captured.out)["results"][0]["status"] == result.status == "fits"
    err = captured.err.splitlines()
    assert err[0] == (f"olmax tune: searching {searches[0].size:,} layouts of tiny on tpu:v5p:2x2x2 (remat, mesh, "
                      "pipeline, ZeRO-1, micro-batch): up to 1 compiles, 1 at a time, the most promising first")
    assert err[1] == f"olmax tune: [0/1] compiling ({result.candidate.describe()})"
    assert err[2].startswith("olmax tune: [0/1] still compiling 1 candidate(s) (")
    assert out.read_text() == "someone's\n" and (tmp_path / "page" / "report.json").is_file()
    layout = tune_text.overlay("tiny", [], searches[0], parse_target("tpu:v5p:2x2x2"))
    assert f"olmax tune: the best layout, not written to {out}:\n{layout}" in captured.err
    assert err[-1] == (f"olmax: ConfigError: --out {out}: something appeared there during the search; the best layout "
                       "is printed above: save it to a new file")
