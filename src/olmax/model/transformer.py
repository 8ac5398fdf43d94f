"""The decoder-only transformer (every family of olmax.model.families), as pure functions over a parameter pytree.

Layers repeat `layer_pattern` (3 sliding, 1 global in OLMo 3). Block parameters are stacked on a
leading `layers` axis and the model scans over groups of one pattern period, so the compiled program
does not grow with depth and each layer's kind (window, RoPE) is static. Training, evaluation and
cached decoding run the same block (block.py); they differ in the attention they pass it. Parameters
are kept in model.param_dtype (float32 in every preset); matmuls run in the compute dtype; norms, RoPE,
softmax, logits and the loss in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from olmax.config import REMAT_NAMES, ImplConfig, ModelConfig
from olmax.model import attention as attention_lib
from olmax.model import families
from olmax.model import rope as rope_lib
from olmax.model.attention import cached
from olmax.model import block as block_lib
from olmax.model.block import (ACTIVATION, attention_sublayer, block, compute_dtype, dense_for, mlp_residual,
                               mlp_sublayer, rms_norm)
from olmax.parallel import expert as expert_parallel
from olmax.parallel import pipeline, schedules
from olmax.parallel.mesh import Layout, constrain


GROUP_INPUT = "group_input"  # a layer group's input in the pipeline: kept by every remat policy


# The primitives whose outputs `impl.remat=none` keeps where the compute dtype is narrower than float32: the
# matmuls, the attention kernels (cuDNN's forward by its primitive, Splash's residuals by the name it gives
# them, `context`), the named activations and what an expert exchange received and summed (no collective runs
# twice).
_ATTENTION_KERNELS = ("dot_product_attention_fwd_wrapper",)
_MATMUL_OUTPUTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(*REMAT_NAMES, expert_parallel.EXCHANGED)),
    lambda prim, *_, **__: prim.name in _ATTENTION_KERNELS)


def _remat(impl: ImplConfig, fn, dtype):
    """`fn` (a layer group) under the remat policy, its activations in `dtype`. `none` recomputes nothing a
    matmul or an attention kernel made; with a compute dtype narrower than float32 it recomputes in the
    backward pass the elementwise work between them (the norms, which work in float32, RoPE, SwiGLU's gate)
    rather than keep its intermediates: 2.5 GiB a layer of the 7B at 8,192 tokens a device, 1.0 GiB of them
    the norms' float32 copies, against 0.8 GiB of matmul outputs, as a compiled PyTorch step keeps them.
    In float32 (a CPU's compute) every intermediate is kept, as autodiff keeps it."""
    if impl.remat == "none":
        return fn if dtype == jnp.float32 else jax.checkpoint(fn, policy=_MATMUL_OUTPUTS)
    if impl.remat == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*impl.remat))


def _kept(impl: ImplConfig):
    """The remat policy as seen from outside a layer group: what it keeps, and the group's input."""
    if impl.remat == "none":
        return jax.checkpoint_policies.everything_saveable
    return jax.checkpoint_policies.save_only_these_names(*([] if impl.remat == "full" else impl.remat), GROUP_INPUT)


def _over_groups(cfg: ModelConfig, impl: ImplConfig, group, x, xs, remat: bool, n_layers: int | None = None):
    """x through group(x, xs_g) -> (x, ys_g) for every pattern period g of a stack of n_layers (default all):
    leaves of xs are [n_layers * k, ...] sliced [k, ...] per group; the ys come back as [n_layers * k, ...]."""
    n = (n_layers or cfg.n_layers) // len(cfg.layer_pattern)
    xs = jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), xs)
    group = _remat(impl, group, x.dtype) if remat else group
    if impl.scan_layers:
        x, ys = jax.lax.scan(group, x, xs)
    else:
        outs = []
        for g in range(n):
            x, y = group(x, jax.tree.map(lambda a: a[g], xs))
            outs.append(y)
        ys = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys)


