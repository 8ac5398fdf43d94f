"""`olmax demo`: the whole pipeline on real text that every Python install has.

1. Corpus: the standard library's modules as a `code` domain and their docstrings
   as a `prose` domain, split into train and held-out by file (a hash of the path).
2. A byte-level BPE trained on the train split; shards written by `olmax tokenize`.
3. A tiny OLMo 3 (reordered norm, QK-norm, 3:1 sliding/global) trained with the
   stage 1 recipe scaled down, with checkpoints and in-loop held-out evals.
4. runs/demo/report.md with loss curves, held-out CE per domain next to the
   unigram baseline of the same text, greedy samples, and the next commands.

`olmax demo --moe` trains the `demo_moe` preset instead (the same model with a
mixture of experts in every layer) on the same data, and writes report_moe.md,
which adds the load of every expert over training (expert_load_moe.png).

Corpus, tokenizer and shards are cached under runs/demo/cache (`--fresh` rebuilds);
the training run always starts over, and the report says whether its losses are
bitwise equal to the previous run's when that run had the same config.

`output_dir=DIR` puts the run in DIR and the cache and the report beside it, in DIR's
parent. The demo deletes or overwrites only files it made there, which MADE lists: any
other file where it writes is refused (BadInput, exit 2) before anything is touched, as is
a symbolic link where it writes, or a MADE that is one. MADE names what the demo is about
to write before it writes it, and the files it made when it ends: a demo killed on its way
leaves nothing its rerun refuses.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from olmax import progress
from olmax.config import load_config
from olmax.errors import BadInput
from olmax.run_dir import RunDir, drawn, write_own
from olmax.runtime import stopping_at_once

DOMAINS = ("code", "prose")
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
CACHE_VERSION = 1
MADE = "made_by_demo.json"  # beside the report: the files the demo made there, the only ones it deletes or overwrites


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if not SKIP_DIRS & set(p.relative_to(root).parts)]


def is_heldout(relative_path: str) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 10 == 0


def docstrings(source: str) -> str:
    """The module, class and function docstrings of a source file, as prose."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n\n".join(d for n in nodes if (d := ast.get_docstring(n)))


def build_corpus(out: Path) -> dict[str, int]:
    """JSONL files {domain}-{train,heldout}.jsonl; returns documents per file."""
    out.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {f"{d}-{s}": (out / f"{d}-{s}.jsonl").open("w") for d in DOMAINS for s in ("train", "heldout")}
    counts = dict.fromkeys(files, 0)
    try:
        for path in stdlib_files():
            source = path.read_text(encoding="utf-8", errors="replace")
            split = "heldout" if is_heldout(str(path.relative_to(root))) else "train"
            for domain, text in (("code", source), ("prose", docstrings(source))):
                if text.strip():
                    files[f"{domain}-{split}"].write(json.dumps({"text": text}) + "\n")
                    counts[f"{domain}-{split}"] += 1
    finally:
        for f in files.values():
            f.close()
    return counts


def cache_key(vocab_size: int) -> dict:
    return {"version": CACHE_VERSION, "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"],
            "vocab_size": vocab_size}


def cached_data(cache: Path, vocab_size: int, fresh: bool) -> dict | None:
    """The manifest of the corpus, tokenizer and shards in `cache` when they can be reused (built for this Python
    and `vocab_size`, and not `fresh`), else None."""
    try:
        info = json.loads((cache / "manifest.json").read_text())
    except (OSError, ValueError):  # none, or torn by a kill while it was written
        return None
    return None if fresh or info.get("key") != cache_key(vocab_size) else info


