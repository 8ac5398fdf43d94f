"""`olmax tokenize` throughput in MB of text per second.

    .venv/bin/python benchmarks/tokenize_throughput.py                      # BPE trained here, stdlib corpus
    .venv/bin/python benchmarks/tokenize_throughput.py --tokenizer dolma2/tokenizer.json

The corpus is the running Python's standard library sources, one JSONL
document per file (text any machine has, nothing downloaded), written once
per run; without --tokenizer a byte-level BPE of --vocab-size is trained on
its first 8 MB. Each worker count tokenizes the whole corpus into fresh shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from olmax.data.tokenize import tokenize_corpus, train_tokenizer


def write_corpus(path: Path, megabytes: float) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    written = 0
    with open(path, "w") as out:
        while written < megabytes * 1e6:
            for source in sorted(stdlib.rglob("*.py")):
                if "site-packages" in source.parts:
                    continue
                text = source.read_text(encoding="utf-8", errors="replace")
                out.write(json.dumps({"text": text}) + "\n")
                written += len(text.encode())
                if written >= megabytes * 1e6:
                    break
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=32.0, help="corpus size, MB of UTF-8 text")
    parser.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count()])
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="olmax-tokenize-bench-"))
    try:
        corpus = work / "corpus.jsonl"
        text_bytes = write_corpus(corpus, args.megabytes)
        tokenizer = args.tokenizer
        if tokenizer is None:
            sample = work / "sample.jsonl"
            write_corpus(sample, min(8.0, args.megabytes))
            started = time.perf_counter()
            tokenizer = train_tokenizer([str(sample)], work / "tokenizer.json", vocab_size=args.vocab_size,
                                        progress=False)
            print(f"trained a {args.vocab_size}-token byte-level BPE in {time.perf_counter() - started:.1f} s")
        print(f"corpus: {text_bytes / 1e6:.1f} MB of Python stdlib sources; {os.cpu_count()} CPUs")
        print(f"{'workers':>7} {'MB/s':>8} {'M tokens/s':>11} {'seconds':>8}")
        for workers in args.workers:
            result = tokenize_corpus([str(corpus)], work / f"out-{workers}", tokenizer_path=tokenizer,
                                     workers=workers, progress=False)
            print(f"{workers:7d} {result.text_bytes / 1e6 / result.seconds:8.2f} "
                  f"{result.tokens / 1e6 / result.seconds:11.2f} {result.seconds:8.1f}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
