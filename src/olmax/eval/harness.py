"""lm-eval-harness on olmax models: the `lm_eval` model adapter, task runs, deltas between two models.

The adapter scores token lists with the olmax forward pass, batched and
sharded over the mesh's batch axes: `loglikelihood` (log p(continuation |
context) and whether it is the greedy continuation), `loglikelihood_rolling`
(lm-eval's disjoint windows: every token once, with as much context as fits),
and `generate_until` (greedy, with the model's KV cache). Rows of a batch are
right-padded to a power of two, so a run compiles a handful of shapes.

OLMo 3's tokenizer has no BOS: an empty context is EOS, as in lm-eval.
Tasks are lm-eval's own (the 8-task suite of MaxText's OLMo 3 reproduction,
https://github.com/AI-Hypercomputer/maxtext/pull/3886, is the CLI default, for
machines that hold the datasets; nothing is downloaded when
HF_DATASETS_OFFLINE=1) or defined in a local directory of task YAMLs.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from olmax.config import RunConfig
from olmax.errors import EvalError
from olmax.eval.models import batch_rows, put_batch
from olmax.model import generate, transformer
from olmax.model.loss import over_logits
from olmax.parallel import pipeline
from olmax.parallel.mesh import Layout

MIN_BUCKET = 16


def load_text_tokenizer(path: str | Path):
    """HF `tokenizers` tokenizer.json (a file, or a directory holding one)."""
    from olmax.data.tokenize import load_tokenizer

    path = Path(path)
    return load_tokenizer(path / "tokenizer.json" if path.is_dir() else path)


def _bucket(length: int, cap: int) -> int:
    return min(cap, max(MIN_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))))


class OlmaxLM(TemplateLM):
    """An olmax model (params already placed on `layout`) as an lm-eval LM."""

    def __init__(self, cfg: RunConfig, params: dict, tokenizer, layout: Layout, *, max_length: int,
                 batch_size: int = 16, max_gen_toks: int = 256):
        super().__init__()
        self.params, self.layout = params, layout
        self.text_tokenizer = tokenizer
        self.eos_id, self.max_length, self.max_gen_toks = cfg.data.eos_id, max_length, max_gen_toks
        sched = pipeline.eval_schedule(cfg, layout)  # scoring runs pipelined on a stage mesh; generation does not
        self.batch_size = batch_rows(batch_size, layout, sched.microbatches if sched else 1)
        model_cfg, impl, vocab = cfg.model, cfg.impl, cfg.model.vocab_size

        def scored(logits, targets):
            logits = logits[0][..., :vocab]
            log_prob = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, -1)
            return log_prob, jnp.argmax(logits, axis=-1) == targets

        def score(params, inputs, targets):
            hidden, _ = transformer.forward(model_cfg, impl, params, inputs, layout, None, sched)
            return over_logits(scored, (params,), (hidden,), (targets,), impl.loss_chunk)

        self._score = jax.jit(score, out_shardings=layout.replicated)
        self._prefill = jax.jit(functools.partial(generate.prefill, model_cfg, impl, length=max_length))
        self._step = jax.jit(functools.partial(generate.step, model_cfg, impl, length=max_length), donate_argnums=3)

    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text_tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text_tokenizer.decode(list(tokens), skip_special_tokens=False)

    # --- scoring -------------------------------------------------------------------------------

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), continuation is greedy) of token-list pairs, in order.

        Context and continuation are cut to the last max_length + 1 tokens, as in lm-eval's HF model."""
        if too_long := [len(c) for _, c in pairs if len(c) > self.max_length]:
            raise EvalError(f"continuations of {max(too_long)} tokens exceed max_length {self.max_length}")
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for first in range(0, len(order), self.batch_size):
            chunk = order[first : first + self.batch_size]
            windows = [(list(pairs[i][0]) + list(pairs[i][1]))[-(self.max_length + 1) :] for i in chunk]
            width = _bucket(max(len(w) - 1 for w in windows), self.max_length)
            inputs = np.zeros((self.batch_size, width), dtype=np.int32)
            targets = np.zeros((self.batch_size, width), dtype=np.int32)
            for row, window in enumerate(windows):
                inputs[row, : len(window) - 1] = window[:-1]
                targets[row, : len(window) - 1] = window[1:]
            log_probs, greedy = (np.asarray(x) for x in self._score(self.params, *put_batch((inputs, targets), self.layout)))
            for row, (i, window) in enumerate(zip(chunk, windows)):
                n = len(window) - 1
                span = slice(n - len(pairs[i][1]), n)
                results[i] = (float(log_probs[row, span].astype(np.float64).sum()), bool(greedy[row, span].all()))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        return self.score_tokens([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for window in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.eos_id,
                                                    max_seq_len=self.max_length, context_len=1):
                pairs.append(make_disjoint_window(window))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (log_prob, _) in zip(owner, self.score_tokens(pairs)):
            totals[index] += log_prob
        return totals

    # --- generation ------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(self._generation_settings(request.args[1]), []).append(i)
        for (until, max_new), indices in groups.items():
            indices.sort(key=lambda i: -len(requests[i].args[0]))
            for first in range(0, len(indices), self.batch_size):
                chunk = indices[first : first + self.batch_size]
                texts = self.greedy([requests[i].args[0] for i in chunk], list(until), max_new)
                for i, text in zip(chunk, texts):
                    out[i] = text
        return out

    def _generation_settings(self, kwargs: dict) -> tuple[tuple[str, ...], int]:
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
            raise EvalError(f"generation settings {kwargs}: olmax's harness adapter decodes greedily only")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        return tuple(until), int(kwargs.get("max_gen_toks", self.max_gen_toks))

    def greedy(self, contexts: list[str], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of up to `max_new` tokens, each cut before the first stop string; a row
        also stops at EOS."""
        if max_new >= self.max_length:
            raise EvalError(f"max_gen_toks {max_new} leaves no room for a context in max_length {self.max_length}")
        prompts = [(self.tok_encode(c) or [self.eos_id])[-(self.max_length - max_new) :] for c in contexts]
        lengths = np.ones(self.batch_size, dtype=np.int32)
        lengths[: len(prompts)] = [len(p) for p in prompts]
        tokens = np.zeros((self.batch_size, _bucket(int(lengths.max()), self.max_length)), dtype=np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        next_tokens, cache = self._prefill(self.params, tokens, lengths)
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for i in range(max_new):
            chosen = np.asarray(next_tokens)
            for row in range(len(prompts)):
                if done[row]:
                    continue
                if int(chosen[row]) == self.eos_id:
                    done[row] = True
                    continue
                generated[row].append(int(chosen[row]))
                done[row] = any(stop in self.tok_decode(generated[row]) for stop in until)
            if all(done) or i == max_new - 1:
                break
            next_tokens, cache = self._step(self.params, chosen.astype(np.int32), lengths + i, cache)
        texts = [self.tok_decode(g) for g in generated]
        for stop in until:
            texts = [t.split(stop)[0] for t in texts]
        return texts


# --- running tasks ---------------------------------------------------------------------------------


def parse_tasks(specs: list[str]) -> dict[int | None, list[str]]:
    """`name` (the task's own few-shot setting) or `name:shots` -> tasks grouped by shots."""
    groups: dict[int | None, list[str]] = {}
    for spec in specs:
        name, _, shots = spec.partition(":")
        if not name or (shots and not shots.isdigit()):
            raise EvalError(f"task {spec!r}: write `name` or `name:shots` (e.g. mmlu:5)")
        groups.setdefault(int(shots) if shots else None, []).append(name)
    return groups


def run_tasks(lm: OlmaxLM, specs: list[str], *, limit: int | None = None, include_path: str | None = None,
              bootstrap_iters: int = 100_000, seed: int = 1234) -> dict:
    """{task: {metric: {"value", "stderr"}}} plus {"samples": {task: n}}; tasks grouped by few-shot count."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    groups = parse_tasks(specs)
    wanted = [name for names in groups.values() for name in names]
    # Indexing lm-eval's own ~15k task configs takes seconds: skip it when the local directory has them all.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(name not in manager.all_tasks for name in wanted):
        manager = TaskManager(include_path=include_path)
    tasks, samples = {}, {}
    for shots, names in groups.items():
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:
            raise EvalError(f"unknown lm-eval tasks {unknown}; define them in a directory passed as include_path, "
                            "or check the names with `lm-eval ls tasks`")
        out = simple_evaluate(model=lm, tasks=names, num_fewshot=shots, limit=limit, task_manager=manager,
                              log_samples=False, bootstrap_iters=bootstrap_iters, random_seed=seed,
                              numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        for task, values in out["results"].items():
            tasks[task] = _metrics(values)
            if shots is not None:
                tasks[task]["num_fewshot"] = shots
        samples.update({task: n["effective"] for task, n in out.get("n-samples", {}).items()})
    return {"tasks": tasks, "samples": samples}


def _metrics(values: dict) -> dict:
    metrics = {}
    for key, value in values.items():
        metric, _, filter_name = key.partition(",")
        if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        stderr = values.get(f"{metric}_stderr,{filter_name}")
        name = metric if filter_name == "none" else f"{metric},{filter_name}"
        metrics[name] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
    return metrics


def deltas(a: dict, b: dict) -> dict:
    """B - A for every task metric both have, its stderr sqrt(se_A^2 + se_B^2), and delta / stderr."""
    out = {}
    for task in sorted(set(a["tasks"]) & set(b["tasks"])):
        for metric, va in a["tasks"][task].items():
            vb = b["tasks"][task].get(metric)
            if not isinstance(va, dict) or vb is None:
                continue
            delta = vb["value"] - va["value"]
            stderr = (math.hypot(va["stderr"], vb["stderr"])
                      if va["stderr"] is not None and vb["stderr"] is not None else None)
            out.setdefault(task, {})[metric] = {
                "a": va["value"], "b": vb["value"], "delta": delta, "stderr": stderr,
                "z": delta / stderr if stderr else None,
            }
    return out


def flat_metrics(results: dict, prefix: str = "eval/downstream") -> dict[str, float]:
    """Scalars for the metric writers: {prefix}/{task}/{metric}."""
    return {f"{prefix}/{task}/{metric}": v["value"]
            for task, metrics in results["tasks"].items() for metric, v in metrics.items() if isinstance(v, dict)}
