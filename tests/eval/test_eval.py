"""Held-out loss, per-domain perplexity and bits per byte, checkpoint KL: real computation on a tiny model."""

import functools
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from olmax.checkpoint import Checkpointer, run_meta
from olmax.config import CheckpointConfig, MeshConfig
from olmax.data import DataError
from olmax.data.synthetic import write_synthetic_shards
from olmax.data.tokenize import tokenize_corpus, train_tokenizer
from olmax.eval import documents, heldout, kl
from olmax.eval.models import eval_layout, place
from olmax.interop.hf import load_model
from olmax.model.weights import Model
from olmax.model import transformer
from olmax.parallel.mesh import Layout, make_layout

WORDS = ("the cat sat on a mat and the dog ran to the red house while small birds sang over green hills, "
         "naïve café owners served crème brûlée").split()


def fsdp_layout(devices: int) -> Layout:
    return make_layout(MeshConfig(), jax.devices()[:devices])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    return write_synthetic_shards(out, vocab_size=512, eos_id=0, n_tokens=12_000, n_shards=2, seed=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Texts, tokenized into shards with sidecars (byte counts) by `olmax tokenize`."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(3, 25)))) for _ in range(60)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer([str(root / "docs.jsonl")], root / "tokenizer.json", vocab_size=300, progress=False)
    result = tokenize_corpus([str(root / "docs.jsonl")], root / "shards", tokenizer_path=tokenizer, shard_tokens=400,
                             workers=0, progress=False, label="words")
    return texts, result, tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cfg, params):
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    checkpointer = Checkpointer(directory, CheckpointConfig())
    checkpointer.save_params(0, params, run_meta(cfg, 0, {}))
    checkpointer.close()
    return directory


def run_cli(*argv) -> int:
    from olmax.cli import main

    return main([str(a) for a in argv])


def direct_log_probs(cfg, params, docs: list[np.ndarray], length: int) -> list[np.ndarray]:
    """log p(doc[i] | EOS, doc[:i]) of each document by one plain forward pass (documents right-padded to
    `length`: causal attention keeps the padding out of the earlier positions), float64."""
    inputs = np.full((len(docs), length), cfg.data.pad_id, dtype=np.int32)
    for row, doc in enumerate(docs):
        inputs[row, : len(doc)] = [cfg.data.eos_id, *doc[:-1]]
    logits = np.asarray(jax.jit(functools.partial(transformer.forward_logits, cfg.model, cfg.impl))(params, inputs))
    logits = logits[..., : cfg.model.vocab_size].astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return [logits[row, np.arange(len(doc)), doc] - log_z[row, : len(doc)] for row, doc in enumerate(docs)]


