import re

import pytest

from olmax.config import ConfigError, dump, load_config, target_layout


def test_presets_resolve_and_7b_is_the_stage1_recipe():
    cfg = load_config("olmo3_7b")
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.mlp_hidden) == (4096, 32, 32, 11008)
    assert cfg.model.padded_vocab == 100352
    assert [cfg.model.is_global(i) for i in range(8)] == [False, False, False, True] * 2
    assert cfg.train.global_batch_instances * cfg.data.sequence_length == 4_194_304
    assert (cfg.optim.lr, cfg.optim.b1, cfg.optim.b2, cfg.optim.eps, cfg.optim.weight_decay) == (3e-4, 0.9, 0.95, 1e-8, 0.1)
    assert cfg.optim.no_decay == ["embed"] and cfg.optim.grad_clip == 1.0
    assert (cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.schedule.final_lr_fraction) == ("cosine", 2000, 0.1)
    assert cfg.loss.z_loss == 1e-5 and cfg.data.seed == 34521
    assert cfg.optim.skip_step.window == 128 and cfg.optim.skip_step.min_values == 64
    assert load_config("olmo3_32b").model.kv_heads == 8
    for name in ("olmo3_1b", "tiny"):
        load_config(name)


def test_overrides_and_show_roundtrip():
    cfg = load_config("tiny", ["train.steps=7", "model.layer_pattern=[global]", "optim.no_decay=[embed, lm_head]"])
    assert cfg.train.steps == 7 and cfg.model.layer_pattern == ["global"]
    assert "steps: 7" in dump(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'"),
        ("nonsense.x=1", "unknown config key 'nonsense.x'"),
        ("train.steps=abc", "train.steps"),
        ("train.steps=0", "train.steps"),
        ("model.n_heads=3", "not divisible by n_heads"),
        ("model.n_kv_heads=3", "multiple of n_kv_heads"),
        ("model.n_layers=6", "layer_pattern"),
        ("impl.remat=[qkv, context]", "unknown names ['qkv']"),
        ("model.rope.global.type=yarn", "yarn needs factor"),
        ("model.layer_pattern=[sliding, global, local]", "model.layer_pattern"),
        ("mesh.rules.batch=[data, fsdb]", "not mesh axes"),
        ("data.eos_id=9999", "data.eos_id"),
        ("schedule.kind=wsd", "decay_steps"),
        ("optim.moment_dtype=bfloat16", "bfloat16 Adam moments"),
        ("model.param_dtype=bfloat16", "bfloat16 Adam moments"),
        ("trainsteps", "section.key=value"),
    ],
)
def test_bad_config_names_the_field(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config("tiny", [override])
    assert message in str(err.value)


def test_bf16_moments_only_when_asked_for():
    cfg = load_config("tiny", ["optim.moment_dtype=bfloat16", "optim.allow_low_precision_moments=true"])
    assert cfg.optim.moment_dtype == "bfloat16"


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="olmo3_7b"):
        load_config("olmo4")


@pytest.mark.parametrize("old, new", [
    ("model.remat_save=full", "impl.remat"),
    ("model.compute_dtype=float32", "impl.compute_dtype"),
    ("model.attention_block=64", "impl.attention.block"),
    ("model.scan_layers=false", "impl.scan_layers"),
    ("model.rope_theta=10000", "model.rope.global.theta"),
    ("impl.moe_dispatch=ragged_dot", "impl.moe.dispatch"),
    ("impl.moe_block=32", "impl.moe.block"),
    ("impl.moe_ep_capacity=1.5", "impl.moe.ep_capacity"),
])
def test_moved_keys_name_their_new_place(old, new, tmp_path):
    with pytest.raises(ConfigError, match="moved") as err:
        load_config("tiny", [old])
    assert new in str(err.value)
    key, value = old.split("=")
    section, field = key.split(".")
    (tmp_path / "old.yaml").write_text(f"base: tiny\n{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError, match=new.replace(".", r"\.")):
        load_config(str(tmp_path / "old.yaml"))


def test_model_is_architecture_and_impl_how_it_runs():
    """Everything in `model` changes the function (a resume checks it); `impl` holds what does not."""
    from olmax.config import ImplConfig, ModelConfig

    assert {"compute_dtype", "remat", "attention", "scan_layers", "loss_chunk"} <= set(ImplConfig.model_fields)
    assert not {"compute_dtype", "remat_save", "attention_block", "scan_layers"} & set(ModelConfig.model_fields)
    cfg = load_config("olmo3_7b")
    assert cfg.impl.remat == ["qkv_proj", "out_proj", "mlpwo", "context"]
    assert {k: (r.type, r.theta) for k, r in cfg.model.rope.items()} == {"sliding": ("default", 5e5),
                                                                         "global": ("default", 5e5)}
    assert cfg.mesh.rules["batch"] == ["data", "fsdp", "expert"]


def test_upgrade_moves_old_checkpoint_configs():
    from olmax.config import upgrade, validate

    old = {"model": {"d_model": 64, "rope_theta": 1e4, "remat_save": "full", "attention_block": 16,
                     "compute_dtype": "float32", "scan_layers": False},
           "impl": {"moe_dispatch": "ragged_dot", "moe_block": 32, "moe_ep_capacity": 1.5}}
    cfg = validate(upgrade(old))
    assert (cfg.impl.moe.dispatch, cfg.impl.moe.block, cfg.impl.moe.ep_capacity) == ("ragged_dot", 32, 1.5)
    assert cfg.model.rope["sliding"].theta == cfg.model.rope["global"].theta == 1e4
    assert (cfg.impl.remat, cfg.impl.attention.block, cfg.impl.compute_dtype, cfg.impl.scan_layers) == (
        "full", 16, "float32", False)


@pytest.mark.parametrize("text, key, lines", [
    ("base: tiny\nmodel:\n  n_layers: 8\ntrain:\n  steps: 3\nmodel:\n  d_model: 128\n", "model", (2, 6)),
    ("base: tiny\nmodel:\n  n_layers: 8\n  d_model: 32\n  n_layers: 2\n", "n_layers", (3, 5)),
])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, capsys, text, key, lines):
    from olmax.cli import main

    (tmp_path / "twice.yaml").write_text(text)
    assert main(["train", str(tmp_path / "twice.yaml"), f"output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert f"key {key!r} is given twice, on lines {lines[0]} and {lines[1]}" in err and "twice.yaml" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", "nan"])