def _embed(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array, layout: Layout | None):
    return constrain(layout, params["embed"].astype(compute_dtype(impl, layout))[tokens], ACTIVATION)


def _pipelined(cfg: ModelConfig, impl: ImplConfig, group, x, blocks: dict, keys: jax.Array | None,
               sched: schedules.Schedule, layout: Layout | None):
    """The layers as a pipeline over the layout's stages (see olmax.parallel.pipeline): x [B, T, D] in
    sched.microbatches micro-batches; aux per micro-batch [M, n_layers, ...]. Per-layer routing keys travel
    with the layers' weights (as their raw bits: a stage's chunk of them, replicated within the stage)."""
    weights, chunk = _chunks(cfg, impl, group, blocks, keys, sched, layout)
    micro = pipeline.split_microbatches(x, sched.microbatches)
    y, aux = pipeline.run(chunk, weights, micro, ACTIVATION, sched, layout, kept=_kept(impl))
    return pipeline.over_stages(layout, pipeline.merge_microbatches(y), ACTIVATION), aux


def _chunks(cfg: ModelConfig, impl: ImplConfig, group, blocks: dict, keys: jax.Array | None,
            sched: schedules.Schedule, layout: Layout | None):
    """(the block weights by stage (pipeline.by_stage), chunk(weights, x) -> (x, aux) running one chunk)."""
    chunk_layers = cfg.n_layers // sched.chunks
    axes = families.param_axes(cfg)["blocks"]
    weights = {name: pipeline.by_stage(layout, w, axes[name], sched) for name, w in blocks.items()}
    if keys is not None:
        weights = (weights, pipeline.by_stage(layout, jax.random.key_data(keys), ("layers", "norm"), sched))

    remat_group = _remat(impl, group, compute_dtype(impl, layout))

    def named_group(x, inputs):
        return remat_group(checkpoint_name(x, GROUP_INPUT), inputs)

    def chunk(w, x):
        w, key_bits = w if keys is not None else (w, None)
        chunk_keys = None if key_bits is None else jax.random.wrap_key_data(key_bits)
        return _over_groups(cfg, impl, named_group, x, (w, chunk_keys), remat=False, n_layers=chunk_layers)

    return weights, chunk


def _stacks(cfg: ModelConfig, impl: ImplConfig, layout: Layout | None, key: jax.Array | None,
            dense=block_lib.dense):
    """(params key, layers, MLP sublayer, per-layer routing keys or None) of each stack of layers in depth
    order: an MoE model's `dense_layers` first (`dense_blocks`), then `blocks`. Routing keys exist for
    routing="random" only: split from `key` (the train step's, a function of its step; a fixed one when None)."""
    stacks = []
    if cfg.dense_layers:
        stacks.append(("dense_blocks", cfg.dense_layers, mlp_sublayer(cfg, impl, layout, "dense", dense), None))
    n = cfg.n_layers - cfg.dense_layers
    keys = None
    if cfg.mlp == "moe" and cfg.moe.routing == "random":
        keys = jax.random.split(jax.random.key(0) if key is None else key, n)
    return stacks + [("blocks", n, mlp_sublayer(cfg, impl, layout, dense=dense), keys)]


def _with_key(mlp, keys, i, part: int = 0):
    if keys is None:
        return mlp
    return functools.partial(mlp, key=keys[i] if part == 0 else jax.random.fold_in(keys[i], part))


def _row_parts(x: jax.Array, parts: int, layout: Layout | None) -> list[jax.Array]:
    """x [B, T, D] as `parts` row groups (part j: rows j, j + parts, ...: each device keeps its own rows), or whole
    where a device's rows do not divide into them (an evaluation's batch; the train step's are checked,
    schedules.check_rows)."""
    shards = layout.data_parallel_size if layout is not None else 1
    if parts == 1 or x.shape[0] % (parts * shards):
        return [x]
    return [constrain(layout, part, ACTIVATION) for part in pipeline.split_microbatches(x, parts)]


