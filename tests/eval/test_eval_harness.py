"""The lm-eval-harness adapter: its scores against a direct computation, greedy generation with a KV cache
against recomputing the whole sequence, and a harness run on tasks defined here (local files, no download)."""

import functools
import json
import math
import os

import jax
import numpy as np
import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from olmax.checkpoint import Checkpointer, run_meta  # noqa: E402
from olmax.config import CheckpointConfig  # noqa: E402
from olmax.data.tokenize import train_tokenizer  # noqa: E402
from olmax.eval import harness  # noqa: E402
from olmax.eval.models import eval_layout, place  # noqa: E402
from olmax.model import transformer  # noqa: E402

WORDS = "the cat sat on a mat and the dog ran to the red house while small birds sang over green hills".split()
MAX_LENGTH = 32


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer")
    rng = np.random.default_rng(0)
    (root / "text.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, 20))}) + "\n"
                                             for _ in range(100)))
    return train_tokenizer([str(root / "text.jsonl")], root / "tokenizer.json", vocab_size=300, progress=False)


@pytest.fixture(scope="module")
def lm(cfg, params, tokenizer_path):
    layout = eval_layout()
    return harness.OlmaxLM(cfg, place(cfg, params, layout), harness.load_text_tokenizer(tokenizer_path), layout,
                           max_length=MAX_LENGTH, batch_size=8, max_gen_toks=12)


@pytest.fixture(scope="module")
def forward(cfg, params):
    """tokens [1, MAX_LENGTH] -> float32 logits over the real vocabulary, by the plain forward pass."""
    jitted = jax.jit(functools.partial(transformer.forward_logits, cfg.model, cfg.impl))
    return lambda tokens: np.asarray(jitted(params, tokens))[..., : cfg.model.vocab_size]


def direct_scores(forward, pairs):
    """(sum log p(continuation | context), all greedy) per pair by a plain forward pass over one row each."""
    out = []
    for context, continuation in pairs:
        window = (context + continuation)[-(MAX_LENGTH + 1) :]
        inputs = np.zeros((1, MAX_LENGTH), dtype=np.int32)
        inputs[0, : len(window) - 1] = window[:-1]
        logits = forward(inputs)[0, : len(window) - 1]
        logits = logits.astype(np.float64)
        log_probs = logits - (np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1))[:, None]
        positions = np.arange(len(window) - 1 - len(continuation), len(window) - 1)
        targets = np.asarray(window[1:])[positions]
        out.append((log_probs[positions, targets].sum(), bool((logits[positions].argmax(-1) == targets).all())))
    return out


def test_loglikelihood_equals_a_direct_computation(forward, lm):
    requests = [("the cat sat on", " a mat"), ("", "the dog ran"), ("birds sang over green hills and " * 6, " the end"),
                ("red house", " while small birds")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)], disable_tqdm=True)
    pairs = [([0], lm.tok_encode(cont)) if not ctx else lm._encode_pair(ctx, cont) for ctx, cont in requests]
    assert len(pairs[2][0]) + len(pairs[2][1]) > MAX_LENGTH + 1, "one request is cut to the context length"
    for (log_prob, greedy), (want, want_greedy) in zip(got, direct_scores(forward, pairs)):
        assert log_prob == pytest.approx(want, rel=1e-5, abs=1e-4) and greedy == want_greedy


def test_greedy_continuations_score_as_greedy(cfg, forward, lm):
    context = lm.tok_encode("the cat sat on a mat")
    inputs = np.zeros((1, MAX_LENGTH), dtype=np.int32)
    inputs[0, : len(context)] = context
    best = int(forward(inputs)[0, len(context) - 1].argmax())
    other = (best + 1) % cfg.model.vocab_size
    (_, greedy), (_, not_greedy) = lm.score_tokens([(context, [best]), (context, [other])])
    assert greedy and not not_greedy


def test_loglikelihood_rolling_scores_lm_evals_windows(forward, lm):
    texts = ["green hills", " ".join(WORDS * 3)]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for text, total in zip(texts, got):
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=0, max_seq_len=MAX_LENGTH, context_len=1)]
        assert total == pytest.approx(sum(s for s, _ in direct_scores(forward, windows)), rel=1e-5)
    assert len(windows) > 2