def prepare_data(cache: Path, vocab_size: int, doing: list[str]) -> dict:
    """Corpus, tokenizer and shards built in `cache` (not there yet); `doing[0]` is the stage."""
    from olmax.data.shards import Source, write_mix_file
    from olmax.data.tokenize import tokenize_corpus, train_tokenizer

    manifest = cache / "manifest.json"
    started = time.perf_counter()

    def stage(line: str) -> None:  # building the data takes about a minute: say what is being done
        doing[0] = line
        print(f"demo: [{time.perf_counter() - started:4.0f} s] {line}", flush=True)

    stage(f"building the corpus from the standard library ({sysconfig.get_paths()['stdlib']})")
    counts = build_corpus(cache / "corpus")
    stage(f"corpus: {', '.join(f'{name} {n:,} documents' for name, n in counts.items())}")
    stage(f"training a byte-level BPE of {vocab_size:,} tokens on the train split")
    tokenizer = train_tokenizer([str(cache / "corpus" / f"{d}-train.jsonl") for d in DOMAINS],
                                cache / "tokenizer.json", vocab_size=vocab_size, progress=False)
    shards = {}
    for domain in DOMAINS:
        for split in ("train", "heldout"):
            name = f"{domain}-{split}"
            stage(f"writing token shards {len(shards) + 1} of {2 * len(DOMAINS)}: {name}")
            result = tokenize_corpus([str(cache / "corpus" / f"{name}.jsonl")], cache / "shards" / name,
                                     tokenizer_path=tokenizer, label=domain, progress=False, workers=0)
            shards[name] = {"paths": result.shards, "tokens": result.tokens, "bytes": result.text_bytes,
                            "documents": result.documents}
    stage(f"data ready in {cache}")
    write_mix_file(cache / "train-mix.txt",
                   [Source(d, p) for d in DOMAINS for p in shards[f"{d}-train"]["paths"]])
    info = {"key": cache_key(vocab_size), "tokenizer": tokenizer, "shards": shards, "documents": counts,
            "seconds": time.perf_counter() - started}
    manifest.write_text(json.dumps(info, indent=1))
    return info


def unigram_baseline(train_paths: list[str], selection, set_index: int, vocab_size: int, dtype: str) -> float:
    """Cross-entropy (nats/token) of the tokens the held-out eval predicts in set `set_index` of `selection`
    (the same documents the model is scored on) under the train split's add-one unigram distribution."""
    counts = np.ones(vocab_size, np.float64)
    for path in train_paths:
        counts += np.bincount(np.fromfile(path, dtype=dtype), minlength=vocab_size)[:vocab_size]
    log_p = np.log(counts / counts.sum())
    rows, shards = selection.rows, selection.sets[set_index].shards
    total = 0.0
    for i in np.flatnonzero(rows.set_index == set_index):
        first = int(rows.doc_start[i])
        total -= log_p[np.asarray(shards[rows.shard[i]].tokens[first + rows.start[i] : first + rows.end[i]])].sum()
    return total / selection.tokens[set_index]


def greedy_samples(cfg, params, tokenizer_path: str, prompts: list[str], new_tokens: int) -> list[str]:
    """Greedy continuations with the model's KV cache: the prompt in one call, then a token per call."""
    import functools

    import jax
    from tokenizers import Tokenizer

    from olmax.model import generate

    tokenizer = Tokenizer.from_file(tokenizer_path)
    model, impl, length = cfg.model, cfg.impl, cfg.data.sequence_length
    prefill = jax.jit(functools.partial(generate.prefill, model, impl, length=length))
    step = jax.jit(functools.partial(generate.step, model, impl, length=length))

    samples = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids[: length - 1]
        buffer = np.zeros((1, length), np.int32)
        buffer[0, : len(ids)] = ids
        token, cache = prefill(params, buffer, np.array([len(ids)], np.int32))
        for position in range(len(ids), min(len(ids) + new_tokens, length)):
            if int(token[0]) == cfg.data.eos_id:
                break
            ids.append(int(token[0]))
            token, cache = step(params, token, np.array([position], np.int32), cache)
        samples.append(tokenizer.decode(ids))
    return samples


def curves_figure(metrics: list[dict], baselines: dict[str, float]):
    """Train loss, and held-out loss per domain against its unigram baseline (dashed, the domain's colour): the
    figure, its held-out panel and that panel's legend, which sits beside the panel (inside it, it covered the
    code curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4))
    steps = [m["step"] for m in metrics]
    train_ax.plot(steps, [m["train/CE loss"] for m in metrics], lw=0.8)
    train_ax.set(title="train CE loss", xlabel="step", ylabel="nats/token")
    for domain in DOMAINS:
        points = [(m["step"], m[f"eval/lm/{domain}/CE loss"]) for m in metrics if f"eval/lm/{domain}/CE loss" in m]
        line, = eval_ax.plot(*zip(*points), marker="o", label=domain)
        eval_ax.axhline(baselines[domain], color=line.get_color(), ls="--", lw=0.8,
                        label=f"{domain} unigram baseline")
    eval_ax.set(title="held-out CE loss per domain", xlabel="step", ylabel="nats/token")
    legend = eval_ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.tight_layout()
    return fig, eval_ax, legend


def plot_curves(metrics: list[dict], baselines: dict[str, float], path: Path) -> list[str]:
    """`curves_figure` as a PNG; the held-out panel's legend."""
    import matplotlib.pyplot as plt

    fig, _, legend = curves_figure(metrics, baselines)
    write_own(path, drawn(lambda png: fig.savefig(png, dpi=100)))  # through no link, even one planted meanwhile
    plt.close(fig)
    return [text.get_text() for text in legend.get_texts()]