def _staggered(fn, parts: list) -> list:
    """fn on each part, part j's after part j - 1's: an optimization barrier ties part j - 1's result to part j's
    input, so XLA neither merges the parts' ops nor runs part j's first, and what depends on part j - 1's result
    (its next sublayer) can run while part j's computes."""
    parts, done = list(parts), []
    for j in range(len(parts)):
        out = fn(parts[j], j)
        if j + 1 < len(parts):
            out, parts[j + 1] = jax.lax.optimization_barrier((out, parts[j + 1]))
        done.append(out)
    return done


def _merged_aux(auxes: list[dict]) -> dict:
    """One layer's aux from its row parts': a float is a mean over a part's tokens (the parts are the same size),
    so their mean, each part's as a micro-batch's (a load-balancing loss is its part's); an int is a count, so
    their sum."""
    if len(auxes) == 1:
        return auxes[0]
    return jax.tree.map(lambda *a: sum(a) if jnp.issubdtype(a[0].dtype, jnp.integer) else sum(a) / len(a), *auxes)


def _group_fn(cfg: ModelConfig, impl: ImplConfig, positions: np.ndarray, layout: Layout | None):
    """stack_group(mlp) -> group(x, (group params, keys)) -> (x, aux): one layer_pattern period of blocks. With
    impl.batch_split the rows run as that many parts, staggered sublayer by sublayer (`_staggered`): one part's
    MLP, an MoE's exchange over the links, runs while the next part's attention computes, and that part's MLP
    while the first part's next attention does (two-batch overlap)."""
    ropes = {kind: rope_lib.tables(cfg.rope[kind], cfg.head_size, positions) for kind in set(cfg.layer_pattern)}
    # Splash kernels anew for each forward: JAX tells a trace's constants apart by the object, and a kernel
    # kept from an earlier trace had its mask tables hoisted once where a new one puts them in twice, so the
    # same step lowered to another program (another compile, another predicted step) after a first trace.
    attention_lib.splash.kernel.cache_clear()
    attentions = [attention_lib.make(impl, cfg.window(i), layout) for i in range(len(cfg.layer_pattern))]
    dense = dense_for(impl, layout)

    def stack_group(mlp):
        def group(x, inputs):
            group_params, keys = inputs
            parts, auxes = _row_parts(x, impl.batch_split, layout), []
            for i, kind in enumerate(cfg.layer_pattern):
                p = jax.tree.map(lambda a: a[i], group_params)
                with jax.named_scope(f"layer{i}.{kind}"):  # for the step-time model's breakdown by layer kind
                    hs = _staggered(lambda x, j: attention_sublayer(cfg, p, x, rope=ropes[kind],
                                                                    attention=attentions[i], layout=layout,
                                                                    dense=dense)[0], parts)
                    outs = _staggered(lambda h, j: mlp_residual(cfg, p, h, mlp=_with_key(mlp, keys, i, j),
                                                                layout=layout), hs)
                parts = [out for out, _ in outs]
                auxes.append(_merged_aux([aux for _, aux in outs]))
            x = parts[0] if len(parts) == 1 else pipeline.merge_microbatches(jnp.stack(parts))
            return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

        return group

    return stack_group, dense


def forward(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array,
            layout: Layout | None = None, key: jax.Array | None = None,
            sched: schedules.Schedule | None = None) -> tuple[jax.Array, dict]:
    """(final-normed hidden states [B, T, d_model] in the compute dtype, aux of every layer of `blocks`
    [n_layers, ...]) for int tokens [B, T] at positions 0..T-1; `key` drives MoE routing="random". With a
    pipeline schedule the layers run pipelined over the layout's stages and aux is per micro-batch,
    [microbatches, n_layers, ...] (a 1F1B schedule's forward runs as its GPipe or circular counterpart: the
    same chunks on the same stages)."""
    stack_group, dense = _group_fn(cfg, impl, np.arange(tokens.shape[1]), layout)
    x = _embed(cfg, impl, params, tokens, layout)
    for name, n, mlp, keys in _stacks(cfg, impl, layout, key, dense):
        if sched is None:
            x, aux = _over_groups(cfg, impl, stack_group(mlp), x, (params[name], keys), remat=True, n_layers=n)
        else:  # one stack (schedules.schedule_for refuses dense_layers)
            x, aux = _pipelined(cfg, impl, stack_group(mlp), x, params[name], keys, sched, layout)
    return rms_norm(x, params["final_norm"], cfg.norm_eps), aux


