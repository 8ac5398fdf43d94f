"""A mixture of experts as a model option: parameter counts against OLMo-core, the model against its dense
equivalent, the train step's losses and load metrics on 8 fake devices, the selection bias, exact and
elastic resume."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.cli import main
from olmax.config import ConfigError, load_config
from olmax.eval.curves import read_events
from olmax.model import families, flops, transformer
from olmax.model.moe import router
from olmax.parallel.mesh import make_layout
from olmax.train.step import create_state, jit_train_step, make_train_step
from olmax.train.trainer import train
from testlib import event_histograms as _histograms


def _cfg(tmp_path, shards, name, *overrides):
    return load_config("tiny_moe", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/{name}",
                                    "mesh.fsdp=1", *overrides])


def _train(tmp_path, shards, name, *overrides):
    return train(_cfg(tmp_path, shards, name, *overrides), quiet=True)


def _column(history, name):
    return [h[name] for h in history]


# Sizes.

def test_parameter_counts_equal_olmo_cores_and_flops_count_active_parameters(capsys):
    """olmoe_1b_7b counts what ai2-olmo-core's TransformerConfig.olmoe_1B_7B(vocab_size=50304) counts, total,
    active and non-embedding; the OLMo-3-shaped 47B preset what its llama_like_moe counts for the same shape.
    Training FLOPs come from the active parameters."""
    from olmo_core.nn.transformer import TransformerConfig

    olmoe = TransformerConfig.olmoe_1B_7B(vocab_size=50304)
    cfg = load_config("olmoe_1b_7b")
    count = flops.count(cfg.model, 4096)
    assert (count.params, count.active_params, count.non_embedding_params) == (
        olmoe.num_params, olmoe.num_active_params, olmoe.num_non_embedding_params) == (
        6_919_161_856, 1_282_017_280, 6_816_139_264)
    attention = 12 * 16 * 128 * 16 * flops.attended_positions(4096, None)
    assert count.per_token == 6 * (count.active_params - flops.embedding_params(cfg.model)) + attention

    big = load_config("olmo3_moe_47b").model
    for experts, total, active in ((128, 46_859_140_608, 3_171_270_144), (8, 4_566_793_728, 3_157_507_584)):
        m = big.model_copy(update={"moe": big.moe.model_copy(update={"num_experts": experts})})
        reference = TransformerConfig.llama_like_moe(
            d_model=3584, vocab_size=m.padded_vocab, n_layers=32, n_heads=28, n_kv_heads=7, num_experts=experts,
            top_k=4, expert_hidden_size=1024, reordered_norm=True)
        assert (families.param_count(m), families.active_param_count(m)) == (
            reference.num_params, reference.num_active_params) == (total, active)

    assert main(["flops", "olmoe_1b_7b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["params"], report["active_params"]) == (6_919_161_856, 1_282_017_280)


@pytest.mark.parametrize("overrides, message", [
    (["model.mlp=moe", "model.moe=null"], "mlp is moe but moe is not set"),
    (["model.moe.top_k=2"], "but mlp is dense"),
    (["model.mlp=moe", "model.moe.top_k=2", "model.dense_layers=2"], "multiple of the layer_pattern length 4"),
    (["model.mlp=moe", "model.moe.top_k=2", "model.family=olmoe"], "family olmoe"),
    (["model.moe.experts=2"], "unknown config key 'model.moe.experts'"),
    (["model.moe_dispatch=blocks"], "unknown config key"),
    (["impl.moe_dispatch=blocks"], "moved: set impl.moe.dispatch"),
    # The experts' exchange runs over the expert axis: a rule placing their weights elsewhere is refused by name.
    (["mesh.rules.experts=[tensor]"], r"mesh.rules.experts must be \[expert\]"),
    (["mesh.rules.experts=[]"], r"mesh.rules.experts must be \[expert\]"),
    (["mesh.expert=2", "mesh.rules.batch=[data,fsdp]"], "mesh.rules.batch must include expert"),
    (["impl.moe.exchange_chunks=3"], "exchange_chunks=3 does not divide data.sequence_length 64"),
    (["impl.moe.ep_buffer=1.5", "impl.moe.ep_capacity=1.25"], "set one of them to null"),
    (["impl.moe.ep_buffer=0"], "impl.moe.ep_buffer"),
    (["impl.moe.exchange_chunks=0"], "impl.moe.exchange_chunks"),
    # a round of one row (~2,000 rounds a step: 0.3 s -> 25-33 s), and 64 parts each compiled (40 s -> 6 minutes)
    (["impl.moe.ep_buffer=1e-30"], "ep_buffer=1e-30 makes a round of the exchange 1e-30 x the rows a device is "
                                   "expected to receive, about 1e[+]30 rounds a layer .*; give at least 0.0625"),
    (["impl.moe.exchange_chunks=64"], "exchange_chunks=64: each part is compiled on its own .*; give at most 8"),
])
def test_bad_moe_configs_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


# The model.

def test_identical_experts_with_renormalized_gates_are_the_dense_model():
    """Every expert a copy of a dense MLP and the top-k gates renormalized: the MoE computes the dense model
    exactly, whatever the router picks. Checked with dense first layers (their own stack) in the forward
    pass and in KV-cached decoding, for both dispatches."""
    dense = load_config("tiny", ["model.n_layers=8", "model.mlp_hidden=96"])
    params = families.init_params(dense.model, jax.random.key(0))
    sparse = load_config("tiny", ["model.n_layers=8", "model.mlp_hidden=96", "model.mlp=moe", "model.dense_layers=4",
                                  "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=96",
                                  "model.moe.normalize_gates=true"])
    moe_params = families.init_params(sparse.model, jax.random.key(1))
    blocks = params["blocks"]
    moe_params["dense_blocks"] = jax.tree.map(lambda a: a[:4], blocks)
    moe_params["blocks"] |= {k: blocks[k][4:] for k in blocks if k not in ("w1", "w2", "w3")}
    moe_params["blocks"] |= {k: jnp.repeat(blocks[k][4:, None], 4, axis=1) for k in ("w1", "w2", "w3")}
    for k in ("embed", "final_norm", "lm_head"):
        moe_params[k] = params[k]
    assert jax.tree.map(jnp.shape, moe_params) == families.param_shapes(sparse.model)
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, dense.model.vocab_size)
    want = transformer.forward_logits(dense.model, dense.impl, params, tokens)
    for dispatch in ("blocks", "ragged_dot"):
        impl = sparse.impl.model_copy(update={"moe": sparse.impl.moe.model_copy(update={"dispatch": dispatch})})
        np.testing.assert_allclose(transformer.forward_logits(sparse.model, impl, moe_params, tokens), want,
                                   atol=2e-5, rtol=2e-5, err_msg=dispatch)
    cache = transformer.init_cache(sparse.model, sparse.impl, 2, 40)
    prefix, _ = transformer.forward_cached(sparse.model, sparse.impl, moe_params, tokens[:, :30],
                                           jnp.zeros(2, jnp.int32), cache, 40)
    np.testing.assert_allclose(transformer.logits(moe_params, prefix), want[:, :30], atol=2e-5, rtol=2e-5)
    _, aux = transformer.forward(sparse.model, sparse.impl, moe_params, tokens)
    assert aux["tokens_per_expert"].shape == (4, 4)  # the MoE layers only
    assert int(aux["tokens_per_expert"].sum()) == 4 * 2 * 40 * 2


def _eqns(jaxpr, primitive: str) -> int:
    """How often `primitive` runs in a jaxpr, its sub-jaxprs (loops, shard_map, remat, custom rules) included."""
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == primitive
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _eqns(sub, primitive)
    return found


@pytest.mark.parametrize("exchange", ["impl.moe.ep_buffer=1.25", "impl.moe.ep_capacity=1.25"])
def test_no_remat_in_bfloat16_runs_no_expert_exchange_twice(exchange, monkeypatch):
    """impl.remat=none keeps what an expert exchange received (rows, expert ids, gates, counts) and the output it
    summed: the gradient runs as many all_to_alls in bfloat16 (where the layers are rematerialized for their
    elementwise work) as in float32 (where autodiff keeps everything); unnamed, the backward ran them again."""
    def exchanges(dtype):
        cfg = load_config("tiny_moe", ["mesh.expert=8", "mesh.fsdp=1", "impl.remat=none", exchange,
                                       f"impl.compute_dtype={dtype}", "model.n_layers=1", "model.layer_pattern=[global]"])
        layout = make_layout(cfg.mesh)
        params = jax.eval_shape(lambda: families.init_params(cfg.model, jax.random.key(0)))
        tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)

        def loss(p, t):
            return transformer.forward(cfg.model, cfg.impl, p, t, layout)[0].astype(jnp.float32).mean()

        return _eqns(jax.make_jaxpr(jax.grad(loss))(params, tokens).jaxpr, "all_to_all")

    kept = exchanges("float32")
    assert kept > 0 and exchanges("bfloat16") == kept
    from olmax.parallel import expert

    monkeypatch.setattr(expert, "EXCHANGED", "unkept")
    assert exchanges("bfloat16") > kept


# The train step.

@pytest.mark.slow
def test_losses_and_true_load_agree_across_expert_parallel_meshes(tmp_path, shards):
    """Two micro-batches of 8 instances a step, on 1 device, on EP = 8 and on EP = 4 x FSDP = 2 (its exchange
    bounded at half the assignments expected, so in several rounds): the same losses up to float reassociation,
    and per layer the assignments of the whole global batch (16 x 64 tokens x top-2) in the metrics and, as
    histograms, in the event files.
    Cost: three trainings of 2 steps on three meshes, each its own compile."""
    runs = {}
    for name, mesh in (("one", ["train.micro_batch_per_device=8"]),
                       ("ep8", ["mesh.expert=8", "train.micro_batch_per_device=1"]),
                       ("ep4_fsdp2", ["mesh.expert=4", "mesh.fsdp=2", "train.micro_batch_per_device=1",
                                      "impl.moe.ep_buffer=0.5"])):
        runs[name] = _train(tmp_path, shards, name, "train.steps=2", "checkpoint.every=2", *mesh)
    for name in ("train/CE loss", "train/load balancing loss", "train/router Z loss", "optim/total grad norm"):
        for mesh in ("ep8", "ep4_fsdp2"):
            np.testing.assert_allclose(_column(runs[mesh], name), _column(runs["one"], name), rtol=2e-5,
                                       err_msg=f"{mesh} {name}")
    first = runs["ep8"][0]
    for layer in range(4):
        counts = first[f"train/block {layer:02d}/tokens per expert"]
        assert len(counts) == 8 and sum(counts) == 16 * 64 * 2
        assert first[f"train/block {layer:02d}/load imbalance"] == pytest.approx(max(counts) / np.mean(counts))
    assert first["train/load imbalance"] == max(first[f"train/block {i:02d}/load imbalance"] for i in range(4))
    assert all(step["train/dropped rate"] == 0.0 for mesh in ("ep8", "ep4_fsdp2") for step in runs[mesh])
    assert [step["train/exchange extra rounds"] > 0 for step in runs["ep4_fsdp2"]] == [True] * 2
    assert [step["train/exchange extra rounds"] for step in runs["ep8"]] == [0] * 2
    events = Path(tmp_path, "ep8", "tensorboard")
    histogram = _histograms(events)[("train/block 03/tokens per expert", 1)]
    assert (histogram.num, histogram.sum) == (8, 16 * 64 * 2)
    assert read_events(events)["train/block 03/tokens per expert/7"][1] == first["train/block 03/tokens per expert"][7]


@pytest.mark.slow
def test_dropless_expert_parallelism_trains_as_data_parallelism_and_a_capacity_drops(tmp_path, shards):
    """3 steps on 8 devices: EP = 8 (the dropless ragged exchange, its primitive emulated on CPU) against the same
    run data-parallel without expert parallelism agree to float reassociation (2e-6) at every step, the updates
    included. A capacity per peer drops assignments every step: its first loss, before any update, is already 1e-3
    or more away (the dropped assignments' outputs are missing). (Over 20 steps the EP curve stays within 1e-3 of
    data parallelism; it leaves 2e-6 after step 12, where a router decision flips on a last-bit difference of the
    gradient sums: dynamics, not the exchange, so the first steps are the test.)"""
    common = ("train.steps=3", "checkpoint.every=3", "train.micro_batch_per_device=1")
    runs = {name: np.array(_column(_train(tmp_path, shards, name, *common, *mesh), "train/CE loss"))
            for name, mesh in (("dp8", ["mesh.data=8"]), ("ep8", ["mesh.expert=8"]))}
    capacity = _train(tmp_path, shards, "capacity", *common, "mesh.expert=8", "impl.moe.ep_capacity=1.25")
    np.testing.assert_allclose(runs["ep8"], runs["dp8"], rtol=2e-6)
    assert min(_column(capacity, "train/dropped rate")) > 0.01
    assert abs(_column(capacity, "train/CE loss")[0] - runs["dp8"][0]) > 1e-3


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_compiled_train_step_keeps_expert_weights_resident(tmp_path, shards):
    """The whole train step (forward, backward, clip, AdamW) on EP = 4 x FSDP = 2: the dense parameters are
    all-gathered (FSDP), the expert weights ([layers, 8, 64, 96] and [.., 96, 64]) never, in no slice; they
    would be if a rule sharded them over fsdp too (the check's control)."""

    def gathered(*rules):
        cfg = _cfg(tmp_path, shards, "hlo", "mesh.expert=4", "mesh.fsdp=2", *rules)
        layout = make_layout(cfg.mesh)
        state = jax.eval_shape(lambda: create_state(cfg, layout, jax.random.key(0)))
        batch = {"input_ids": jax.ShapeDtypeStruct((1, 16, 64), jnp.int32),
                 "instance_mask": jax.ShapeDtypeStruct((1, 16), jnp.bool_)}
        hlo = jit_train_step(cfg, layout, 16).lower(state, batch).compile().as_text()
        assert "all-to-all" in hlo
        shapes = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
        return shapes, [s for s in shapes if re.search(r",64,96\]|,96,64\]", s)]

    shapes, experts = gathered()
    assert shapes and not experts, shapes
    assert gathered("mesh.rules.expert_embed=[fsdp]")[1]


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_score_bias_moves_on_every_step_and_only_by_the_load(shards, tmp_path):
    """With auxiliary-loss-free balancing, after a step the bias is its old value + rate x sign(mean - count)
    of the step's global load, exactly: Adam and weight decay (0.5 here) never touch it. A skipped step
    (a NaN loss) changes no weight, but the bias still moves (OLMo-core updates it in post_batch)."""
    cfg = _cfg(tmp_path, shards, "bias", "model.moe.bias_update_rate=0.01", "optim.weight_decay=0.5")
    layout = make_layout(cfg.mesh)
    step = jax.jit(make_train_step(cfg, layout))
    state = create_state(cfg, layout, jax.random.key(0))
    state = state._replace(params=state.params | {"blocks": state.params["blocks"] | {
        "score_bias": jnp.linspace(-0.05, 0.05, 32).reshape(4, 8)}})
    tokens = jax.random.randint(jax.random.key(1), (1, 16, 64), 0, 512)
    batch = {"input_ids": tokens, "instance_mask": jnp.ones((1, 16), bool)}
    for poisoned in (False, True):
        before = state.params
        if poisoned:
            before = before | {"lm_head": before["lm_head"].at[0, 0].set(jnp.nan)}
            state = state._replace(params=before)
        state, metrics = step(state, batch)
        counts = jnp.stack([jnp.asarray(metrics[f"train/block {i:02d}/tokens per expert"]) for i in range(4)])
        np.testing.assert_array_equal(state.params["blocks"]["score_bias"],
                                      router.update_score_bias(before["blocks"]["score_bias"], counts, 0.01))
        assert bool(metrics["optim/step skipped"]) == poisoned
        if poisoned:
            np.testing.assert_array_equal(state.params["blocks"]["w1"], before["blocks"]["w1"])


@pytest.mark.slow
def test_resume_is_exact_with_random_routing_and_the_selection_bias(tmp_path, shards):
    """Routing drawn from a key that is a function of the step, and a bias updated every step: 4 steps in
    one run and 2 + 2 with a resume give bitwise the same losses and the same load, step for step."""
    common = ["train.steps=4", "checkpoint.every=2", "model.moe.routing=random", "model.moe.bias_update_rate=0.01"]
    continuous = _train(tmp_path, shards, "a", *common)
    resumed = _train(tmp_path, shards, "b", *common, "train.stop_after=2") + _train(tmp_path, shards, "b", *common)
    for name in ("train/CE loss", "train/load balancing loss", "train/block 02/tokens per expert"):
        assert _column(resumed, name) == _column(continuous, name), name
    loads = _column(continuous, "train/block 02/tokens per expert")
    assert loads[0] != loads[1], "each step draws its own routing"


@pytest.mark.slow
def test_elastic_resume_from_4_to_2_expert_parallel_devices(tmp_path, shards):
    """EP = 4 (x FSDP 2) for 2 steps, then EP = 2 (x FSDP 4) from that checkpoint: the losses of the
    continuous EP = 4 run within float tolerance (global_batch balancing does not depend on the devices)."""
    common = ["train.steps=4", "checkpoint.every=2"]
    reference = _train(tmp_path, shards, "ep4", *common, "mesh.expert=4", "mesh.fsdp=2")
    elastic = _train(tmp_path, shards, "elastic", *common, "mesh.expert=4", "mesh.fsdp=2", "train.stop_after=2")
    elastic += _train(tmp_path, shards, "elastic", *common, "mesh.expert=2", "mesh.fsdp=4")
    assert [h["step"] for h in elastic] == list(range(1, 5))
    for name in ("train/CE loss", "train/load balancing loss", "optim/total grad norm"):
        np.testing.assert_allclose(_column(elastic, name), _column(reference, name), rtol=1e-5, err_msg=name)