def plot_expert_load(cfg, metrics: list[dict], path: Path) -> None:
    """Each MoE layer's share of the assignments per expert, step by step (the true load of each global
    batch, not the balancing loss), against the even share 1 / num_experts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = range(cfg.model.dense_layers, cfg.model.n_layers)
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.2), sharey=True, squeeze=False)
    steps = [m["step"] for m in metrics]
    for ax, layer in zip(axes[0], layers):
        counts = np.array([m[f"train/block {layer:02d}/tokens per expert"] for m in metrics], np.float64)
        shares = counts / counts.sum(1, keepdims=True)
        for expert in range(shares.shape[1]):
            ax.plot(steps, shares[:, expert], lw=0.8, label=f"expert {expert}")
        ax.axhline(1 / shares.shape[1], color="black", ls="--", lw=0.8)
        ax.set(title=f"layer {layer}", xlabel="step")
    axes[0][0].set_ylabel("share of assignments")
    # one legend for every panel, under them, in the panels' own font size
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), frameon=False)
    fig.tight_layout(rect=(0, 0.06 * -(-len(labels) // 8), 1, 1))
    write_own(path, drawn(lambda png: fig.savefig(png, dpi=100)))
    plt.close(fig)


def demo_config(overrides: list[str], moe: bool = False):
    """The demo preset (`demo_moe` with `moe`) with `overrides`, training and evaluating on the data cache beside
    its run directory, wherever output_dir puts that."""
    name = "demo_moe" if moe else "demo"
    cache = load_config(name, overrides).run_dir.parent / "cache"
    sets = [{"label": d, "mix_file": str(cache / "shards" / f"{d}-heldout" / "mix.txt")} for d in DOMAINS]
    return load_config(name, [f"data.mix_file={cache / 'train-mix.txt'}", f"eval.sets={json.dumps(sets)}",
                              *overrides])


def outputs(cfg, moe: bool) -> list[Path]:
    """What the demo deletes or overwrites: its data cache, its run directory and its report's files."""
    out, suffix = cfg.run_dir.parent, "_moe" if moe else ""
    return [out / "cache", cfg.run_dir, out / f"report{suffix}.md", out / f"report{suffix}.json",
            out / f"loss_curves{suffix}.png", *([out / "expert_load_moe.png"] if moe else [])]


def files_at(path: Path) -> list[Path]:
    """`path` itself, or every file under it when it is a directory (a symbolic link counts as a file)."""
    if path.is_symlink() or not path.is_dir():
        return [path] if path.is_symlink() or path.exists() else []
    return [Path(root, name) for root, dirs, files in os.walk(path)
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]]


def read_made(out: Path) -> dict[str, list[str]]:
    """MADE's record under `out` (paths relative to it): "files" the earlier demos made, and "writing" what a demo
    was writing when it was stopped before it could list its files (each path with everything under it). Read
    through no symbolic link: a link there would have the demo delete what its target lists."""
    marker = out / MADE
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {"files": [], "writing": []}
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise BadInput(f"{marker} is {why}, not the list of its files olmax demo writes; move it away, or give the "
                       "demo another output_dir") from None
    try:
        with os.fdopen(fd) as f:
            record = json.loads(f.read())
        lists = {key: record.get(key, []) if key == "writing" else record[key] for key in ("files", "writing")}
        if not all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in lists.values()):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise BadInput(f"{marker} is not the list of its files olmax demo writes; move it away, or give the demo "
                       "another output_dir") from None
    return lists


