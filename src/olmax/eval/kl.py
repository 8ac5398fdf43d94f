"""Token-level KL(A || B) between two models on identical inputs.

Both models read the same rows of a held-out set (documents.py); at every
predicted position, KL over the real vocabulary in float32, and whether the
two argmax tokens agree. Reported: mean, quantiles, max, top-1 agreement, and
a histogram (PNG) of log10 KL. For scale (MaxText's OLMo 3 reproduction,
https://github.com/AI-Hypercomputer/maxtext/pull/3886): two independent runs of one
recipe differ by 0.389 nats; framework noise is about 200x smaller. The logits are
computed a chunk of positions at a time (`impl.loss_chunk` of model A), never whole.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import RunConfig
from olmax.eval.documents import Selection, read_rows
from olmax.errors import EvalError
from olmax.eval.models import Model, batch_rows, place, put_batch
from olmax.model import transformer
from olmax.model.loss import over_logits
from olmax.parallel.mesh import Layout

QUANTILES = (0.5, 0.9, 0.99, 0.999)
HISTOGRAM_FLOOR = 1e-12  # KL values below this (exact zeros included) land in the first bin


def _kl(logits):
    log_p, log_q = (jax.nn.log_softmax(x, axis=-1) for x in logits)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return kl, jnp.argmax(log_p, axis=-1) == jnp.argmax(log_q, axis=-1)


def make_token_kl(cfg_a: RunConfig, cfg_b: RunConfig, layout: Layout) -> Callable:
    """jit (params_a, params_b, inputs) -> (KL(A || B) [B, T], argmax agreement [B, T]), replicated."""
    vocab = cfg_a.model.vocab_size

    def token_kl(params_a, params_b, inputs):
        hidden_a, _ = transformer.forward(cfg_a.model, cfg_a.impl, params_a, inputs, layout)
        hidden_b, _ = transformer.forward(cfg_b.model, cfg_b.impl, params_b, inputs, layout)
        return over_logits(lambda logits: _kl(tuple(x[..., :vocab] for x in logits)), (params_a, params_b),
                           (hidden_a, hidden_b), (), cfg_a.impl.loss_chunk)

    return jax.jit(token_kl, out_shardings=layout.replicated)


def token_kls(model_a: Model, model_b: Model, selection: Selection, layout: Layout, *,
              rows_per_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(KL, argmax agreement) at every predicted position of the selection, in row order."""
    a, b = model_a.cfg, model_b.cfg
    if a.model.vocab_size != b.model.vocab_size:
        raise EvalError(f"{model_a.name} has vocab {a.model.vocab_size}, {model_b.name} has {b.model.vocab_size}: "
                        "KL needs one tokenizer")
    params_a, params_b = place(a, model_a.params, layout), place(b, model_b.params, layout)
    kl_fn = make_token_kl(a, b, layout)
    rows = batch_rows(rows_per_batch, layout)
    kls, agree = [], []
    for first in range(0, len(selection.rows), rows):
        inputs, _, weights = read_rows(selection, slice(first, first + rows), eos_id=a.data.eos_id,
                                       pad_id=a.data.pad_id, vocab_size=a.model.vocab_size, batch_rows=rows)
        kl, same = kl_fn(params_a, params_b, *put_batch((inputs,), layout))
        counted = weights > 0
        kls.append(np.asarray(kl)[counted])
        agree.append(np.asarray(same)[counted])
    return np.concatenate(kls), np.concatenate(agree)


def summarize(kl: np.ndarray, agree: np.ndarray) -> dict:
    return {
        "tokens": int(kl.size),
        "kl_mean": float(kl.astype(np.float64).mean()),
        "kl_quantiles": {f"p{100 * q:g}": float(np.quantile(kl, q)) for q in QUANTILES},
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()),
    }


def histogram(kl: np.ndarray, bins: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(counts, log10 edges) of log10 KL over whole decades from the smallest value to the largest; values
    below HISTOGRAM_FLOOR (exact zeros too) count in the first bin."""
    logs = np.log10(np.maximum(kl.astype(np.float64), HISTOGRAM_FLOOR))
    low = math.floor(logs.min())
    return np.histogram(logs, bins=bins, range=(low, max(math.ceil(logs.max()), low + 1)))


def plot_histogram(kl: np.ndarray, summary: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts, edges = histogram(kl)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="tab:blue")
    ax.axvline(math.log10(max(summary["kl_mean"], HISTOGRAM_FLOOR)), color="tab:red", label="mean")
    ax.set_yscale("log")
    ax.set_xlabel(f"log10 KL per token in nats (values < {HISTOGRAM_FLOOR:g} in the first bin)")
    ax.set_ylabel("tokens")
    q = summary["kl_quantiles"]
    ax.set_title(f"{title}\nmean {summary['kl_mean']:.3g}  p50 {q['p50']:.3g}  p99 {q['p99']:.3g}  "
                 f"top-1 {summary['top1_agreement']:.2%}  ({summary['tokens']:,} tokens)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