def test_rows_are_lm_evals_rolling_windows(tmp_path):
    """Every token of a document is predicted once, with as much context as fits (lm-eval's windows)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rng = np.random.default_rng(1)
    docs = [np.append(rng.integers(2, 512, n), 0) for n in (5, 15, 16, 17, 40)]
    path = tmp_path / "part-00000.npy"
    np.concatenate(docs).astype(np.uint16).tofile(path)
    eval_set = documents.open_eval_set("x", [str(path)], token_dtype="uint16", eos_id=0)
    selection = documents.select([eval_set], sequence_length=16)
    inputs, targets, weights = documents.read_rows(selection, slice(0, None), eos_id=0, pad_id=1, vocab_size=512,
                                                   batch_rows=len(selection.rows) + 3)
    assert selection.tokens == [sum(len(d) for d in docs)] == [int(weights.sum())]
    assert not weights[len(selection.rows):].any(), "padding rows count nothing"
    row = 0
    for doc in docs:
        for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                token_list=doc.tolist(), prefix_token=0, max_seq_len=16, context_len=1)):
            n = len(context) + len(continuation) - 1
            assert inputs[row, :n].tolist() == (context + continuation)[:-1]
            counted = weights[row].astype(bool)
            assert targets[row][counted].tolist() == continuation
            assert np.flatnonzero(counted).tolist() == list(range(n - len(continuation), n))
            row += 1
    assert row == len(selection.rows)


def test_token_budget_takes_whole_documents_by_seed(shards):
    eval_set = documents.open_eval_set("s", shards, token_dtype="uint16", eos_id=0)
    lengths = np.concatenate([np.diff(s.offsets) for s in eval_set.shards])
    first = documents.select([eval_set], sequence_length=64, tokens=2000, seed=5)
    again = documents.select([eval_set], sequence_length=64, tokens=2000, seed=5)
    other = documents.select([eval_set], sequence_length=64, tokens=2000, seed=6)
    assert np.array_equal(first.rows.doc_start, again.rows.doc_start)
    assert not np.array_equal(first.rows.doc_start, other.rows.doc_start)
    chosen = documents.choose_documents(lengths, 2000, 5)
    assert first.tokens[0] == lengths[chosen].sum() >= 2000 > lengths[chosen].sum() - lengths[chosen].max()
    assert first.documents[0] == len(chosen)


def test_heldout_loss_is_the_same_on_1_and_8_devices_and_any_batch(cfg, params, shards):
    sets = [documents.open_eval_set("a", shards[:1], token_dtype="uint16", eos_id=0),
            documents.open_eval_set("b", shards[1:], token_dtype="uint16", eos_id=0)]
    selection = documents.select(sets, sequence_length=64, tokens=2500, seed=0)
    results = {}
    for devices, rows in ((1, 8), (8, 8), (8, 24)):
        layout = fsdp_layout(devices)
        results[devices, rows] = heldout.evaluate(cfg, place(cfg, params, layout), selection, layout,
                                                  rows_per_batch=rows)
    reference = results[1, 8]
    for key, result in results.items():
        for label in ("a", "b"):
            assert result["sets"][label]["tokens"] == reference["sets"][label]["tokens"] == selection.tokens[
                "ab".index(label)]
            np.testing.assert_allclose(result["sets"][label]["CE loss"], reference["sets"][label]["CE loss"],
                                       rtol=1e-6, err_msg=str(key))
    # a random model is near-uniform over the vocabulary
    assert abs(reference["sets"]["a"]["CE loss"] - math.log(512)) < 0.1


def test_bits_per_byte_by_hand(cfg, params, corpus):
    texts, result, _ = corpus
    sets = documents.sets_from_argument(result.mix_file, token_dtype="uint16", eos_id=0)
    assert [s.label for s in sets] == ["words"] and sets[0].has_bytes
    layout = eval_layout()
    selection = documents.select(sets, sequence_length=128)
    got = heldout.evaluate(cfg, place(cfg, params, layout), selection, layout, rows_per_batch=8)["sets"]["words"]
    docs = [np.asarray(shard.tokens[start:end], dtype=np.int64)
            for shard in sets[0].shards for start, end in zip(shard.offsets[:-1], shard.offsets[1:])]
    assert max(len(d) for d in docs) <= 128, "each document fits one row, so one plain forward pass scores it"
    nats = -sum(lp.sum() for lp in direct_log_probs(cfg, params, docs, 128))
    tokens = sum(len(d) for d in docs)
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert got["tokens"] == tokens and got["bytes"] == text_bytes and got["documents"] == len(texts)
    np.testing.assert_allclose(got["CE loss"], nats / tokens, rtol=1e-6)
    np.testing.assert_allclose(got["bits per byte"], nats / math.log(2) / text_bytes, rtol=1e-6)


def test_per_domain_results_and_macro_average(cfg, params, shards, corpus, tmp_path):
    _, result, _ = corpus
    mix = tmp_path / "domains.txt"
    mix.write_text(f"web,{shards[0]}\nnews,{shards[1]}\n")
    out = tmp_path / "heldout.json"
    assert run_cli("eval", "perplexity", str(_checkpoint_of(tmp_path, cfg, params)), "--data", mix,
                   "--data", f"words={result.mix_file}", "--tokens", 1500, "--batch-instances", 16, "--out", out) == 0
    report = json.loads(out.read_text())
    sets = report["sets"]
    assert list(sets) == ["web", "news", "words"]
    assert sets["web"]["bits per byte"] is None and sets["words"]["bits per byte"] > 0
    assert all(s["tokens"] >= 1500 and s["PPL"] == pytest.approx(math.exp(s["CE loss"])) for s in sets.values())
    assert report["macro"]["CE loss"] == pytest.approx(np.mean([s["CE loss"] for s in sets.values()]))
    assert report["macro"]["bits per byte"] is None
    assert report["tokens"] == sum(s["tokens"] for s in sets.values())


def _checkpoint_of(tmp_path, cfg, params) -> Path:
    directory = tmp_path / "run" / "checkpoints"
    checkpointer = Checkpointer(directory, CheckpointConfig())
    checkpointer.save_params(0, params, run_meta(cfg, 0, {}))
    checkpointer.close()
    return directory.parent


def test_bad_eval_data_is_named(tmp_path):
    path = tmp_path / "cut.npy"
    np.array([5, 6, 0, 7, 8], dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match="does not end with EOS"):
        documents.open_eval_set("x", [str(path)], token_dtype="uint16", eos_id=0)
    np.array([5, 6, 0], dtype=np.uint16).tofile(path)
    np.savez(path.with_suffix(".docs.npz"), token_offsets=np.array([0, 2]), text_bytes=np.array([4]))
    with pytest.raises(DataError, match="sidecar"):
        documents.open_eval_set("x", [str(path)], token_dtype="uint16", eos_id=0)
    big = tmp_path / "big.npy"
    np.array([600, 0], dtype=np.uint16).tofile(big)
    selection = documents.select([documents.open_eval_set("x", [str(big)], token_dtype="uint16", eos_id=0)],
                                 sequence_length=8)
    with pytest.raises(DataError, match="vocab size 512"):
        documents.read_rows(selection, slice(0, 1), eos_id=0, pad_id=1, vocab_size=512, batch_rows=1)


def test_kl_of_a_checkpoint_with_itself_is_zero_and_with_a_perturbed_copy_positive(cfg, params, shards):
    selection = documents.select([documents.open_eval_set("s", shards, token_dtype="uint16", eos_id=0)],
                                 sequence_length=64, tokens=1000)
    layout = eval_layout()
    same, agree = kl.token_kls(Model("a", cfg, params), Model("a", cfg, params), selection, layout, rows_per_batch=8)
    assert same.size == sum(selection.tokens) and np.all(same == 0) and agree.all()
    noise = jax.tree.map(lambda p: p + 0.01 * np.random.default_rng(0).standard_normal(p.shape).astype(p.dtype), params)
    values, agree = kl.token_kls(Model("a", cfg, params), Model("b", cfg, noise), selection, layout, rows_per_batch=8)
    summary = kl.summarize(values, agree)
    assert summary["kl_mean"] > 0 and np.all(values >= -1e-6)
    assert summary["kl_quantiles"]["p50"] <= summary["kl_quantiles"]["p99"] <= summary["kl_max"]


def test_kl_cli_between_a_checkpoint_and_its_hf_export(cfg, params, checkpoint, shards, tmp_path):
    from olmax.interop.hf import write_hf

    write_hf(cfg, params, tmp_path / "hf")
    assert load_model(tmp_path / "hf").cfg.model.vocab_size == cfg.model.vocab_size
    assert run_cli("eval", "kl", checkpoint / "0", tmp_path / "hf", "--data", shards[0], "--tokens", 500, "--out",
                   tmp_path / "kl") == 0
    report = json.loads((tmp_path / "kl.json").read_text())
    assert report["a"] == f"{checkpoint}/0" and report["b"] == str(tmp_path / "hf")
    # Same weights; the HF directory does not carry olmax's impl.attention.block (a speed knob: 16 in `tiny`, 512
    # by default), so attention sums run in other block orders. Measured: mean KL 1.1e-8, max 4.8e-7.
    assert report["tokens"] >= 500 and report["kl_mean"] < 1e-7 and report["top1_agreement"] == 1.0
    assert sum(report["histogram"]["counts"]) == report["tokens"]
    assert (tmp_path / "kl.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_name_the_input(checkpoint, tmp_path, capsys):
    assert run_cli("eval", "heldout", checkpoint, "--data", tmp_path / "missing.npy") == 2
    assert "missing.npy does not exist" in capsys.readouterr().err
    assert run_cli("eval", "heldout", tmp_path / "nothing", "--data", tmp_path / "missing.npy") == 2
    assert "nothing does not exist" in capsys.readouterr().err
    # a mix file given as --data said "set data.mix_file", a setting the user had not given
    assert run_cli("eval", "heldout", checkpoint, "--data", f"code={tmp_path / 'missing.txt'}") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(f"mix file {tmp_path / 'missing.txt'} does not exist; --data must name an existing file of "
                         "`label,path` lines"), line


def test_heldout_reads_shards_with_the_dtype_training_checks(base_run, synth_mix, synth_mix32, capsys):
    """uint32 shards give the same documents and tokens as the uint16 ones they equal; read as the model's
    uint16 they are refused, as training refuses them."""
    from olmax.cli import main

    def heldout(mix, *extra):
        assert main(["eval", "heldout", str(base_run), "--data", f"synthetic={mix}", *extra]) == 0
        return json.loads(capsys.readouterr().out)["sets"]["synthetic"]

    narrow = heldout(synth_mix)
    assert heldout(synth_mix32, "--token-dtype", "uint32") == narrow
    assert main(["eval", "heldout", str(base_run), "--data", str(synth_mix32)]) == 2
    err = capsys.readouterr().err
    assert "written as uint32 tokens" in err and "set --token-dtype=uint32" in err


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_a_token_budget_below_one_is_refused(base_run, synth_mix, capsys, tokens):
    from olmax.cli import main

    assert main(["eval", "heldout", str(base_run), "--data", str(synth_mix), "--tokens", tokens]) == 2
    assert f"--tokens {tokens}: give a positive number of tokens per set" in capsys.readouterr().err


def test_heldout_says_what_it_does_in_every_silence(base_run, synth_mix, capsys, monkeypatch):
    """It printed nothing for 39 s: a line once it has its model and sets, and in each silence what it waits for
    (progress.SILENCE a fraction of a second here), all on stderr; stdout holds the JSON alone."""
    from olmax import progress
    from olmax.cli import main

    monkeypatch.setattr(progress, "SILENCE", 0.2)
    said = []
    real = heldout.evaluate

    def evaluate_once_a_silence_is_broken(*args, **kwargs):  # the ticker's line is the event waited for
        deadline = time.monotonic() + 60
        while not any("] still scoring" in text for text in said) and time.monotonic() < deadline:
            time.sleep(0.05)
            said.append(capsys.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(heldout, "evaluate", evaluate_once_a_silence_is_broken)
    assert main(["eval", "heldout", str(base_run), "--data", f"synthetic={synth_mix}", "--tokens", "500"]) == 0
    out, err = capsys.readouterr()
    lines = "".join([*said, err]).splitlines()
    ticks = [line for line in lines if line.startswith("olmax eval heldout: [")]
    started = [line for line in lines if line not in ticks]
    assert len(started) == 1 and started[0].startswith(f"olmax eval heldout: scoring {base_run}/checkpoints/6 on "), lines
    assert started[0].endswith(" tokens of synthetic (compiling first)")
    assert all(line.split("] ")[1].startswith(("still loading", "still scoring")) for line in ticks), ticks
    assert json.loads(out)["sets"]["synthetic"]["tokens"] >= 500


def test_an_out_that_is_a_symbolic_link_is_refused_before_the_evaluation(tmp_path, capsys):
    """It was refused once the evaluation had run, its results not printed."""
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    assert run_cli("eval", "heldout", tmp_path / "no-run", "--data", tmp_path / "missing.npy",
                   "--out", tmp_path / "link.json") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"olmax: RunDirError: {tmp_path}/link.json is a symbolic link") and err.count("\n") == 1
    assert not (tmp_path / "elsewhere.json").exists()