def test_every_float_must_be_finite(tmp_path, capsys, value):
    from olmax.cli import main

    assert main(["train", "tiny", f"optim.lr={value}", f"output_dir={tmp_path}/run"]) == 2
    assert "optim.lr: Input should be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="schedule.final_lr_fraction: Input should be a finite number"):
        load_config("tiny", [f"schedule.final_lr_fraction={value}"])


@pytest.mark.parametrize("config, overrides, message", [
    ("tiny_moe", ["model.moe.num_experts=6", "mesh.expert=4"],
     "model.moe.num_experts 6 do not divide over mesh.expert 4"),
    # refused after 38 s of start-up, the run directory made
    ("tiny_moe", ["impl.moe.dispatch=grouped"],
     "impl.moe.dispatch=grouped: its kernels are for NVIDIA GPUs, and this layout's devices are CPUs"),
    ("tiny", ["impl.batch_split=0"], "impl.batch_split: Input should be greater than or equal to 1"),
    ("tiny", ["impl.batch_split=3"], "instances per device do not split into impl.batch_split 3 parts; make "
     "train.micro_batch_per_device a multiple of it or lower impl.batch_split"),
    ("tiny", ["train.steps=3000000000"], "train.steps: Input should be less than or equal to 2147483647"),
    ("tiny", ["output_dir={run}/{{foo}}"], "output_dir: the one placeholder is {{name}}, the run's name, as it is"),
    # str.format reached the name's attributes, or padded it (an AttributeError traceback, a docstring in the path)
    *[("tiny", [f"output_dir={{run}}/{{{{{field}}}}}"], "output_dir: the one placeholder is {{name}}")
      for field in ("name.foo", "name.__doc__", "name:>300", "name!r", "0", "")],
    *[("tiny", ["output_dir={run}", f"launch.records_dir={{run}}/{{{{{field}}}}}"],
       "launch.records_dir: the one placeholder is {{name}}") for field in ("name.foo", "name.__doc__", "name:>300")],
    ("tiny", ["name=" + "n" * 300, "output_dir={run}/{{name}}"], "is 300 bytes, over the 255 a name in a path"),
    ("tiny", ["output_dir={run}/" + "n" * 300], "is 300 bytes, over the 255 a name in a path can have"),
    ("tiny", ["output_dir={run}", "launch.records_dir=" + "/x" * 2100], "is 4200 bytes, over the 4096 of a path"),
    ("tiny", ['name="a\\u0000b"'], "name holds a NUL byte, which no name or path can hold"),
    ("tiny", ['output_dir="{run}\\u0000"'], "output_dir holds a NUL byte"),
    ("tiny", ['data.paths=["a", "b\\u0000"]'], "data.paths[1] holds a NUL byte"),
    ("tiny", ["train.seed=99999999999999999999"], "train.seed: Input should be less than 9223372036854775808"),
    ("tiny", ["data.seed=-1"], "data.seed: Input should be greater than or equal to 0"),
    ("tiny", ["train.hang_timeout=1e300"], "train.hang_timeout: Input should be less than or equal to 604800"),
    ("tiny", ["train.hang_timeout=1e-9"], "train.hang_timeout: Input should be greater than or equal to 10"),
    ("{tmp}/a.yaml", [], ("config files name each other as base in a cycle ({tmp}/a.yaml -> {tmp}/b.yaml -> "
                          "{tmp}/a.yaml)")),
])
def test_configs_that_cannot_run_are_refused_before_anything_is_written(tmp_path, capsys, config, overrides, message):
    from olmax.cli import main

    (tmp_path / "a.yaml").write_text(f"base: {tmp_path}/b.yaml\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path}/a.yaml\n")
    fill = {"tmp": tmp_path, "run": tmp_path / "run"}
    argv = ["train", config.format(**fill), *[o.format(**fill) for o in overrides]]
    if not any(o.startswith("output_dir") for o in overrides):
        argv.append(f"output_dir={tmp_path}/run")
    assert main(argv) == 2
    assert message.format(**fill) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_layout_applies_on_its_target_beneath_the_command_line(tmp_path, capsys):
    """`layouts:` lays a preset out for given devices: on them it is the preset's settings, command-line
    overrides still win, other targets and no target keep the preset's own; a file based on the preset inherits it."""
    laid_out = load_config("olmo3_moe_47b", target="gpu:b300x8")
    assert (laid_out.mesh.expert, laid_out.mesh.fsdp, laid_out.mesh.rules["embed"]) == (8, 1, ["fsdp", "expert"])
    assert laid_out.train.micro_batch_per_device == 2 and laid_out.impl.moe.ep_buffer == 1.25
    assert laid_out.impl.moe.ep_capacity is None and laid_out.impl.scan_layers is False
    assert laid_out.impl.logits_grad == "compute" and load_config("olmo3_moe_47b").impl.logits_grad == "float32"
    assert laid_out.train.global_batch_instances == load_config("olmo3_moe_47b").train.global_batch_instances
    for target in (None, "gpu:b300x16", "gpu:b200x8", "tpu:v5p:4x4x4"):
        assert load_config("olmo3_moe_47b", target=target).mesh.expert == 1
    assert load_config("olmo3_moe_47b", ["mesh.expert=4", "mesh.fsdp=2"], target="gpu:b300x8").mesh.expert == 4
    child = tmp_path / "child.yaml"
    child.write_text("base: olmo3_moe_47b\nname: child\nlayouts:\n  gpu:b300x8: {train: {micro_batch_per_device: 4}}\n")
    assert load_config(str(child), target="gpu:b300x8").train.micro_batch_per_device == 4
    assert load_config(str(child), target="gpu:b300x8").mesh.expert == 8
    assert target_layout("olmo3_moe_47b", "gpu:b300x8")[1][:2] == ["mesh.expert=8", "mesh.fsdp=1"]
    assert target_layout("tiny", "gpu:b300x8") is None

    from olmax.cli import main

    assert main(["config", "show", "olmo3_moe_47b", "--target", "gpu:b300x8"]) == 0
    assert "  expert: 8\n" in capsys.readouterr().out


