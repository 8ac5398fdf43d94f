"""olmax's train step against OLMo-core's own: its TransformerTrainModule (SkipStepAdamW, OLMo 3's weight-decay
exclusion, its cosine scheduler, z-loss and clipping) and its data loader with its repetition filter, step by
step from the same state."""

import jax
import numpy as np
import torch
from olmo_core import data as olmo_data
from olmo_core.data.numpy_dataset import InstanceFilterConfig
from olmo_core.optim import CosWithWarmup, OptimGroupOverride, SkipStepAdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.train_module import TransformerTrainModuleConfig

from olmax.config import load_config
from olmax.data import build_loader
from olmax.data.shards import write_shard
from olmax.data.synthetic import generate_tokens
from olmax.interop.parity import olmo_core_state
from olmax.model import families
from olmax.parallel.mesh import make_layout
from olmax.train.step import create_state, jit_train_step, micro_batch_rows

STEPS = 30
# Float32 noise, measured on this comparison: losses, grad norms and LRs differ by at most 6.2e-7 relative; the
# weights by what a gradient error of at most 9.1e-7 of the tensor's largest gradient gives after Adam (below).
RTOL = 1e-5
GRADIENT_NOISE = 1e-5


def olmo_core_train_module(cfg, shard, work_dir):
    """OLMo-core's train module for the config's recipe, attached to its Trainer, and its data loader."""
    o, schedule, T = cfg.optim, cfg.schedule, cfg.data.sequence_length
    model = families.of(cfg.model).olmo_core_config(cfg.model).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=cfg.train.global_batch_instances * T, max_sequence_length=T,
        optim=SkipStepAdamWConfig(
            lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay,
            rolling_interval_length=o.skip_step.window, sigma_factor=int(o.skip_step.sigma),
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))]),
        z_loss_multiplier=cfg.loss.z_loss, max_grad_norm=o.grad_clip,
        scheduler=CosWithWarmup(warmup=schedule.warmup_steps, alpha_f=schedule.final_lr_fraction),
    ).build(model, device=torch.device("cpu"))
    dataset = olmo_data.NumpyFSLDataset(
        str(shard), sequence_length=T, pad_token_id=cfg.data.pad_id, eos_token_id=cfg.data.eos_id,
        vocab_size=cfg.model.vocab_size, dtype=np.uint16, instance_filter_config=InstanceFilterConfig())
    dataset.work_dir = work_dir
    dataset.prepare()
    loader = olmo_data.NumpyFSLDataLoader(
        dataset, collator=olmo_data.DataCollator(pad_token_id=cfg.data.pad_id),
        global_batch_size=cfg.train.global_batch_instances * T, work_dir=work_dir, seed=cfg.data.seed,
        dp_world_size=1, dp_rank=0, fs_local_rank=0, num_threads=0)
    trainer = TrainerConfig(save_folder=str(work_dir / "olmo-core"), max_duration=Duration.steps(cfg.train.steps)
                            ).build(train_module, loader)
    return train_module, trainer, loader


def weights_within_noise(cfg, train_module, lr, olmo_core_weights, olmax_weights) -> dict:
    """Per tensor, the elements whose difference is beyond float32 noise: 4 ulps of the weight, plus the change
    that an error of GRADIENT_NOISE x the tensor's largest gradient makes through Adam's update of that element,
    lr / bias correction / (sqrt(v hat) + eps) (with no history, v hat is g^2 and a gradient near 0 moves its
    weight by up to lr whichever way float32 rounds it: those elements differ by more than 1e-4 at step 1)."""
    o = cfg.optim
    beyond = {}
    for name, p in train_module.model.named_parameters():
        state = train_module.optim.state[p]
        count = float(state["step"])
        denominator = state["exp_avg_sq"].sqrt() / (1 - o.b2**count) ** 0.5 + o.eps
        sensitivity = lr / (1 - o.b1**count) / denominator
        bound = 4 * torch.finfo(torch.float32).eps * olmax_weights[name].abs() \
            + sensitivity * GRADIENT_NOISE * p.grad.abs().max()
        difference = (olmo_core_weights[name] - olmax_weights[name]).abs()
        if (difference > bound).any():
            beyond[name] = float(difference.max())
    return beyond


