"""The MoE layer on one device: routing and losses against OLMo-core's own code, every dispatch
against a dense reference (forward and gradients), capacity drops, load metrics, routing modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmax.config import MoEConfig
from testlib import moe_layer_params
from olmax.model.moe import router, sublayer

D = 16


def _cfg(**overrides):
    return MoEConfig(**({"num_experts": 8, "top_k": 2, "expert_hidden": 24} | overrides))


def _inputs(cfg, B=4, T=16, seed=0):
    kp, kx = jax.random.split(jax.random.key(seed))
    return moe_layer_params(cfg, D, kp, std=0.3), jax.random.normal(kx, (B, T, D))


def dense_reference(cfg, p, x):
    """Every expert on every token, weighted by a [tokens, E] matrix holding the gates at the chosen
    (and kept) experts and zeros elsewhere. Work grows with E; no sorting, blocks or padding.
    Returns (out, aux losses) like the layer."""
    B, T, _ = x.shape
    tokens = x.reshape(-1, D)
    r = router.route(cfg, p, tokens)
    experts = r.experts if cfg.capacity_factor is None else router.drop_over_capacity(cfg, r.experts, 1)
    mix = jnp.zeros((tokens.shape[0], cfg.num_experts + 1)).at[jnp.arange(tokens.shape[0])[:, None], experts].add(
        r.gates)[:, : cfg.num_experts]
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", tokens, p["w1"])) * jnp.einsum("nd,edf->enf", tokens, p["w3"])
    y = jnp.einsum("ne,end->nd", mix, jnp.einsum("enf,efd->end", h, p["w2"]))
    if cfg.shared_expert_hidden:  # OLMo-core: (shared + k * routed) / (k + 1)
        shared = (jax.nn.silu(tokens @ p["shared_w1"]) * (tokens @ p["shared_w3"])) @ p["shared_w2"]
        y = (shared + cfg.top_k * y) / (cfg.top_k + 1)
    lb_scores = r.scores / jnp.sum(r.scores, -1, keepdims=True) if cfg.gating == "sigmoid" else r.scores
    losses = {"load_balancing_loss": router.load_balancing_loss(lb_scores, r.experts, cfg.top_k),
              "router_z_loss": router.router_z_loss(r.logits)}
    return y.reshape(B, T, D), losses


def _layer(cfg, **kwargs):
    return jax.jit(lambda p, x: sublayer.moe_mlp(cfg, p, x, **kwargs))


def _objective(layer, cotangent):
    """Output against a fixed cotangent plus both router losses, so every parameter gets a gradient."""

    def f(p, x):
        out, aux = layer(p, x)
        return jnp.sum(out * cotangent) + aux["load_balancing_loss"] + aux["router_z_loss"]

    return f


# Routing and losses against ai2-olmo-core.

def _olmo_core_router(cfg, p, tokens):
    from olmo_core.nn.moe.router import MoELinearRouter

    theirs = MoELinearRouter(
        d_model=D, num_experts=cfg.num_experts, top_k=cfg.top_k, gating_function=cfg.gating,
        normalize_expert_weights=1.0 if cfg.normalize_gates else None, bias_gamma=cfg.bias_update_rate,
        lb_loss_weight=1.0, z_loss_weight=1.0,
    )
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(np.array(p["router"]).T.reshape(-1)))
        if cfg.bias_update_rate:
            theirs.score_bias.copy_(torch.from_numpy(np.array(p["score_bias"])))
    theirs.train()
    x = torch.from_numpy(np.array(tokens)).reshape(1, -1, D).requires_grad_()
    gates, experts, counts, _ = theirs(x)
    return gates, experts, counts, theirs.load_balancing_loss, theirs.z_loss


@pytest.mark.parametrize("overrides", [
    {},
    {"gating": "sigmoid", "normalize_gates": True},
    {"top_k": 1},
    {"bias_update_rate": 1e-3, "normalize_gates": True},
])
def test_router_and_losses_match_olmo_core(overrides):
    """Same router weights, same tokens: OLMo-core's MoELinearRouter picks the same experts with the same
    gates and counts, and its load balancing and z losses equal ours."""
    cfg = _cfg(**overrides)
    p, x = _inputs(cfg)
    if cfg.bias_update_rate:  # a bias large enough to change some selections
        p["score_bias"] = jnp.linspace(-0.2, 0.2, cfg.num_experts)
    tokens = x.reshape(-1, D)
    r = router.route(cfg, p, tokens)
    _, aux = _layer(cfg)(p, x)
    gates, experts, counts, lb, z = _olmo_core_router(cfg, p, tokens)
    np.testing.assert_array_equal(r.experts, experts.reshape(-1, cfg.top_k).numpy())
    np.testing.assert_allclose(r.gates, gates.detach().reshape(-1, cfg.top_k).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(aux["tokens_per_expert"], counts.numpy())
    np.testing.assert_allclose(aux["load_balancing_loss"], lb.item(), rtol=1e-6)
    np.testing.assert_allclose(aux["router_z_loss"], z.item(), rtol=1e-6)


def test_micro_batch_granularity_is_olmo_core_local_batch_per_rank():
    """micro_batch over G ranks = the mean of OLMo-core's `local_batch` loss on each rank's shard (what
    averaging gradients over ranks optimizes); global_batch = that loss on the whole batch at once."""
    from olmo_core.nn.moe.loss import MoELoadBalancingLossGranularity, load_balancing_loss

    cfg = _cfg(top_k=3)
    p, x = _inputs(cfg, B=8)
    r = router.route(cfg, p, x.reshape(-1, D))

    def olmo_core(scores, experts):
        counts = torch.from_numpy(np.array(router.tokens_per_expert(experts, cfg.num_experts)))
        return load_balancing_loss(
            num_experts=cfg.num_experts, top_k=cfg.top_k, expert_scores=torch.from_numpy(np.array(scores))[None],
            batch_size_per_expert=counts, batched_batch_size_per_expert=counts[None],
            granularity=MoELoadBalancingLossGranularity.local_batch,
        ).item()

    ranks = 4
    per_rank = [olmo_core(s, e) for s, e in zip(np.split(r.scores, ranks), np.split(r.experts, ranks))]
    np.testing.assert_allclose(router.load_balancing_loss(r.scores, r.experts, cfg.top_k, ranks), np.mean(per_rank),
                               rtol=1e-6)
    np.testing.assert_allclose(router.load_balancing_loss(r.scores, r.experts, cfg.top_k), olmo_core(r.scores, r.experts),
                               rtol=1e-6)
    assert not np.isclose(np.mean(per_rank), olmo_core(r.scores, r.experts), rtol=1e-3)  # the switch matters


# Dispatch against the dense reference.

@pytest.mark.parametrize("overrides, dispatch", [
    ({}, {}),
    ({}, {"block_size": 1}),
    ({}, {"block_size": 128}),  # one block holds every row of the batch
    ({"gating": "sigmoid", "normalize_gates": True, "shared_expert_hidden": 20, "top_k": 3}, {}),
    ({"capacity_factor": 0.5}, {}),
    ({}, {"dispatch": "ragged_dot"}),
    ({"capacity_factor": 0.5, "gating": "sigmoid", "shared_expert_hidden": 20}, {"dispatch": "ragged_dot"}),
])
def test_dispatch_matches_dense_reference(overrides, dispatch):
    """Output and the gradients of x and of every parameter equal the every-expert-on-every-token
    computation within float32 rounding."""
    cfg = _cfg(**overrides)
    p, x = _inputs(cfg)
    cotangent = jax.random.normal(jax.random.key(7), x.shape)
    out, aux = _layer(cfg, **dispatch)(p, x)
    want_out, want_aux = dense_reference(cfg, p, x)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    for name in want_aux:
        np.testing.assert_allclose(aux[name], want_aux[name], rtol=1e-6)
    assert (int(aux["dropped_tokens"]) > 0) == (cfg.capacity_factor is not None)
    grads = jax.jit(jax.grad(_objective(lambda p, x: sublayer.moe_mlp(cfg, p, x, **dispatch), cotangent),
                             argnums=(0, 1)))(p, x)
    want = jax.jit(jax.grad(_objective(lambda p, x: dense_reference(cfg, p, x), cotangent), argnums=(0, 1)))(p, x)
    assert_trees_close(grads, want)


def assert_trees_close(got, want, tol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dispatch", ["blocks", "ragged_dot"])
def test_dispatch_with_every_token_on_one_expert(dispatch):
    """The worst case the static bounds must hold: all tokens pick the same experts, the rest get none."""
    cfg = _cfg()
    p, x = _inputs(cfg)
    p["router"] = p["router"].at[:, :2].set(0.0)
    x = x.at[..., 0].set(jnp.abs(x[..., 0]) + 1.0)
    p["router"] = p["router"].at[0, :2].set(50.0)
    out, aux = _layer(cfg, dispatch=dispatch, block_size=4)(p, x)
    assert aux["tokens_per_expert"].tolist() == [x.shape[0] * x.shape[1]] * 2 + [0] * 6
    np.testing.assert_allclose(out, dense_reference(cfg, p, x)[0], atol=1e-5, rtol=1e-5)


# Capacity.

def test_capacity_keeps_each_experts_first_assignments():
    """Per expert, the first `capacity` assignments in (token, slot) order survive (OLMo-core's capacity
    rule: capacity_factor x k x tokens / E, rounded up to a multiple of 8); the count of the others is
    the dropped count."""
    cfg = _cfg(capacity_factor=0.6, top_k=2)
    p, x = _inputs(cfg, B=4, T=32)
    tokens = x.reshape(-1, D)
    experts = np.asarray(router.route(cfg, p, tokens).experts)
    capacity = router.expert_capacity(cfg, tokens.shape[0])
    assert capacity == 8 * int(np.ceil(int(0.6 * 2 * 128 / 8) / 8)) == 24
    seen, want = np.zeros(cfg.num_experts, int), experts.copy()
    for n in range(experts.shape[0]):
        for j in range(cfg.top_k):
            e = experts[n, j]
            if seen[e] >= capacity:
                want[n, j] = cfg.num_experts
            seen[e] += 1
    np.testing.assert_array_equal(router.drop_over_capacity(cfg, jnp.asarray(experts), 1), want)
    _, aux = _layer(cfg)(p, x)
    assert int(aux["dropped_tokens"]) == int(np.sum(np.maximum(seen - capacity, 0))) > 0
    np.testing.assert_array_equal(aux["tokens_per_expert"], seen)  # counted before the drop


# Load metrics.

def test_load_metrics_catch_what_the_balancing_loss_hides():
    """Token gerrymandering, constructed: from a balanced routing to one where half the tokens pick expert 0
    with a score barely above uniform while the others pick experts 1-3 confidently. The balancing loss
    falls; the true load over the batch is twice as uneven, and the metrics say so."""
    cfg = _cfg(num_experts=4, top_k=1, expert_hidden=8)
    kinds = jnp.eye(D)[:4]  # four kinds of token, one-hot

    def routed(logits, which):
        p = moe_layer_params(cfg, D, jax.random.key(0)) | {"router": jnp.zeros((D, 4)).at[:4].set(jnp.log(logits))}
        _, aux = _layer(cfg)(p, kinds[jnp.asarray(which)].reshape(1, -1, D))
        return aux

    confident = np.full((4, 4), 0.1) + 0.6 * np.eye(4)  # kind i -> expert i with score 0.7
    balanced = routed(confident, [0, 1, 2, 3] * 12)
    hedged = confident.copy()
    hedged[0] = [0.26, 0.2467, 0.2467, 0.2466]  # kind 0 -> expert 0, score 0.26
    hedged[1:, 0] = 0.0001  # the others never consider expert 0
    hedged[1:] /= hedged[1:].sum(1, keepdims=True)
    gerrymandered = routed(hedged, [0, 0, 0, 1, 2, 3] * 8)

    assert float(gerrymandered["load_balancing_loss"]) < float(balanced["load_balancing_loss"]) - 0.1
    before = router.load_metrics(balanced["tokens_per_expert"], balanced["dropped_tokens"])
    after = router.load_metrics(gerrymandered["tokens_per_expert"], gerrymandered["dropped_tokens"])
    assert float(before["load imbalance"]) == 1.0 and float(after["load imbalance"]) == 2.0
    assert float(before["busiest expert share"]) == 0.25 and float(after["busiest expert share"]) == 0.5
    assert float(after["dropped rate"]) == 0.0


def test_load_metrics_over_layers_and_drops():
    counts = jnp.array([[10, 10, 10, 10], [25, 5, 5, 5]])
    metrics = router.load_metrics(counts, jnp.array([0, 8]))
    np.testing.assert_allclose(metrics["load imbalance"], [1.0, 2.5])
    np.testing.assert_allclose(metrics["busiest expert share"], [0.25, 0.625])
    np.testing.assert_allclose(metrics["dropped rate"], [0.0, 0.2])


# Routing modes and the selection bias.

def test_uniform_routing_spreads_evenly_and_keeps_the_router_trained():
    cfg = _cfg(routing="uniform")
    p, x = _inputs(cfg)
    out, aux = _layer(cfg)(p, x)
    assert aux["tokens_per_expert"].tolist() == [x.shape[0] * x.shape[1] * cfg.top_k // cfg.num_experts] * 8
    grad = jax.jit(jax.grad(lambda p: jnp.sum(sublayer.moe_mlp(cfg, p, x)[0] ** 2)))(p)["router"]
    assert float(jnp.max(jnp.abs(grad))) > 0  # gates still come from the router's scores


def test_random_routing_is_a_function_of_the_key_and_keeps_the_router_in_the_step():
    cfg = _cfg(routing="random")
    p, x = _inputs(cfg)
    layer = jax.jit(lambda p, x, key: sublayer.moe_mlp(cfg, p, x, key=key))
    a, b, c = (layer(p, x, jax.random.key(s)) for s in (1, 1, 2))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.allclose(a[0], c[0])
    assert a[1]["tokens_per_expert"].tolist() != c[1]["tokens_per_expert"].tolist()
    # The router matmul stays in the compiled step (its FLOPs), and its gradient is computed: exactly 0.
    hlo = layer.lower(p, x, jax.random.key(1)).compile().as_text().splitlines()
    assert any(f"f32[{x.shape[0] * x.shape[1]},{cfg.num_experts}]" in line and " dot(" in line for line in hlo)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(layer(p, x, jax.random.key(1))[0] ** 2)))(p)
    assert float(jnp.max(jnp.abs(grad["router"]))) == 0.0 and float(jnp.max(jnp.abs(grad["w1"]))) > 0
    with pytest.raises(ValueError, match="key"):
        sublayer.moe_mlp(cfg, p, x)


def test_score_bias_moves_selection_not_gates_and_gets_no_gradient():
    cfg = _cfg(bias_update_rate=1e-3)
    p, x = _inputs(cfg)
    tokens = x.reshape(-1, D)
    plain = router.route(cfg, p, tokens)
    p["score_bias"] = p["score_bias"].at[5].set(10.0)  # expert 5 wins every token's first slot
    biased = router.route(cfg, p, tokens)
    assert bool(jnp.all(biased.experts[:, 0] == 5))
    np.testing.assert_array_equal(biased.gates[:, 0], plain.scores[:, 5])  # the gate is the unbiased score
    grad = jax.jit(jax.grad(_objective(lambda p, x: sublayer.moe_mlp(cfg, p, x), jnp.ones_like(x))))(p, x)
    assert float(jnp.max(jnp.abs(grad["score_bias"]))) == 0.0


def test_update_score_bias_lowers_busy_experts_and_raises_idle_ones():
    """OLMo-core's rule: bias += rate * sign(mean count - count), per layer."""
    bias = jnp.zeros((2, 4))
    counts = jnp.array([[30, 10, 10, 10], [15, 15, 15, 15]])
    np.testing.assert_allclose(router.update_score_bias(bias, counts, 0.01), [[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]])