def made_by_demo(name: str, made: dict[str, list[str]]) -> bool:
    """Whether the file `name` (relative to the demo's directory) is one the demo made, as `read_made` says."""
    return name in made["files"] or any(name == root or name.startswith(root + "/") for root in made["writing"])


def clear_outputs(cfg, moe: bool, fresh: bool) -> dict | None:
    """Delete the earlier run, and the data cache unless it can be reused (its manifest, returned; else None),
    each said in a line. Refused (BadInput, nothing deleted) when a file where the demo writes is not one it
    made, or a symbolic link is where the demo writes its run, cache or report."""
    out = cfg.run_dir.parent
    made = read_made(out)
    if link := next((path for path in outputs(cfg, moe) if path.is_symlink()), None):
        raise BadInput(f"{link} is a symbolic link (to {os.readlink(link)}) where the demo writes; it follows no "
                       "link where it writes or deletes: move it away, or give the demo another output_dir")
    others = sorted(str(f) for path in outputs(cfg, moe) for f in files_at(path)
                    if not made_by_demo(f.relative_to(out).as_posix(), made))
    if others:
        more = f" and {len(others) - 3:,} more" if len(others) > 3 else ""
        raise BadInput(f"{', '.join(others[:3])}{more}: not made by olmax demo (not in {out / MADE}), where the demo "
                       "deletes or overwrites what is there; nothing was deleted: move them away, or give the demo "
                       "another output_dir")
    data = cached_data(out / "cache", cfg.model.vocab_size, fresh)
    stale = [] if data else [(out / "cache", "the corpus, tokenizer and shards")]
    for directory, what in [(cfg.run_dir, "the run"), *stale]:
        if files := files_at(directory):
            count = f"{len(files):,} file{'s' if len(files) > 1 else ''}"
            print(f"demo: deleting {what} an earlier demo made in {directory} ({count})", flush=True)
            shutil.rmtree(directory)
    return data


def record_outputs(cfg, moe: bool, writing: bool = False) -> None:
    """List the files where the demo writes in MADE, beside those of the other demo (dense or MoE); `writing`:
    name its outputs as being written, before it writes them (a demo stopped on its way has said what it made)."""
    out = cfg.run_dir.parent
    made = read_made(out)
    files = {name for name in made["files"] if (out / name).exists()}
    files |= {f.relative_to(out).as_posix() for path in outputs(cfg, moe) for f in files_at(path)}
    roots = {path.relative_to(out).as_posix() for path in outputs(cfg, moe)} if writing else set()
    if files or roots:
        write_own(out / MADE, json.dumps({"files": sorted(files), "writing": sorted(roots)}, indent=0) + "\n")


def run_demo(overrides: list[str], fresh: bool, moe: bool = False) -> Path:
    """Build (or reuse) the data, train the demo preset (`demo_moe` with `moe`) from scratch, evaluate, write
    the report."""
    cfg = demo_config(overrides, moe)
    data = clear_outputs(cfg, moe, fresh)
    record_outputs(cfg, moe, writing=True)
    try:
        return _run_demo(cfg, data, moe)
    finally:  # however it ends (a kill aside: MADE says what it was writing): a rerun may delete what it made
        record_outputs(cfg, moe)


