import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from olmo_core.optim.skip_step_optimizer import SkipStepOptimizer

from olmax.config import load_config
from olmax.train.optimizer import adam_count, build_optimizer, decay_mask, lr_at, with_lr

PARAMS = {"embed": jnp.ones((4, 2)), "blocks": {"w1": jnp.ones((3, 2))}, "lm_head": jnp.ones((2, 4))}


def _run(losses, norms, window=128, min_values=64):
    """Skip decisions of our optimizer for given CE losses and gradient norms (grads scaled to the norm)."""
    cfg = load_config("tiny", [f"optim.skip_step.window={window}", f"optim.skip_step.min_values={min_values}"]).optim
    opt = build_optimizer(cfg, PARAMS)
    state = opt.init(PARAMS)
    unit = jax.tree.map(lambda p: p / optax.tree.norm(PARAMS), PARAMS)
    update = jax.jit(lambda s, g, loss, lr: opt.update(g, with_lr(s, lr), PARAMS, loss=loss))
    skipped, counts = [], []
    for loss, norm in zip(losses, norms):
        grads = jax.tree.map(lambda u: u * norm, unit)
        _, state = update(state, grads, loss, 1e-3)
        skipped.append(bool(state.skipped))
        counts.append(int(adam_count(state)))
    return skipped, counts, state


def _olmo_core(losses, norms, window=128):
    opt = SkipStepOptimizer([torch.zeros(1)], {}, rolling_interval_length=window, sigma_factor=6)
    out = []
    for loss, norm in zip(losses, norms):
        opt.latest_loss = torch.tensor(loss, dtype=torch.float32)
        opt.latest_grad_norm = torch.tensor(norm, dtype=torch.float32)
        out.append(bool(opt.step_skipped))
    return out


def test_skip_decisions_match_olmo_core_on_spiky_sequences():
    rng = np.random.default_rng(0)
    losses = list(3.0 + 0.01 * rng.standard_normal(300))
    norms = list(1.0 + 0.05 * rng.standard_normal(300))
    for i in (20, 63, 64, 90, 150, 151, 260):  # spikes before, at and after the check starts, back to back
        losses[i] += 1.0
    for i in (40, 100, 200):
        norms[i] *= 5
    ours, _, _ = _run(losses, norms)
    assert ours == _olmo_core(losses, norms)
    assert not any(ours[:63]), "no check before the window holds 64 values"
    # 64, 90 and 151 pass: the spikes just before them are in the window and widen its std.
    assert [i for i, skip in enumerate(ours) if skip] == [63, 100, 150, 200, 260]


def test_skipped_step_keeps_moments_and_adam_count_but_lr_schedule_advances():
    losses = [2.0 + 0.01 * (i % 3) for i in range(70)] + [50.0, 2.0]
    norms = [1.0] * 72
    skipped, counts, _ = _run(losses, norms)
    assert skipped[70] and not skipped[71]
    assert counts[69] == 70 and counts[70] == 70 and counts[71] == 71
    sched = load_config("tiny").schedule
    lrs = [float(lr_at(sched, 1.0, 100, s)) for s in (70, 71, 72)]
    assert lrs[0] != lrs[1] != lrs[2], "the LR is a function of the trainer step, skipped or not"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_always_skipped_and_not_recorded(bad):
    losses = [2.0, 2.1, bad, 2.0] + [2.0 + 0.01 * (i % 5) for i in range(80)]
    norms = [1.0] * len(losses)
    skipped, counts, state = _run(losses, norms)
    assert skipped[2] and not any(skipped[:2]) and not any(skipped[3:])
    assert counts[2] == 2 and counts[-1] == len(losses) - 1
    assert int(state.filled) == min(len(losses) - 1, 128)
    norms[5] = bad
    skipped, _, _ = _run(losses, norms)
    assert skipped[5]


def test_moments_unchanged_by_skipped_step():
    opt = build_optimizer(load_config("tiny").optim, PARAMS)
    state = opt.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    _, state = opt.update(grads, with_lr(state, 1e-3), PARAMS, loss=jnp.float32(1.0))
    updates, after = opt.update(grads, with_lr(state, 1e-3), PARAMS, loss=jnp.float32(jnp.nan))
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(state.inner), jax.tree.leaves(after.inner)):
        np.testing.assert_array_equal(a, b)


def test_weight_decay_mask_excludes_only_the_embedding():
    mask = decay_mask(PARAMS, ["embed"])
    assert mask == {"embed": False, "blocks": {"w1": True}, "lm_head": True}


def test_decoupled_weight_decay_matches_torch_adamw():
    cfg = load_config("tiny").optim
    opt = build_optimizer(cfg, PARAMS)
    state = opt.init(PARAMS)
    rng = np.random.default_rng(1)
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), PARAMS) for _ in range(3)]
    params = PARAMS
    w = torch.nn.Parameter(torch.tensor(np.asarray(PARAMS["lm_head"])))
    torch_opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for grads in grads_seq:
        clipped_scale = min(1.0, 1.0 / float(optax.tree.norm(grads)))
        updates, state = opt.update(grads, with_lr(state, 1e-2), params, loss=jnp.float32(1.0))
        params = optax.apply_updates(params, updates)
        w.grad = torch.tensor(np.asarray(grads["lm_head"])) * clipped_scale
        torch_opt.step()
    np.testing.assert_allclose(np.asarray(params["lm_head"]), w.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_schedules():
    def lr(kind, step, **kw):
        overrides = [f"schedule.kind={kind}", "schedule.warmup_steps=10"] + [f"schedule.{k}={v}" for k, v in kw.items()]
        return float(lr_at(load_config("tiny", overrides).schedule, 1.0, 110, step))

    assert lr("cosine", 1) == pytest.approx(0.1) and lr("cosine", 10) == pytest.approx(1.0)
    assert lr("cosine", 60) == pytest.approx(0.55) and lr("cosine", 110) == pytest.approx(0.1)
    assert lr("linear", 60, final_lr_fraction=0) == pytest.approx(0.5)
    assert lr("wsd", 50, decay_steps=20) == 1.0 and lr("wsd", 100, decay_steps=20) == pytest.approx(0.55)
    assert lr("constant", 100) == 1.0
    assert float(lr_at(load_config("tiny", ["schedule.warmup_steps=0", "schedule.kind=linear",
                                            "schedule.final_lr_fraction=0"]).schedule, 2.0712e-4, 47684, 0)) == pytest.approx(2.0712e-4)
