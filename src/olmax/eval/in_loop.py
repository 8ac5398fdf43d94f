"""Evaluations during training: the held-out sets every `eval.every` steps, harness tasks every
`eval.harness_every` steps, as metrics named like OLMo-core's:

    eval/lm/{label}/CE loss, eval/lm/{label}/PPL, eval/lm/{label}/BPB (with tokenize sidecars),
    eval/downstream/{task}/{metric}

The sets are opened, their documents chosen and their rows fixed once, when the
evaluator is made; every evaluation then reads the very same rows.
"""

from __future__ import annotations

from olmax.config import RunConfig
from olmax.eval.documents import Selection, open_eval_set, select, shard_paths
from olmax.eval.heldout import evaluate, make_row_losses
from olmax.parallel.mesh import Layout


def lm_metrics(results: dict) -> dict[str, float]:
    out = {}
    for label, r in results["sets"].items():
        out[f"eval/lm/{label}/CE loss"] = r["CE loss"]
        out[f"eval/lm/{label}/PPL"] = r["PPL"]
        if r["bits per byte"] is not None:
            out[f"eval/lm/{label}/BPB"] = r["bits per byte"]
    return out


def eval_selection(cfg: RunConfig) -> Selection:
    """The documents and rows of the config's held-out sets that every in-loop evaluation reads."""
    e, data = cfg.eval, cfg.data
    sets = [open_eval_set(s.label, shard_paths(s.paths, s.mix_file), token_dtype=data.token_dtype,
                          eos_id=data.eos_id) for s in e.sets]
    return select(sets, sequence_length=data.sequence_length, tokens=e.tokens, seed=e.seed)


class InLoopEval:
    """`evaluate(step, params) -> metrics`: the evaluations due at `step` ({} when none is), on the train
    state's params (on `layout`). `due(step)` says beforehand whether there will be any, so the trainer can
    wait for the step to finish before timing the evaluation."""

    def __init__(self, cfg: RunConfig, layout: Layout):
        self.cfg, self.layout = cfg, layout
        e = cfg.eval
        self.selection = None
        if e.every is not None:
            self.selection = eval_selection(cfg)
            self.row_losses = make_row_losses(cfg, layout)
        self.rows = e.batch_instances or (cfg.train.micro_batch_per_device * layout.data_parallel_size
                                          if cfg.train.micro_batch_per_device else cfg.train.global_batch_instances)
        self.harness_lm = None
        if e.harness_every is not None:
            from olmax.eval import harness  # lm-eval is imported, and the tokenizer read, before the first step

            self.tokenizer = harness.load_text_tokenizer(e.tokenizer)

    def lm_due(self, step: int) -> bool:
        return self.cfg.eval.every is not None and step % self.cfg.eval.every == 0

    def harness_due(self, step: int) -> bool:
        return self.cfg.eval.harness_every is not None and step % self.cfg.eval.harness_every == 0

    def due(self, step: int) -> bool:
        return self.lm_due(step) or self.harness_due(step)

    def __call__(self, step: int, params: dict) -> dict[str, float]:
        e, data = self.cfg.eval, self.cfg.data
        metrics = {}
        if self.lm_due(step):
            results = evaluate(self.cfg, params, self.selection, self.layout, rows_per_batch=self.rows,
                               row_losses=self.row_losses)
            metrics.update(lm_metrics(results))
        if self.harness_due(step):
            from olmax.eval import harness

            if self.harness_lm is None:
                self.harness_lm = harness.OlmaxLM(self.cfg, params, self.tokenizer, self.layout,
                                                  max_length=data.sequence_length, batch_size=self.rows)
            self.harness_lm.params = params
            results = harness.run_tasks(self.harness_lm, e.harness_tasks, limit=e.harness_limit,
                                        include_path=e.harness_include_path)
            metrics.update(harness.flat_metrics(results))
        return metrics


def make_in_loop_eval(cfg: RunConfig, layout: Layout) -> InLoopEval | None:
    """None when the config asks for no in-loop eval, else the evaluator (see InLoopEval); the trainer's
    `make_eval`."""
    if cfg.eval.every is None and cfg.eval.harness_every is None:
        return None
    return InLoopEval(cfg, layout)
