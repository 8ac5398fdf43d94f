import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import load_config
from olmax.model import families, transformer
from olmax.model.attention.xla import attention as blocked_attention


def _tiny(*overrides):
    return load_config("tiny", list(overrides))


def _logits(cfg, params, tokens):
    return transformer.forward_logits(cfg.model, cfg.impl, params, tokens)


def attention(q, k, v, window, block):
    """The blocked attention on unscaled q, as a naive reference computes it."""
    return blocked_attention(q / np.sqrt(q.shape[-1]), k, v, window=window, block=block)


def _naive_attention(q, k, v, window):
    """Reference: explicit loops over positions, float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    out = np.zeros_like(q)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        for h in range(Hq):
            s = np.einsum("bd,bkd->bk", q[:, i, h], k[:, lo : i + 1, h // group]) / np.sqrt(D)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, i, h] = np.einsum("bk,bkd->bd", p, v[:, lo : i + 1, h // group])
    return out


@pytest.mark.parametrize("window, block", [(None, 16), (1, 16), (5, 16), (16, 16), (17, 8), (30, 16), (64, 16)])
def test_attention_matches_naive_reference(window, block):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 64, 4, 8))
    k = jax.random.normal(keys[1], (2, 64, 2, 8))
    v = jax.random.normal(keys[2], (2, 64, 2, 8))
    np.testing.assert_allclose(attention(q, k, v, window, block), _naive_attention(q, k, v, window), atol=2e-5)


def _masked_softmax_attention(q, k, v, window):
    """Autodiff reference for the gradients: one masked softmax over all T x T scores."""
    B, T, Hq, D = q.shape
    k, v = (jnp.repeat(a, Hq // a.shape[2], axis=2) for a in (k, v))
    i = np.arange(T)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or T))
    scores = jnp.where(visible, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("window, block", [(None, 16), (5, 16), (17, 8), (64, 16)])
def test_attention_gradients_match_autodiff_of_masked_softmax(window, block):
    """The blocks' hand-written backward pass gives autodiff's gradients for q, k and v (GQA, windows that
    cut blocks, blocks that start before the window)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 64, 4, 8))
    k = jax.random.normal(keys[1], (2, 64, 2, 8))
    v = jax.random.normal(keys[2], (2, 64, 2, 8))
    weights = jax.random.normal(keys[3], q.shape)

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), argnums=(0, 1, 2))(q, k, v)

    ours = grads(lambda q, k, v: attention(q, k, v, window, block))
    reference = grads(lambda q, k, v: _masked_softmax_attention(q, k, v, window))
    for name, a, b in zip("qkv", ours, reference):
        np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"d{name}")


def _digest(params, logits) -> str:
    import hashlib

    digest = hashlib.sha256()
    for leaf in [*jax.tree.leaves(params), logits]:
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def test_forward_is_deterministic_and_init_follows_olmo_core():
    """The same seed gives the same weights and logits, bit for bit, in a fresh process too (another seed, other
    weights); the init is OLMo-core's: every matrix and the embedding N(0, init_std) truncated at +-3 std, norm
    gains 1."""
    import subprocess
    import sys

    cfg = _tiny()
    params = families.init_params(cfg.model, jax.random.key(0))
    other = families.init_params(cfg.model, jax.random.key(1))
    std = cfg.model.init_std
    for p in families.table(cfg.model):
        w, w_other = params, other
        for key in p.path:
            w, w_other = w[key], w_other[key]
        w = np.asarray(w)
        if p.init == "ones":
            assert np.all(w == 1), p.path
            continue
        assert not np.array_equal(w, np.asarray(w_other)), p.path
        assert np.abs(w).max() <= 3 * std, p.path
        assert abs(w.std() - std * 0.9866) < 0.05 * std, p.path  # N(0, 1) cut at +-3 has std 0.9866
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.model.vocab_size)
    logits = jax.jit(lambda p, t: _logits(cfg, p, t))(params, tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 64, cfg.model.padded_vocab)
    fresh = subprocess.run([sys.executable, "-c", (
        "import jax, numpy as np; from olmax.config import load_config; from olmax.model import families, transformer\n"
        "from test_model import _digest\n"
        "cfg = load_config('tiny'); params = families.init_params(cfg.model, jax.random.key(0))\n"
        "tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.model.vocab_size)\n"
        "logits = jax.jit(lambda p, t: transformer.forward_logits(cfg.model, cfg.impl, p, t))(params, tokens)\n"
        "print(_digest(params, logits))")],  # the same program as above (op by op, XLA's CPU code differs in last bits)
        capture_output=True, text=True, cwd=Path(__file__).parent, check=True)
    assert fresh.stdout.strip() == _digest(params, logits)


