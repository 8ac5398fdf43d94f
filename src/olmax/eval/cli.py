"""`olmax eval heldout | perplexity | kl | harness` and `olmax compare`; `add_commands` hooks them into olmax.cli.

Every command prints JSON on stdout; kl and compare also write a PNG (and compare a TSV).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from olmax.arguments import given, old_spelling

# The downstream suite of MaxText's OLMo 3 reproduction (https://github.com/AI-Hypercomputer/maxtext/pull/3886); needs the datasets in the HF cache.
DEFAULT_TASKS = ("mmlu:5", "hellaswag:0", "arc_easy:0", "arc_challenge:0", "openbookqa:0", "piqa:0", "boolq:0",
                 "winogrande:0")
MODEL_HELP = ("olmax checkpoint directory (latest step), a step of one (.../checkpoints/STEP), a run directory, "
              "or an HF Olmo3 directory")


def _writable(out: str | None) -> None:
    """Refuse an --out that cannot be written (in a directory that cannot be, or a symbolic link, which olmax does
    not write through) before the work whose results it would hold."""
    from olmax import storage
    from olmax.config import writable_dir
    from olmax.run_dir import refuse_link

    if out and storage.is_remote(out):
        storage.check_writable(out)
    elif out:
        refuse_link(out)
        writable_dir(Path(out).absolute().parent, "--out")


def _print_json(report: dict, out: str | None) -> None:
    """Print the report; also write it to `out` (a path or a bucket URL) when given."""
    from olmax.run_dir import write_own

    text = json.dumps(report, indent=2)
    if out:
        write_own(out, text + "\n")
    print(text)


def _write_plot(draw, out: str) -> None:
    """The PNG `draw(file)` writes, written to `out` (a path or a bucket URL) through no symbolic link: the default
    `out` of `compare` is in a run directory."""
    from olmax.run_dir import drawn, write_own

    write_own(out, drawn(draw))


def _stem(out: str) -> str:
    """`out` without its suffix: the outputs OUT.json, OUT.png (OUT.tsv) are named from it."""
    return os.path.splitext(out)[0]


def _selection(args, model):
    from olmax.eval.documents import select, sets_from_argument
    from olmax.errors import EvalError

    if args.tokens is not None and args.tokens < 1:
        raise EvalError(f"--tokens {args.tokens}: give a positive number of tokens per set, or leave it out for all")
    data = model.cfg.data
    token_dtype = args.token_dtype or data.token_dtype
    sets = [s for argument in args.data
            for s in sets_from_argument(argument, token_dtype=token_dtype, eos_id=data.eos_id)]
    labels = [s.label for s in sets]
    if len(set(labels)) != len(labels):
        raise EvalError(f"eval set labels {labels} repeat; name the sets with --data LABEL=PATH")
    return select(sets, sequence_length=args.seq_len or data.sequence_length, tokens=args.tokens, seed=args.seed)


def _rows(args, layout) -> int:
    return given(args, "batch_size", "--batch-size") or 4 * layout.data_parallel_size


def cmd_heldout(args) -> None:
    _writable(args.out)
    import jax

    from olmax.eval.heldout import evaluate
    from olmax.eval.models import eval_layout, place
    from olmax.interop.hf import load_model
    from olmax.progress import ticking

    doing = [f"loading {args.model}"]  # said in every silence; stdout holds the JSON alone
    with ticking(lambda seconds: f"olmax eval heldout: [{seconds:.0f} s] still {doing[0]}"):
        model = load_model(args.model)
        selection = _selection(args, model)
        layout = eval_layout()
        doing[0] = (f"scoring {model.name} on {int(sum(selection.tokens)):,} tokens of "
                    f"{', '.join(s.label for s in selection.sets)} (compiling first)")
        print(f"olmax eval heldout: {doing[0]}", file=sys.stderr, flush=True)
        results = evaluate(model.cfg, place(model.cfg, model.params, layout), selection, layout,
                           rows_per_batch=_rows(args, layout))
    _print_json({"model": model.name, **results, "tokens": int(sum(selection.tokens)), "seed": args.seed,
                 "token_budget_per_set": args.tokens, "devices": jax.device_count()}, args.out)


def cmd_kl(args) -> None:
    _writable(args.out)
    from olmax.eval import kl
    from olmax.eval.models import eval_layout
    from olmax.interop.hf import load_model

    model_a, model_b = load_model(args.a), load_model(args.b)
    selection = _selection(args, model_a)
    layout = eval_layout()
    values, agree = kl.token_kls(model_a, model_b, selection, layout, rows_per_batch=_rows(args, layout))
    summary = kl.summarize(values, agree)
    counts, edges = kl.histogram(values)
    out = _stem(args.out)
    _write_plot(lambda png: kl.plot_histogram(values, summary, png, f"KL({model_a.name} || {model_b.name})"),
                out + ".png")
    _print_json({"a": model_a.name, "b": model_b.name, "direction": "KL(A || B)", **summary,
                 "sets": [s.label for s in selection.sets], "sequence_length": selection.sequence_length,
                 "histogram": {"log10_edges": edges.tolist(), "counts": counts.tolist()},
                 "plot": out + ".png"}, out + ".json")


def _harness_results(path: str, args) -> dict:
    """A results JSON of an earlier `olmax eval harness`, or a model to run the tasks on."""
    from olmax.errors import EvalError
    from olmax.eval.models import eval_layout, place
    from olmax.interop.hf import load_model

    if path.endswith(".json") and Path(path).is_file():
        report = json.loads(Path(path).read_text())
        if "tasks" not in report:
            raise EvalError(f"{path} is not the results JSON of a one-model `olmax eval harness` run")
        return report
    try:
        from olmax.eval import harness
    except ImportError as err:
        raise EvalError(f"the harness needs lm-eval ({err}); pip install lm-eval==0.4.13") from None

    model = load_model(path)
    tokenizer_path = args.tokenizer or (Path(path) / "tokenizer.json" if (Path(path) / "config.json").is_file() else None)
    if tokenizer_path is None or not Path(tokenizer_path).exists():
        raise EvalError(f"no tokenizer for {path}: pass --tokenizer (a tokenizer.json)")
    layout = eval_layout()
    lm = harness.OlmaxLM(model.cfg, place(model.cfg, model.params, layout), harness.load_text_tokenizer(tokenizer_path),
                         layout, max_length=args.max_length or model.cfg.data.sequence_length,
                         batch_size=args.batch_size)
    results = harness.run_tasks(lm, args.tasks.split(","), limit=args.limit, include_path=args.include_path)
    return {"model": model.name, **results}


def cmd_harness(args) -> None:
    _writable(args.out)
    from olmax.eval.harness import deltas

    a = _harness_results(args.model, args)
    if args.model_b is None:
        _print_json(a, args.out)
        return
    b = _harness_results(args.model_b, args)
    _print_json({"a": a, "b": b, "deltas": deltas(a, b)}, args.out)


def cmd_compare(args) -> None:
    from olmax import storage
    from olmax.eval import curves
    from olmax.run_dir import check_own_files, drawn, write_files

    first = args.a.rstrip("/")
    out = _stem(args.out or storage.join(first if storage.is_dir(first) else storage.parent(first), "compare"))
    _writable(out)
    check_own_files(out + ".tsv", out + ".png", out + ".json")  # none written when one would be refused
    a = curves.read_curve(args.a, args.metric)
    b = curves.read_curve(args.b, args.metric_b or args.metric)
    window = args.window or curves.default_window(a, b)
    smooth = window * (curves.SMOOTH // curves.WINDOW) if args.smooth is None else args.smooth
    result = curves.compare(a, b, window=window, smooth=smooth, ranges=curves.parse_ranges(args.ranges))
    summary = json.dumps({k: v for k, v in result.items() if k != "windows"} | {
        "metric": args.metric, "delta": "B - A", "table": out + ".tsv", "plot": out + ".png"}, indent=2)
    name = storage.basename(out)
    write_files(storage.parent(out), {name + ".tsv": curves.window_table(result),  # the directory opened once
                                      name + ".png": drawn(lambda png: curves.plot(a, b, result, args.metric, png)),
                                      name + ".json": summary + "\n"})
    print(summary)


def _data_args(p) -> None:
    p.add_argument("--data", action="append", required=True, metavar="[LABEL=]PATH",
                   help="token shard or mix file (.txt); repeat for several sets. A mix file without LABEL gives one "
                        "set per label in it (per-domain perplexity)")
    p.add_argument("--tokens", type=int, help="tokens per set: whole documents chosen by --seed (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document choice (with --tokens)")
    p.add_argument("--seq-len", type=int, help="predictions per row (default: the model's data.sequence_length)")
    p.add_argument("--batch-size", type=int, help="rows per batch (default: 4 per device)")
    old_spelling(p, "--batch-instances", "batch_size", "write --batch-size", type=int)
    p.add_argument("--token-dtype", choices=("uint16", "uint32"), help="of the shards (default: the model's)")


def add_commands(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="held-out loss, per-domain perplexity, checkpoint KL, lm-eval-harness")
    verbs = evaluate.add_subparsers(dest="eval_command", required=True)

    p = verbs.add_parser("heldout", aliases=["perplexity"],
                         help="CE, PPL and bits per byte of labeled held-out sets, and their macro average (JSON)")
    p.add_argument("model", help=MODEL_HELP)
    _data_args(p)
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_heldout)

    p = verbs.add_parser("kl", help="token-level KL(A || B) on identical inputs: mean, quantiles, histogram PNG")
    p.add_argument("a", help=MODEL_HELP)
    p.add_argument("b", help=MODEL_HELP)
    _data_args(p)
    p.add_argument("--out", default="kl", help="writes OUT.json and OUT.png (default: ./kl)")
    p.set_defaults(func=cmd_kl)

    p = verbs.add_parser("harness", help="lm-eval-harness tasks; with two models, deltas with stderr in quadrature")
    p.add_argument("model", help=MODEL_HELP + ", or a results JSON of an earlier run")
    p.add_argument("model_b", nargs="?", help="a second model (or results JSON): report B - A")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated `name` or `name:shots` (default: the 8 tasks of MaxText's OLMo 3 reproduction, https://github.com/AI-Hypercomputer/maxtext/pull/3886, MMLU 5-shot)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the HF directory's)")
    p.add_argument("--limit", type=int, help="examples per task (default: all)")
    p.add_argument("--include-path", help="directory of extra (local) task YAMLs")
    p.add_argument("--batch-size", type=int, default=16, help="rows per batch (default: %(default)s)")
    p.add_argument("--max-length", type=int, help="context length (default: the model's data.sequence_length)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_harness)

    p = subparsers.add_parser("compare", help="step-aligned comparison of a metric of two runs or published curves")
    p.add_argument("a", help="run directory, TensorBoard directory, metrics .jsonl, or a step<TAB>value .tsv")
    p.add_argument("b", help="the same kinds; deltas are B - A")
    p.add_argument("--metric", default="train/CE loss", help="the metric compared, by its name in metrics.jsonl (default: %(default)s)")
    p.add_argument("--metric-b", help="metric name in B (default: --metric)")
    p.add_argument("--window", type=int, help="steps per window of means (default 2000, less on runs shorter "
                   "than 20 windows)")
    p.add_argument("--smooth", type=int, help="steps the smoothed delta averages over (default 9 windows: 18000)")
    p.add_argument("--ranges", help="summaries per step range too: lo:hi,lo:hi (hi may be empty)")
    p.add_argument("--out", help="writes OUT.tsv, OUT.png and OUT.json (default: compare.* in A, or beside A's file)")
    p.set_defaults(func=cmd_compare)