def _run_demo(cfg, data: dict | None, moe: bool) -> Path:
    from olmax.checkpoint import Checkpointer
    from olmax.eval.in_loop import eval_selection, make_in_loop_eval
    from olmax.parallel.mesh import make_layout
    from olmax.train.resume import restore_or_init
    from olmax.train.trainer import train

    out, suffix = cfg.run_dir.parent, "_moe" if moe else ""
    doing = ["building the data"]  # what the demo waits for, said in its silences (training says its own)
    began = time.perf_counter()

    def silences():
        return progress.ticking(lambda _: f"demo: [{time.perf_counter() - began:4.0f} s] still {doing[0]}", "stdout")

    if data is None:  # a stop signal ends it at once: a cache without its manifest is built again
        with silences(), stopping_at_once(lambda line: print(f"demo: {line}", file=sys.stderr, flush=True)):
            data = prepare_data(out / "cache", cfg.model.vocab_size, doing)
    else:
        print(f"demo: reusing corpus, tokenizer and shards from {out / 'cache'} (--fresh rebuilds)")
    shards = data["shards"]
    previous = out / f"report{suffix}.json"
    previous_losses = None
    if previous.exists() and json.loads(previous.read_text()).get("config") == cfg.model_dump(mode="json"):
        previous_losses = json.loads(previous.read_text())["losses"]

    started = time.perf_counter()
    history = train(cfg, make_eval=make_in_loop_eval)
    train_seconds = time.perf_counter() - started
    losses = [h["train/CE loss"] for h in history]
    same_as_previous = None if previous_losses is None else previous_losses == losses

    with silences():
        doing[0] = "restoring the trained model and writing greedy samples (compiling its decoding first)"
        checkpointer = Checkpointer(RunDir(cfg.run_dir).checkpoints, cfg.checkpoint)
        state, _, _ = restore_or_init(cfg, make_layout(cfg.mesh), checkpointer)
        checkpointer.close()
        samples = greedy_samples(cfg, state.params, data["tokenizer"],
                                 ["def __init__(self", "import os\n", "class ", "Return the"], new_tokens=48)
        doing[0] = "computing the unigram baselines of the held-out sets"
        selection = eval_selection(cfg)
        labels = [s.label for s in selection.sets]
        baselines = {d: unigram_baseline(shards[f"{d}-train"]["paths"], selection, labels.index(d),
                                         cfg.model.vocab_size, cfg.data.token_dtype) for d in DOMAINS}
        scored = {d: {"documents": selection.documents[labels.index(d)], "tokens": selection.tokens[labels.index(d)]}
                  for d in DOMAINS}
        doing[0] = "plotting the curves and writing the report"
        plot_curves(history, baselines, out / f"loss_curves{suffix}.png")
        if moe:
            plot_expert_load(cfg, history, out / "expert_load_moe.png")
        report = write_report(out, cfg, data, history, baselines, scored, samples, train_seconds, same_as_previous,
                              suffix)
    print(f"demo: report in {report}")
    return report


def moe_section(cfg, history) -> list[str]:
    """The report's mixture-of-experts part: the router losses and the true load at the end, and its plot."""
    m, final = cfg.model, history[-1]
    rows = []
    for layer in range(m.dense_layers, m.n_layers):
        counts = final[f"train/block {layer:02d}/tokens per expert"]
        rows.append(f"| {layer} | {final[f'train/block {layer:02d}/load imbalance']:.3f} | "
                    f"{max(counts) / sum(counts):.3f} | {' '.join(str(int(c)) for c in counts)} |")
    return [
        "## Experts", "",
        f"Every layer's MLP is {m.moe.num_experts} SwiGLU experts of hidden {m.moe.expert_hidden}, top-{m.moe.top_k} "
        f"{m.moe.gating} router; load balancing loss {m.moe.load_balancing_loss} and router z-loss "
        f"{m.moe.router_z_loss} (OLMo-core's definitions). At the last step: `train/load balancing loss` "
        f"{final['train/load balancing loss']:.5f}, `train/router Z loss` {final['train/router Z loss']:.5f}. "
        "The true load of the last global batch per layer (load imbalance = busiest expert / mean):", "",
        "| layer | load imbalance | busiest expert's share | assignments per expert |",
        "| ---: | ---: | ---: | --- |", *rows, "",
        "Share of each expert's assignments, every step (dashed: the even share):", "",
        "![expert load](expert_load_moe.png)", "",
    ]