def test_causal_and_sliding_window_reach():
    """Changing token j changes logits at i only if i >= j, and a sliding-only model only within its window."""
    cfg = _tiny("model.layer_pattern=[sliding]", "model.sliding_window=8")
    params = families.init_params(cfg.model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 64), 0, cfg.model.vocab_size)
    changed = tokens.at[0, 20].set((tokens[0, 20] + 1) % cfg.model.vocab_size)
    diff = np.abs(np.asarray(_logits(cfg, params, tokens) - _logits(cfg, params, changed))).max(-1)[0]
    reach = 20 + cfg.model.n_layers * (cfg.model.sliding_window - 1)  # each layer extends the receptive field by w - 1
    assert np.all(diff[:20] == 0) and np.all(diff[20 : reach + 1] > 0) and np.all(diff[reach + 1 :] == 0)


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_remat_policies_change_memory_not_math():
    base = _tiny()
    params = families.init_params(base.model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, base.model.vocab_size)

    def grads(cfg):
        return jax.jit(jax.grad(lambda p: _logits(cfg, p, tokens).mean()))(params)

    reference = grads(base)
    for remat in ("full", "[qkv_proj, out_proj, mlpwi_0, mlpwo, context]"):
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads(_tiny(f"impl.remat={remat}")))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_no_remat_in_bfloat16_keeps_matmul_outputs_not_float32_intermediates():
    """impl.remat=none with bfloat16 compute keeps what the matmuls and the attention made and recomputes the
    elementwise work between them: autodiff alone keeps each norm's float32 copies and SwiGLU's gate (2.5 GiB a
    layer of the 7B at 8,192 tokens a device, where the matmul outputs take 0.8)."""
    from jax._src.ad_checkpoint import saved_residuals

    cfg = _tiny("impl.compute_dtype=bfloat16", "impl.scan_layers=false")
    params = families.init_params(cfg.model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.model.vocab_size)

    def loss(p):
        return transformer.forward(cfg.model, cfg.impl, p, tokens)[0].astype(jnp.float32).mean()

    kept = [(aval, source) for aval, source in saved_residuals(loss, params) if aval.shape[:2] == (2, 128)]
    assert not [source for _, source in kept if "silu" in source]
    # float32 activations: the final norm's two (after the layers), none of a layer's four norms
    assert len([aval for aval, _ in kept if aval.dtype == jnp.float32 and aval.shape[-1] > 1]) == 2
    assert len([aval for aval, _ in kept if aval.shape[-1] == cfg.model.mlp_hidden]) == 2 * cfg.model.n_layers


def test_program_size_does_not_grow_with_depth():
    def hlo_size(layers):
        cfg = _tiny(f"model.n_layers={layers}")
        params = jax.eval_shape(lambda: families.init_params(cfg.model, jax.random.key(0)))
        tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
        return len(jax.jit(lambda p, t: _logits(cfg, p, t)).lower(params, tokens).as_text())

    assert abs(hlo_size(4) - hlo_size(32)) < 200  # layer count appears only in shapes, not as unrolled code


def test_bf16_compute_keeps_float32_params_and_logits():
    cfg = _tiny("impl.compute_dtype=bfloat16")
    params = families.init_params(cfg.model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.model.vocab_size)
    logits = _logits(cfg, params, tokens)
    reference = _logits(_tiny("impl.compute_dtype=float32"), params, tokens)
    assert logits.dtype == jnp.float32 and params["embed"].dtype == jnp.float32
    assert float(jnp.abs(logits - reference).max()) < 0.05