def forward_loss(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array, row_inputs,
                 head_loss, layout: Layout | None, sched: schedules.Schedule, layers_loss=None):
    """(loss, metrics, aux) under a 1F1B schedule, loss and metrics summed over the pipeline micro-batches, aux
    of every layer per micro-batch [M, n_layers, ...] as `forward` gives it: head_loss(params, final-normed
    hidden [b, T, d_model], (tokens [b, T], row_inputs' leaves [b, ...])) -> (loss, metrics) of one micro-batch
    (rows m, m + M, ...: see pipeline.split_microbatches); layers_loss(aux of some layers) -> what they add to
    the loss (an MoE's router losses; linear in the layers). The gradient of the loss comes from the
    schedule's own backward (pipeline.run_1f1b)."""
    stack_group, dense = _group_fn(cfg, impl, np.arange(tokens.shape[1]), layout)
    (_, n, mlp, _), = _stacks(cfg, impl, layout, None, dense)
    weights, chunk = _chunks(cfg, impl, stack_group(mlp), params["blocks"], None, sched, layout)
    x = _embed(cfg, impl, params, tokens, layout)
    split = functools.partial(pipeline.split_microbatches, microbatches=sched.microbatches)
    # the embedding is a head parameter too where it computes the logits (tie_embeddings)
    head_params = {name: p for name, p in params.items()
                   if name != "blocks" and (name != "embed" or cfg.tie_embeddings)}

    def head(p, y, inputs):
        return head_loss(p, rms_norm(y, p["final_norm"], cfg.norm_eps), inputs)

    return pipeline.run_1f1b(chunk, head, weights, split(x), head_params, jax.tree.map(split, (tokens, row_inputs)),
                             ACTIVATION, sched, layout, layers_loss)