@pytest.mark.parametrize("layouts, message", [
    ("  gpu:b300x8: {mesh: {experts: 8}}", "layouts.gpu:b300x8: unknown config key 'mesh.experts'"),
    ("  gpu:b300x8: 8", "layouts must map a target (gpu:b300x8, tpu:v5p:*) to sections of settings"),
    ("  gpu:b300x8: {optim: {lr: 0.1}}", "layouts.gpu:b300x8: optim.lr is not a layout setting (those are mesh.*, "
     "impl.*, train.micro_batch_per_device, eval.batch_instances)"),
    ("  gpu:*: {mesh: {data: 2}}\n  gpu:b300x*: {mesh: {data: 4}}", "layouts ['gpu:*', 'gpu:b300x*'] all match target "
     "gpu:b300x8; narrow them to one"),
])
def test_bad_layouts_are_named(tmp_path, layouts, message):
    config = tmp_path / "bad.yaml"
    config.write_text(f"base: tiny\nlayouts:\n{layouts}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(config), target="gpu:b300x8")


@pytest.mark.parametrize("name, overrides, message", [
    ("tinyy", [], "no preset 'tinyy' (did you mean tiny?)"),
    ("tiny", ["steps=10"], "unknown config key 'steps' (did you mean train.steps?)"),
    ("tiny", ["train.step=10"], "unknown config key 'train.step' (did you mean train.steps"),
    ("tiny", ["optim.lr_=3e-4"], "unknown config key 'optim.lr_' (did you mean optim.lr?)"),
])
def test_a_misspelt_preset_or_key_is_answered_with_what_was_meant(name, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(name, overrides)