def write_report(out: Path, cfg, data, history, baselines, scored, samples, train_seconds, same_as_previous,
                 suffix: str = "") -> Path:
    final = history[-1]
    tokens = final["throughput/total tokens"]
    rows = []
    for d in DOMAINS:
        ce = final[f"eval/lm/{d}/CE loss"]
        bpb = final.get(f"eval/lm/{d}/BPB")
        rows.append(f"| {d} | {scored[d]['documents']:,} | {scored[d]['tokens']:,} | {ce:.4f} | {np.exp(ce):.1f} | "
                    f"{'' if bpb is None else f'{bpb:.3f}'} | {baselines[d]:.4f} | {baselines[d] - ce:+.4f} |")
    shard_rows = [f"| {k} | {v['documents']:,} | {v['tokens']:,} | {v['bytes']:,} |" for k, v in data["shards"].items()]
    demo = "olmax demo --moe" if suffix else "olmax demo"
    repeat = {None: f"no earlier run with this config in this directory; run `{demo}` again to check that "
                    "the losses repeat",
              True: "bitwise identical to the previous run's, step for step",
              False: "DIFFERENT from the previous run's (same config and seed): a determinism bug"}[same_as_previous]
    run_dir = cfg.run_dir
    ckpt = RunDir(run_dir).checkpoints
    experts = (f", {cfg.model.moe.num_experts} experts top-{cfg.model.moe.top_k} in every layer"
               if cfg.model.mlp == "moe" else "")
    lines = [
        "# olmax demo report", "",
        f"A {cfg.model.n_layers}-layer OLMo 3 (d_model {cfg.model.d_model}, {cfg.model.n_heads} heads, "
        f"pattern {cfg.model.layer_pattern}, window {cfg.model.sliding_window}, vocab {cfg.model.vocab_size}{experts}) "
        f"trained for {cfg.train.steps} steps of {cfg.train.global_batch_instances} x {cfg.data.sequence_length} "
        f"tokens ({tokens:,} tokens) in {train_seconds:.0f} s on this machine's CPU, "
        f"recipe: AdamW lr {cfg.optim.lr} with {cfg.schedule.warmup_steps} warmup steps, {cfg.schedule.kind} to "
        f"{cfg.schedule.final_lr_fraction} x, z-loss {cfg.loss.z_loss}, skip-step, embedding excluded from decay.", "",
        "## Data (the Python standard library, split by file)", "",
        "| split | documents | tokens | text bytes |", "| --- | ---: | ---: | ---: |", *shard_rows, "",
        "## Held-out loss at the last step", "",
        "| domain | documents | tokens | CE (nats/token) | PPL | bits/byte | unigram baseline CE | baseline - model |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        f"Both columns score the same held-out documents: {cfg.eval.tokens or 'all'} tokens' worth per domain, "
        f"chosen by eval.seed {cfg.eval.seed}. The unigram baseline is the cross-entropy of those tokens under the "
        "train split's token frequencies (add-one smoothed), with the same tokenizer.", "",
        f"Final train CE {final['train/CE loss']:.4f}. Losses: {repeat}.", "",
        f"![loss curves](loss_curves{suffix}.png)", "",
        *(moe_section(cfg, history) if cfg.model.mlp == "moe" else []),
        "## Greedy samples", "",
        f"Greedy decoding (the most likely token every time) of a model trained on {tokens:,} tokens: such a "
        "model knows the common short patterns of its text and little of what comes after them, so once a "
        "continuation enters a frequent loop (an indented line, a docstring's phrase), the likeliest next token "
        "is the one that goes round it again. The repetition is the model's size and data, not a decoding bug; "
        "sampling with a temperature would vary the text, not make it better.", "",
        *[f"```\n{s}\n```\n" for s in samples],
        "## Where things are", "",
        f"- checkpoints: `{ckpt}`", f"- metrics: `{RunDir(run_dir).metrics}`, TensorBoard events in "
        f"`{RunDir(run_dir).tensorboard}`", f"- tokenizer and shards: `{out / 'cache'}`", "",
        "## Next commands", "",
        "```bash",
        f"olmax train {cfg.name} train.steps={2 * cfg.train.steps}   # resume from the last checkpoint, train further",
        "olmax synth-data --out runs/synth   # generated tokens for the next command",
        "olmax resume-check tiny data.mix_file=runs/synth/mix.txt --at 20 --steps 40   # exact resume A/B",
        f"olmax eval heldout {ckpt} --data code={out}/cache/shards/code-heldout/mix.txt",
        f"olmax convert olmax-to-hf {ckpt} --out {out}/hf{suffix} --tokenizer {data['tokenizer']}",
        f"olmax compare {run_dir} runs/OTHER_RUN",
        "```", "",
    ]
    report = out / f"report{suffix}.md"
    write_own(report, "\n".join(lines))
    write_own(out / f"report{suffix}.json", json.dumps({"final": final, "unigram_baseline": baselines,
                                                 "scored": scored,
                                                 "config": cfg.model_dump(mode="json"),
                                                 "losses": [h["train/CE loss"] for h in history],
                                                 "losses_repeat_previous_run": same_as_previous,
                                                 "train_seconds": train_seconds}, indent=1))
    return report
