"""Held-out loss and per-domain perplexity (Paloma style): CE, PPL and bits per byte of labeled sets.

Each row's summed CE comes back from the device; the sums per set are taken on
the host in float64 in row order, so the result does not depend on how rows
were batched or how many devices shared them. CE is over the real vocabulary
(not the embedding's padding rows), so an olmax checkpoint and its HF export
score the same. Bits per byte = summed CE / ln 2 / UTF-8 bytes of the
documents read (from the tokenize sidecars).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np

from olmax.config import RunConfig
from olmax.eval.documents import Selection, read_rows
from olmax.eval.models import batch_rows, put_batch
from olmax.model import transformer
from olmax.model.loss import target_log_probs
from olmax.parallel import pipeline
from olmax.parallel.mesh import Layout


def make_row_losses(cfg: RunConfig, layout: Layout) -> Callable:
    """jit (params, inputs, targets, weights) -> summed CE per row, float32 [B], replicated. On a stage mesh
    the layers run pipelined (B a multiple of the data-parallel size x the pipeline's micro-batches)."""
    sched = pipeline.eval_schedule(cfg, layout)

    def row_losses(params, inputs, targets, weights):
        hidden, _ = transformer.forward(cfg.model, cfg.impl, params, inputs, layout, None, sched)
        log_probs = target_log_probs(params, hidden, targets, cfg.model.vocab_size, cfg.impl.loss_chunk)
        return -(log_probs * weights).sum(axis=1)

    return jax.jit(row_losses, out_shardings=layout.replicated)


def summed_losses(row_losses: Callable, params: dict, selection: Selection, layout: Layout, *,
                  rows_per_batch: int, eos_id: int, pad_id: int, vocab_size: int) -> np.ndarray:
    """Summed CE of every row of the selection, float32 [rows], in row order."""
    rows = batch_rows(rows_per_batch, layout)
    out = []
    for first in range(0, len(selection.rows), rows):
        batch = read_rows(selection, slice(first, first + rows), eos_id=eos_id, pad_id=pad_id,
                          vocab_size=vocab_size, batch_rows=rows)
        out.append(row_losses(params, *put_batch(batch, layout)))
    n = len(selection.rows)
    return np.concatenate([np.asarray(x) for x in out])[:n]


def set_results(selection: Selection, losses: np.ndarray) -> dict[str, dict]:
    """label -> CE loss, PPL, bits per byte (None without sidecars), tokens, bytes, documents, rows."""
    totals = np.zeros(len(selection.sets), dtype=np.float64)
    np.add.at(totals, selection.rows.set_index, losses.astype(np.float64))
    counts = np.bincount(selection.rows.set_index, minlength=len(selection.sets))
    results = {}
    for i, eval_set in enumerate(selection.sets):
        tokens, text_bytes = selection.tokens[i], selection.text_bytes[i]
        ce = float(totals[i] / tokens)
        results[eval_set.label] = {
            "CE loss": ce,
            "PPL": math.exp(ce),
            "bits per byte": float(totals[i] / math.log(2) / text_bytes) if text_bytes else None,
            "tokens": tokens,
            "bytes": text_bytes,
            "documents": selection.documents[i],
            "rows": int(counts[i]),
            "sum CE (nats)": float(totals[i]),
        }
    return results


def macro_average(results: dict[str, dict]) -> dict:
    """Unweighted mean over the sets (Paloma's macro average); bits per byte only if every set has it."""
    bpb = [r["bits per byte"] for r in results.values()]
    return {
        "CE loss": float(np.mean([r["CE loss"] for r in results.values()])),
        "PPL": float(np.mean([r["PPL"] for r in results.values()])),
        "bits per byte": float(np.mean(bpb)) if all(b is not None for b in bpb) else None,
        "sets": len(results),
    }


def evaluate(cfg: RunConfig, params: dict, selection: Selection, layout: Layout, *, rows_per_batch: int,
             row_losses: Callable | None = None) -> dict:
    """{"sets": label -> results, "macro": averages, "sequence_length", "rows_per_batch"}."""
    row_losses = row_losses or make_row_losses(cfg, layout)
    sched = pipeline.eval_schedule(cfg, layout)
    rows_per_batch = batch_rows(rows_per_batch, layout, sched.microbatches if sched else 1)
    losses = summed_losses(row_losses, params, selection, layout, rows_per_batch=rows_per_batch,
                           eos_id=cfg.data.eos_id, pad_id=cfg.data.pad_id, vocab_size=cfg.model.vocab_size)
    results = set_results(selection, losses)
    return {"sets": results, "macro": macro_average(results), "sequence_length": selection.sequence_length,
            "rows_per_batch": batch_rows(rows_per_batch, layout)}
