"""Evaluations during training: the held-out sets every `eval.every` steps, harness tasks every
`eval.harness_every` steps, as metrics named like OLMo-core's:

    eval/lm/{label}/CE loss, eval/lm/{label}/PPL, eval/lm/{label}/BPB (with tokenize sidecars),
    eval/downstream/{task}/{metric}

The sets are opened, their documents chosen and their rows fixed once, when the
evaluator is made; every evaluation then reads the very same rows.
"""

from __future__ import annotations

from typing import Callable

from jax.sharding import Mesh

from olmax.config import RunConfig
from olmax.eval.documents import open_eval_set, select, shard_paths
from olmax.eval.heldout import evaluate, make_row_losses
from olmax.parallel.mesh import data_parallel_size


def lm_metrics(results: dict) -> dict[str, float]:
    out = {}
    for label, r in results["sets"].items():
        out[f"eval/lm/{label}/CE loss"] = r["CE loss"]
        out[f"eval/lm/{label}/PPL"] = r["PPL"]
        if r["bits per byte"] is not None:
            out[f"eval/lm/{label}/BPB"] = r["bits per byte"]
    return out


def make_in_loop_eval(cfg: RunConfig, mesh: Mesh) -> Callable[[int, dict], dict[str, float]] | None:
    """None when the config asks for no in-loop eval; else `evaluate(step, params) -> metrics`, which
    returns the evaluations due at `step` ({} when none is). `params` are the train state's, on `mesh`."""
    e, data = cfg.eval, cfg.data
    if e.every is None and e.harness_every is None:
        return None
    selection = None
    if e.every is not None:
        sets = [open_eval_set(s.label, shard_paths(s.paths, s.mix_file), token_dtype=data.token_dtype,
                              eos_id=data.eos_id) for s in e.sets]
        selection = select(sets, sequence_length=data.sequence_length, tokens=e.tokens, seed=e.seed)
        row_losses = make_row_losses(cfg.model, mesh)
    rows = e.batch_instances or (cfg.train.micro_batch_per_device * data_parallel_size(mesh)
                                 if cfg.train.micro_batch_per_device else cfg.train.global_batch_instances)
    harness_lm = None
    if e.harness_every is not None:
        from olmax.eval import harness  # lm-eval is imported, and the tokenizer read, before the first step

        tokenizer = harness.load_text_tokenizer(e.tokenizer)

    def run(step: int, params: dict) -> dict[str, float]:
        nonlocal harness_lm
        metrics = {}
        if selection is not None and step % e.every == 0:
            results = evaluate(cfg.model, params, selection, mesh, rows_per_batch=rows, eos_id=data.eos_id,
                               pad_id=data.pad_id, row_losses=row_losses)
            metrics.update(lm_metrics(results))
        if e.harness_every is not None and step % e.harness_every == 0:
            if harness_lm is None:
                harness_lm = harness.OlmaxLM(cfg.model, params, tokenizer, mesh, eos_id=data.eos_id,
                                             max_length=data.sequence_length, batch_size=rows)
            harness_lm.params = params
            results = harness.run_tasks(harness_lm, e.harness_tasks, limit=e.harness_limit,
                                        include_path=e.harness_include_path)
            metrics.update(harness.flat_metrics(results))
        return metrics

    return run
