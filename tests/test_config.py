import pytest

from olmax.config import ConfigError, dump, load_config


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
        ("model.remat_save=[qkv, context]", "unknown names ['qkv']"),
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