def test_the_heads_backward_runs_in_the_compute_dtype_where_asked():
    """impl.logits_grad=compute under bfloat16 compute: the LM head's float32 logits have their gradient taken back
    in bfloat16 (a bfloat16 autocast head's backward): no float32 matmul over [tokens, vocab] (two, at the float32
    rate, by default); the gradients agree with float32 autodiff to bfloat16's precision. Under float32 compute,
    or by default, the program is autodiff's own."""
    cfg = _tiny("impl.compute_dtype=bfloat16")
    params = families.init_params(cfg.model, jax.random.key(0))
    hidden = jax.random.normal(jax.random.key(1), (2, 64, cfg.model.d_model))
    targets = jax.random.normal(jax.random.key(2), (2, 64, params["lm_head"].shape[1]))

    def loss(head, hidden, dtype, grad="compute"):
        return jnp.sum(transformer.logits({"lm_head": head}, hidden.astype(dtype), grad) * targets)

    def operands(grad):  # of the backward's two matmuls (the loss is linear in the logits: no forward one)
        text = jax.jit(jax.grad(loss, (0, 1)), static_argnums=(2, 3)).lower(params["lm_head"], hidden, jnp.bfloat16,
                                                                             grad).as_text()
        return re.findall(r"stablehlo.dot_general [^\n]*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", text)

    assert operands("compute") == [("bf16", "bf16")] * 2 and operands("float32") == [("f32", "f32")] * 2
    got = jax.grad(loss, (0, 1))(params["lm_head"], hidden, jnp.bfloat16)
    want = jax.grad(loss, (0, 1))(params["lm_head"], hidden, jnp.float32)
    for g, w in zip(got, want):
        assert float(jnp.abs(g.astype(jnp.float32) - w).max()) < 0.02 * float(jnp.abs(w).max())
    plain = jax.grad(lambda h, x: jnp.sum(jnp.dot(x, h, preferred_element_type=jnp.float32) * targets), (0, 1))
    assert all(jnp.array_equal(a, b) for a, b in zip(want, plain(params["lm_head"], hidden)))


@pytest.mark.parametrize("preset, overrides", [  # a dense model's, pipelined: test_pipeline's 1F1B test
    ("tiny_moe", "mesh.expert=4 mesh.fsdp=2 model.n_layers=2 model.layer_pattern=[sliding,global]"),
    pytest.param("tiny_moe", "mesh.stage=2 mesh.expert=4 mesh.fsdp=1 model.n_layers=4 "
                 "model.layer_pattern=[sliding,global] impl.pipeline.schedule=gpipe", marks=pytest.mark.slow),
])
def test_batch_split_runs_the_same_function_part_by_part(preset, overrides):
    """impl.batch_split=2 (a mixture of experts, expert parallel; pipelined too): the rows run as two parts
    staggered sublayer by sublayer, and the model is the same function: the same hidden states, loss and gradients,
    the same tokens per expert and router z-loss in every layer; the load-balancing loss is each part's (rows j,
    j + 2, ... of the batch, or of a pipeline micro-batch), as a micro-batch's."""
    from olmax.model.loss import label_mask, loss_sums
    from olmax.parallel import schedules
    from olmax.parallel.mesh import make_layout

    split, whole = (load_config(preset, [*overrides.split(), f"impl.batch_split={parts}"]) for parts in (2, 1))
    sched, layout = schedules.schedule_for(whole), make_layout(whole.mesh)
    params = families.init_params(whole.model, jax.random.key(0))
    params = jax.device_put(params, layout.shardings(families.param_axes(whole.model), params))
    tokens = jax.random.randint(jax.random.key(1), (16, whole.data.sequence_length), 2, whole.model.vocab_size)

    def grad(cfg):
        def loss(params, tokens):
            hidden, aux = transformer.forward(cfg.model, cfg.impl, params, tokens, layout, None, sched)
            mask = label_mask(tokens, cfg.data.pad_id, False)
            ce, _ = loss_sums(params, hidden, tokens, mask, jnp.ones(tokens.shape[:1], bool), cfg.impl.loss_chunk)
            return ce / mask.sum(), (hidden, aux)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (ce, (hidden, aux)), grads = grad(split)(params, tokens)
    (ref_ce, (ref_hidden, ref_aux)), ref_grads = grad(whole)(params, tokens)
    np.testing.assert_allclose(ce, ref_ce, rtol=1e-6)
    np.testing.assert_allclose(hidden, ref_hidden, atol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(aux["tokens_per_expert"], ref_aux["tokens_per_expert"])
    np.testing.assert_allclose(aux["router_z_loss"], ref_aux["router_z_loss"], rtol=1e-5)
    # each part of each (pipeline) micro-batch on its own, unsplit and unpipelined
    M = sched.microbatches if sched else 1
    balance = jax.jit(lambda params, tokens: transformer.forward(
        whole.model, whole.impl, params, tokens, None, None, None)[1]["load_balancing_loss"])
    own = [balance(params, tokens[part::2 * M]) for part in range(2 * M)]
    parts = jnp.stack([jnp.mean(jnp.stack(own[m::M]), axis=0) for m in range(M)])
    np.testing.assert_allclose(aux["load_balancing_loss"], parts if sched else parts[0], rtol=1e-5)
    assert not np.allclose(aux["load_balancing_loss"], ref_aux["load_balancing_loss"], rtol=1e-3)