def test_param_table_names_every_parameter_the_layer_reads():
    """The MoE rows of the families' tables: one logical axis per dimension, and exactly the parameters the
    layer uses (a shared expert's, the selection bias) when the config has them."""
    from olmax.model.families.base import moe_shapes

    for extra in ({}, {"shared_expert_hidden": 12, "bias_update_rate": 1e-3}):
        table = moe_shapes(_cfg(**extra), D)
        assert all(len(shape) == len(axes) for shape, axes in table.values())
        assert ("shared_w1" in table, "score_bias" in table) == (bool(extra), bool(extra))


def test_aux_loss_is_olmo_cores_per_layer_weighted_and_divided_by_the_label_count():
    """The loss a micro-batch adds and its logged parts equal OLMo-core's: an MoE of its own built for a
    model of n_layers (its weights scaled by 1 / n_layers), each layer's router run with the batch's label
    count B x (T - 1) as loss_div_factor (what its train module passes), aux losses and metrics summed."""
    from olmo_core.nn.moe import MoEConfig as OlmoCoreMoE
    from olmo_core.nn.moe import MoERouterConfig

    cfg = _cfg(top_k=3, load_balancing_loss=0.01, router_z_loss=0.001)
    n_layers, B, T = 3, 4, 16
    layers = [_inputs(cfg, B, T, seed) for seed in range(n_layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[_layer(cfg)(p, x)[1] for p, x in layers])
    total, parts = router.aux_loss(cfg, stacked, n_layers, B * T, jnp.float32(B * (T - 1)))

    want_total, want_lb, want_z = 0.0, 0.0, 0.0
    for p, x in layers:
        block = OlmoCoreMoE(num_experts=cfg.num_experts, hidden_size=cfg.expert_hidden,
                            router=MoERouterConfig(top_k=cfg.top_k), lb_loss_weight=cfg.load_balancing_loss,
                            z_loss_weight=cfg.router_z_loss).build(D, n_layers=n_layers)
        theirs = block.router.train()
        with torch.no_grad():
            theirs.weight.copy_(torch.from_numpy(np.array(p["router"]).T.reshape(-1)))
        *_, aux = theirs(torch.from_numpy(np.array(x)).requires_grad_(), loss_div_factor=B * (T - 1))
        metrics = theirs.compute_metrics()
        want_total += aux.item()
        want_lb += metrics["load balancing loss"][0].item()
        want_z += metrics["router Z loss"][0].item()
    np.testing.assert_allclose(total, want_total, rtol=1e-5)
    np.testing.assert_allclose(parts["load balancing loss"], want_lb, rtol=1e-5)
    np.testing.assert_allclose(parts["router Z loss"], want_z, rtol=1e-5)
    assert not np.isclose(want_lb, cfg.load_balancing_loss * float(stacked["load_balancing_loss"].mean()), rtol=1e-3)


def test_config_rejects_top_k_above_num_experts():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="top_k 9 exceeds num_experts 8"):
        MoEConfig(num_experts=8, top_k=9)