def naive_greedy(forward, lm, context: str, steps: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence for every new token (no cache)."""
    tokens = lm.tok_encode(context)
    for _ in range(steps):
        inputs = np.zeros((1, MAX_LENGTH), dtype=np.int32)
        inputs[0, : len(tokens)] = tokens
        best = int(forward(inputs)[0, len(tokens) - 1].argmax())
        if best == 0:
            break
        tokens.append(best)
    return tokens[len(lm.tok_encode(context)) :]


def test_generate_until_with_a_kv_cache_equals_recomputing(forward, lm):
    contexts = ["the cat", "small birds sang over the green hills and the", "a"]
    want = [lm.tok_decode(naive_greedy(forward, lm, c, 12)) for c in contexts]
    got = lm.generate_until([Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": 12}), i)
                             for i, c in enumerate(contexts)])
    assert got == want and all(want)
    stop = want[1][len(want[1]) // 2 :][:3]
    cut = lm.generate_until([Instance("generate_until", {}, (contexts[1], {"until": [stop], "max_gen_toks": 12}), 0)])
    assert cut == [want[1].split(stop)[0]]


TASKS = {
    "toy_choice.yaml": """task: toy_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""",
    "toy_generate.yaml": """task: toy_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(1)
    rows = [{"question": " ".join(rng.choice(WORDS, 5)), "choices": [" ".join(rng.choice(WORDS, 2)) for _ in range(3)],
             "label": int(rng.integers(3))} for _ in range(10)]
    (root / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, text in TASKS.items():
        (root / name).write_text(text.format(data=root / "toy.jsonl"))
    return root


@pytest.mark.slow
def test_harness_cli_runs_local_tasks_on_two_checkpoints(cfg, params, tokenizer_path, task_dir, tmp_path):
    from test_eval import run_cli

    runs = []
    for name, p in (("a", params), ("b", jax.tree.map(lambda x: x * 1.5, params))):
        checkpointer = Checkpointer(tmp_path / name, CheckpointConfig())
        checkpointer.save_params(0, p, run_meta(cfg, 0, {}))
        checkpointer.close()
        runs.append(tmp_path / name)
    run_cli("eval", "harness", *runs, "--tasks", "toy_choice,toy_generate:0", "--tokenizer", tokenizer_path,
            "--include-path", task_dir, "--limit", 8, "--batch-size", 8, "--out", tmp_path / "harness.json")
    report = json.loads((tmp_path / "harness.json").read_text())
    for side in ("a", "b"):
        assert report[side]["samples"] == {"toy_choice": 8, "toy_generate": 8}
        acc = report[side]["tasks"]["toy_choice"]["acc"]
        assert 0 <= acc["value"] <= 1 and acc["stderr"] == pytest.approx(
            math.sqrt(acc["value"] * (1 - acc["value"]) / 7))  # lm-eval: sample stddev / sqrt(n)
    delta = report["deltas"]["toy_choice"]["acc"]
    a, b = report["a"]["tasks"]["toy_choice"]["acc"], report["b"]["tasks"]["toy_choice"]["acc"]
    assert delta["delta"] == pytest.approx(b["value"] - a["value"])
    assert delta["stderr"] == pytest.approx(math.hypot(a["stderr"], b["stderr"]))
    assert "exact_match" in report["deltas"]["toy_generate"]
    # an earlier result file stands in for a model
    run_cli("eval", "harness", runs[0], "--tasks", "toy_choice",
            "--tokenizer", tokenizer_path, "--include-path", task_dir, "--limit", 8, "--out", tmp_path / "a.json")
    run_cli("eval", "harness", tmp_path / "a.json", tmp_path / "a.json", "--out", tmp_path / "same.json")
    same = json.loads((tmp_path / "same.json").read_text())["deltas"]["toy_choice"]["acc"]
    assert same["delta"] == 0 and same["a"] == a["value"]


def test_deltas_combine_stderr_in_quadrature():
    a = {"tasks": {"t": {"acc": {"value": 0.5, "stderr": 0.03}, "f1": {"value": 0.2, "stderr": None}}}}
    b = {"tasks": {"t": {"acc": {"value": 0.54, "stderr": 0.04}, "f1": {"value": 0.1, "stderr": 0.01}}}}
    d = harness.deltas(a, b)["t"]
    assert d["acc"]["delta"] == pytest.approx(0.04) and d["acc"]["stderr"] == pytest.approx(0.05)
    assert d["acc"]["z"] == pytest.approx(0.8)
    assert d["f1"]["stderr"] is None and d["f1"]["z"] is None
    assert harness.flat_metrics(b) == {"eval/downstream/t/acc": 0.54, "eval/downstream/t/f1": 0.1}


def test_task_specs():
    assert harness.parse_tasks(["mmlu:5", "piqa", "boolq:0"]) == {5: ["mmlu"], None: ["piqa"], 0: ["boolq"]}
    with pytest.raises(ValueError, match="name:shots"):
        harness.parse_tasks(["mmlu:five"])


@pytest.mark.slow
def test_in_loop_harness_metrics(cfg, params, tokenizer_path, task_dir):
    from olmax.eval.in_loop import make_in_loop_eval
    from olmax.parallel.mesh import make_layout

    run = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={
        "harness_every": 4, "harness_tasks": ["toy_choice"], "harness_limit": 4, "tokenizer": tokenizer_path,
        "harness_include_path": str(task_dir)})})
    layout = make_layout(run.mesh)
    evaluate = make_in_loop_eval(run, layout)
    placed = place(cfg, params, layout)
    assert evaluate(2, placed) == {}
    metrics = evaluate(8, placed)
    assert set(metrics) == {"eval/downstream/toy_choice/acc"} and 0 <= metrics["eval/downstream/toy_choice/acc"] <= 1
