"""The data commands of the `olmax` CLI: tokenize, tokenizer train, synth-data."""

from __future__ import annotations

import argparse
from pathlib import Path

from olmax.arguments import given, old_spelling


def add_commands(subparsers) -> None:
    tokenize = subparsers.add_parser(
        "tokenize",
        help="text (JSONL `text` field, .txt, directories; .gz/.zst) -> OLMo token shards + sidecars + mix file",
    )
    tokenize.add_argument("inputs", nargs="+", help="text files or directories of them, local or gs://, s3:// "
                          "(https:// files)")
    tokenize.add_argument("--tokenizer", required=True, help="HF tokenizers tokenizer.json, local or in a bucket")
    tokenize.add_argument("--out", required=True, help="a new or empty output directory, local or gs://, s3:// (or "
                          "the unfinished output of this same command, which it finishes)")
    tokenize.add_argument("--eos-token", default="<|endoftext|>", help="token appended after every document (default: %(default)s)")
    tokenize.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard, at most (whole documents; default: %(default)s)")
    tokenize.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores; 0: "
                          "none); with --engine ray, the CPUs of the local Ray")
    tokenize.add_argument("--engine", choices=("processes", "ray"), default="processes",
                          help="processes: worker processes on this host (default); ray: Ray tasks (the `ray` extra)")
    tokenize.add_argument("--address", default=None, help="with --engine ray: the Ray cluster to join (host:port of "
                          "its head; default: a local Ray started for the command)")
    tokenize.add_argument("--skip-bad", action="store_true", help="skip documents that are not UTF-8, not JSON or "
                          "without a string `text` (counted in tokenize.json) instead of failing on the first")
    tokenize.add_argument("--label", default=None, help="source label in the mix file (default: output dir name)")
    tokenize.add_argument("--quiet", action="store_true", help="no progress line")
    tokenize.set_defaults(func=cmd_tokenize)

    tokenizer = subparsers.add_parser("tokenizer", help="tokenizer tools")
    verbs = tokenizer.add_subparsers(dest="verb", required=True)
    train = verbs.add_parser("train", help="train a byte-level BPE on local text (EOS <|endoftext|> = 0, pad <|pad|> = 1)")
    train.add_argument("inputs", nargs="+", help="text files or directories of them")
    train.add_argument("--vocab-size", type=int, required=True,
                       help="tokens in the vocabulary, the byte alphabet and special tokens included (required)")
    train.add_argument("--out", required=True, help="the tokenizer.json to write (a new file)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_tokenizer_train)

    synth = subparsers.add_parser(
        "synth-data", help="shards of a small learnable generated language (for the quick start and tests)"
    )
    synth.add_argument("config", nargs="?", help="preset or YAML giving vocab size, EOS id and token dtype "
                       "(default: tiny)")
    synth.add_argument("--out", required=True, help="a new or empty output directory")
    old_spelling(synth, "--config", "config", "give CONFIG as the first argument, `olmax synth-data CONFIG --out DIR`")
    synth.add_argument("--tokens", type=int, default=1 << 21, help="tokens in all, EOS included (default: %(default)s)")
    synth.add_argument("--shards", type=int, default=4, help="shard files the tokens are split into (default: %(default)s)")
    synth.add_argument("--seed", type=int, default=0, help="seed of the generated language and text (default: %(default)s)")
    synth.set_defaults(func=cmd_synth_data)


def cmd_tokenize(args: argparse.Namespace) -> None:
    from olmax.data.tokenize import tokenize_corpus

    result = tokenize_corpus(
        args.inputs,
        args.out,
        tokenizer_path=args.tokenizer,
        eos_token=args.eos_token,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        label=args.label,
        progress=not args.quiet,
        engine=args.engine,
        address=args.address,
        skip_bad=args.skip_bad,
    )
    skipped = f", {result.skipped_documents} bad documents skipped" if args.skip_bad else ""
    how = (f"{result.seconds:.1f} s, {result.text_bytes / 1e6 / result.seconds:.2f} MB/s{skipped}" if not
           result.done_before else "--out holds the finished output of this same command: nothing to do")
    print(f"{result.documents} documents, {result.text_bytes / 1e6:.1f} MB of text -> {result.tokens} tokens in "
          f"{len(result.shards)} shards ({how})")
    pad = f" data.pad_id={result.pad_id}" if result.pad_id is not None else ""
    print(
        f"read with: data.mix_file={result.mix_file} data.token_dtype={result.token_dtype} "
        f"data.eos_id={result.eos_id}{pad} model.vocab_size={result.vocab_size}"
    )


def cmd_tokenizer_train(args: argparse.Namespace) -> None:
    from olmax.data.tokenize import train_tokenizer

    path = train_tokenizer(args.inputs, args.out, vocab_size=args.vocab_size, progress=not args.quiet)
    print(f"wrote {path}")


def cmd_synth_data(args: argparse.Namespace) -> None:
    from olmax.config import load_config
    from olmax.data.synthetic import write_synthetic_shards

    config = load_config(given(args, "config", "the config") or "tiny")
    paths = write_synthetic_shards(
        args.out,
        vocab_size=config.model.vocab_size,
        eos_id=config.data.eos_id,
        n_tokens=args.tokens,
        n_shards=args.shards,
        seed=args.seed,
        token_dtype=config.data.token_dtype,
    )
    print(f"wrote {len(paths)} shards, {args.tokens} tokens; read with: data.mix_file={Path(args.out) / 'mix.txt'} "
          f"data.token_dtype={config.data.token_dtype}")