def logits(params: dict, hidden: jax.Array, grad: str = "float32") -> jax.Array:
    """Float32 logits [..., padded_vocab] of hidden states (by the embedding's transpose in a model without an
    LM head of its own: model.tie_embeddings); their gradient taken in float32, or in hidden's dtype where `grad`
    is "compute" (impl.logits_grad)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    if grad == "float32" or hidden.dtype == jnp.float32:
        return jnp.dot(hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return _head_product(hidden, head.astype(hidden.dtype))


@jax.custom_vjp
def _head_product(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """hidden @ head as float32 logits, whose gradient the backward takes in the operands' dtype, as a bfloat16
    autocast head does (OLMo-core's): both its matmuls [tokens, vocab] run at the bfloat16 rate, where a float32
    gradient makes them float32 matmuls."""
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def _head_product_fwd(hidden, head):
    return _head_product(hidden, head), (hidden, head)


def _head_product_bwd(saved, g):
    hidden, head = saved
    g = g.astype(hidden.dtype)
    dh = jnp.einsum("...v,dv->...d", g, head, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...d,...v->dv", hidden, g, preferred_element_type=jnp.float32)
    return dh.astype(hidden.dtype), dw.astype(head.dtype)


_head_product.defvjp(_head_product_fwd, _head_product_bwd)


def forward_logits(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array,
                   layout: Layout | None = None) -> jax.Array:
    """All float32 logits [B, T, padded_vocab] at once (for comparisons; training and evaluation go through
    model/loss.py, a chunk of positions at a time)."""
    return logits(params, forward(cfg, impl, params, tokens, layout)[0])


# --- decoding with a KV cache ----------------------------------------------------------------------


class Cache(NamedTuple):
    """Per layer kind, the KV rings of its layers in depth order: kind -> LayerCache [n, B, slots, Hkv, D]."""

    layers: dict


def cache_slots(cfg: ModelConfig, kind: str, length: int) -> int:
    return length if kind == "global" else min(cfg.sliding_window, length)


def init_cache(cfg: ModelConfig, impl: ImplConfig, batch: int, length: int) -> Cache:
    """An empty cache for `batch` rows of up to `length` positions."""
    dtype = compute_dtype(impl)
    layers = {}
    for kind in set(cfg.layer_pattern):
        n = cfg.n_layers // len(cfg.layer_pattern) * cfg.layer_pattern.count(kind)
        shape = (n, batch, cache_slots(cfg, kind, length), cfg.kv_heads, cfg.head_size)
        layers[kind] = cached.LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return Cache(layers)


def forward_cached(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array, positions: jax.Array,
                   cache: Cache, length: int, lengths: jax.Array | None = None) -> tuple[jax.Array, Cache]:
    """(final-normed hidden states [B, T, d_model], the updated cache) for tokens [B, T] whose row b starts
    at positions[b]; `lengths[b]` of its tokens are real (the rest right padding, never cached); `length`
    is the cache's length in positions (the RoPE table's)."""
    T = tokens.shape[1]
    lengths = jnp.full(tokens.shape[:1], T, jnp.int32) if lengths is None else lengths
    query_pos = positions[:, None] + jnp.arange(T)
    table_pos = np.arange(length)
    ropes = {}
    for kind in set(cfg.layer_pattern):
        cos, sin = rope_lib.tables(cfg.rope[kind], cfg.head_size, table_pos)
        ropes[kind] = (jnp.asarray(cos)[query_pos], jnp.asarray(sin)[query_pos])
    # layer i of the period is the index_in_kind[i]-th of its kind within the period
    index_in_kind = [cfg.layer_pattern[:i].count(kind) for i, kind in enumerate(cfg.layer_pattern)]

    def stack_group(mlp):
        def group(x, inputs):
            group_params, keys, caches = inputs
            new = {kind: [None] * cfg.layer_pattern.count(kind) for kind in caches}
            for i, kind in enumerate(cfg.layer_pattern):
                j = index_in_kind[i]
                layer_cache = jax.tree.map(lambda a: a[j], caches[kind])
                attend = functools.partial(cached.attention, cache=layer_cache, positions=positions,
                                           lengths=lengths, window=cfg.window(i))
                p = jax.tree.map(lambda a: a[i], group_params)
                x, _, new[kind][j] = block(cfg, p, x, rope=ropes[kind], attention=attend, mlp=_with_key(mlp, keys, i))
            return x, {kind: jax.tree.map(lambda *a: jnp.stack(a), *layer_caches) for kind, layer_caches in new.items()}

        return group

    x = _embed(cfg, impl, params, tokens, None)
    period, done, updated = len(cfg.layer_pattern), 0, []
    for name, n, mlp, keys in _stacks(cfg, impl, None, None):
        # a kind's cache entries are in depth order: this stack's follow those of the `done` periods before it
        caches = {kind: jax.tree.map(lambda a, c=cfg.layer_pattern.count(kind): a[done * c: (done + n // period) * c],
                                     layer) for kind, layer in cache.layers.items()}
        x, new = _over_groups(cfg, impl, stack_group(mlp), x, (params[name], keys, caches), remat=False, n_layers=n)
        updated.append(new)
        done += n // period
    layers = {kind: jax.tree.map(lambda *a: jnp.concatenate(a), *(new[kind] for new in updated))
              for kind in cache.layers}
    return rms_norm(x, params["final_norm"], cfg.norm_eps), Cache(layers)