def test_the_train_step_equals_olmo_cores_train_module_step_by_step(tmp_path):
    """30 steps of the tiny preset in float32 on a shard where 5% of the instances repeat one token 40 times (the
    repetition filter masks them: 0 to 4 of a batch's 16). Before each step OLMo-core is handed olmax's weights
    and Adam state; then each takes its own loader's batch (equal: checked) and steps. Loss, z-loss, grad norm,
    LR, the skip decision and every updated weight must agree within float32 noise. The skip-step window is 16
    (8 values to start checking) instead of 128, so that its check runs: the grad-norm spike at step 13 is
    skipped by both."""
    B, T = 16, 64
    tokens = generate_tokens(vocab_size=512, eos_id=0, n_tokens=(STEPS + 1) * B * T, seed=3).reshape(-1, T)
    repeated = np.random.default_rng(1).choice(len(tokens), len(tokens) // 20, replace=False)
    tokens[repeated, 10:50] = tokens[repeated, 10:11]
    write_shard(tmp_path / "part-0.npy", tokens.astype(np.uint16))
    cfg = load_config("tiny", [
        "impl.compute_dtype=float32", "mesh.fsdp=1", f"train.steps={STEPS}", f"data.paths=[{tmp_path}/part-0.npy]",
        "data.repetition_filter.enabled=true", "optim.skip_step.window=16", "optim.skip_step.min_values=8"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # its steps of 16 x 64 tokens: 0.05 s on one thread, seconds on two beside JAX's
    try:
        train_module, trainer, olmo_core_loader = olmo_core_train_module(cfg, tmp_path / "part-0.npy", tmp_path)
        layout = make_layout(cfg.mesh, jax.devices()[:1])
        step_fn = jit_train_step(cfg, layout, micro_batch_rows(cfg, 1))
        state = create_state(cfg, layout, jax.random.key(0))
        loader = build_loader(cfg.data, global_batch_instances=B, vocab_size=cfg.model.vocab_size)
        parameters = dict(train_module.model.named_parameters())
        olmo_core_loader.reshuffle(epoch=1)
        batches = iter(olmo_core_loader)
        masked, skipped = [], []
        for step in range(1, STEPS + 1):
            theirs, ours = next(batches), next(loader)
            np.testing.assert_array_equal(ours["input_ids"], theirs["input_ids"].numpy())
            np.testing.assert_array_equal(ours["instance_mask"], theirs["instance_mask"].numpy())
            masked.append(int((~ours["instance_mask"]).sum()))

            adam = state.opt_state.inner.inner_state[1][0]
            train_module.model.load_state_dict(olmo_core_state(cfg, jax.device_get(state.params)))
            moments = [olmo_core_state(cfg, jax.device_get(m)) for m in (adam.mu, adam.nu)]
            for name, p in parameters.items():
                train_module.optim.state[p] = {"step": torch.tensor(float(adam.count)),
                                               "exp_avg": moments[0][name], "exp_avg_sq": moments[1][name]}
            state, metrics = step_fn(state, {k: ours[k][None] for k in ("input_ids", "instance_mask")})
            trainer.global_step = step
            train_module.zero_grads()
            train_module.train_batch({k: theirs[k] for k in ("input_ids", "instance_mask")})
            train_module.optim_step()

            recorded = {name: float(value) for name, value in trainer._metrics[step].items()}
            for name in ("train/CE loss", "train/Z loss", "optim/total grad norm", "optim/LR (group 0)"):
                np.testing.assert_allclose(float(metrics[name]), recorded[name], rtol=RTOL, err_msg=f"{name}, step {step}")
            assert float(metrics["optim/step skipped"]) == recorded["optim/step skipped"], step
            skipped.append(bool(metrics["optim/step skipped"]))
            olmo_core_weights = {name: p.detach() for name, p in parameters.items()}
            olmax_weights = olmo_core_state(cfg, jax.device_get(state.params))
            beyond = weights_within_noise(cfg, train_module, recorded["optim/LR (group 0)"], olmo_core_weights,
                                          olmax_weights)
            assert not beyond, f"step {step}: weights beyond float32 noise (max |difference|): {beyond}"
    finally:
        torch.set_num_threads(threads)
    assert 0 < sum(n > 0 for n in masked) < STEPS, masked  # the filter fired on some steps
    assert skipped.index(True) == 12 and sum(skipped) == 1, skipped  # step 13's spike
