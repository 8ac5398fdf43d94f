"""`olmax tokenize --engine ray` against the single-host path: tokens/s, and the sha256 of every file they write.

    .venv/bin/python benchmarks/tokenize_ray.py                          # 256 MB of text in 64 files, 2 workers
    .venv/bin/python benchmarks/tokenize_ray.py --workers 8 --megabytes 1024 --files 128
    .venv/bin/python benchmarks/tokenize_ray.py --checks                 # and the runs with faults
    .venv/bin/python benchmarks/tokenize_ray.py --address HEAD:6379      # and a row on an existing cluster

The corpus is the running Python's standard library sources, one JSON line per source file (text any machine
has, nothing downloaded), cycled until it holds --megabytes of text, in --files files in turn .jsonl,
.jsonl.gz, .jsonl.zst and .txt (a .txt file is one document); without --tokenizer a byte-level BPE of
--vocab-size is trained on its first .jsonl file. Rows, each tokenizing the whole corpus into fresh shards:

- processes: the single-host path, --workers worker processes;
- ray, 1 node: a Ray head started with `ray start` with --workers CPUs (the job's time, not the start's);
- ray, 2 nodes: a head and a second node on this machine, --workers / 2 CPUs each (rounded up), the same
  number of workers over two raylets (on two machines, give --address);
- ray at --address: the cluster there, all its CPUs;
- with --checks, on the one-node cluster: a worker running a task SIGKILLed twice; the command SIGKILLed
  once a third of the tasks are done and run again (the time of both runs).

`same bytes`: every file the row wrote has the sha256 of the processes row's (tokenize.json with the engine
recorded as the processes row's). The clusters started here use ports, directories and an auth token of their
own (tests/ray_cluster.py), and are stopped after their rows.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ray_cluster import kill_tasks, local_cluster, ray_env  # noqa: E402  (the tests' clusters)

from olmax.data.tokenize import find_inputs, plan_tasks, tokenize_corpus, train_tokenizer  # noqa: E402

SUFFIXES = ("jsonl", "jsonl.gz", "jsonl.zst", "txt")


def write_corpus(directory: Path, megabytes: float, files: int) -> int:
    """The corpus (see the module's doc); its bytes of text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]
    per_file, written, source = megabytes * 1e6 / files, 0, 0
    directory.mkdir(parents=True)
    for i in range(files):
        lines, size = [], 0
        while size < per_file:
            text = sources[source % len(sources)].read_text(encoding="utf-8", errors="replace")
            source += 1
            lines.append(json.dumps({"text": text}) + "\n")
            size += len(text.encode())
        data = "".join(lines).encode()
        suffix = SUFFIXES[i % len(SUFFIXES)]
        compress = {"jsonl.gz": gzip.compress, "jsonl.zst": zstandard.compress}.get(suffix, bytes)
        (directory / f"part-{i:04d}.{suffix}").write_bytes(compress(data))
        written += size
    return written


def digests(out: Path) -> dict[str, str]:
    found = {}
    for path in sorted(out.iterdir()):
        data = path.read_bytes()
        if path.name == "tokenize.json":  # the engine is recorded; nothing else may differ
            record = json.loads(data)
            data = json.dumps({**record, "engine": "processes"}).encode()
        found[path.name] = hashlib.sha256(data).hexdigest()
    return found


def killed_and_rerun(text: str, tokenizer: str, out: Path, shard_tokens: int, address: str, env: dict,
                     tasks: int) -> None:
    """The command on the cluster at `address`, SIGKILLed once a third of its tasks are done, then run again."""
    argv = [sys.executable, "-m", "olmax.cli", "tokenize", str(text), "--tokenizer", tokenizer, "--out", str(out),
            "--label", "corpus", "--shard-tokens", str(shard_tokens), "--engine", "ray", "--address", address, "--quiet"]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    while len(list(out.glob(".tokenize/task-*.json"))) < max(1, tasks // 3) and first.poll() is None:
        time.sleep(0.05)
    first.kill()
    first.wait()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=256.0, help="MB of UTF-8 text in the corpus")
    parser.add_argument("--files", type=int, default=64, help="files the corpus is written in")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (Ray: CPUs) of the rows")
    parser.add_argument("--shard-tokens", type=int, default=1 << 22,
                        help="tokens per shard, at most; a task reads files of min(this, 32 MiB) bytes (default "
                             "%(default)s: a task a file or two at the default sizes, so Ray has tasks for all CPUs)")
    parser.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="the Ray clusters started here: of 1 node, of 2 nodes (default: both)")
    parser.add_argument("--address", help="also a row on the Ray cluster there (its nodes must reach --dir)")
    parser.add_argument("--checks", action="store_true", help="also the rows with a killed worker and command")
    parser.add_argument("--dir", help="where the corpus and outputs are written (default: a temporary directory)")
    args = parser.parse_args()

    work = Path(args.dir or tempfile.mkdtemp(prefix="olmax-tokenize-ray-"))
    try:
        text_bytes = write_corpus(work / "text", args.megabytes, args.files)
        stored = sum(p.stat().st_size for p in (work / "text").iterdir())
        tokenizer = args.tokenizer
        if tokenizer is None:
            started = time.perf_counter()
            tokenizer = train_tokenizer([str(p) for p in sorted((work / "text").glob("*.jsonl"))[:1]],
                                        work / "tokenizer.json", vocab_size=args.vocab_size, progress=False)
            print(f"trained a {args.vocab_size}-token byte-level BPE in {time.perf_counter() - started:.1f} s")
        print(f"corpus: {text_bytes / 1e6:.1f} MB of Python stdlib sources in {args.files} files "
              f"({', '.join(SUFFIXES)}; {stored / 1e6:.1f} MB stored); {os.cpu_count()} CPUs")
        print(f"| {'row':<48} | {'seconds':>8} | {'MB/s':>6} | {'M tokens/s':>10} | shards | same bytes |")
        print(f"|{'-' * 50}|{'-' * 10}:|{'-' * 8}:|{'-' * 12}:|{'-' * 7}:|{'-' * 12}|")
        reference, differ = {}, []

        def row(name: str, run) -> None:
            out = work / f"out-{len(reference)}"
            started = time.perf_counter()
            run(out)
            seconds = time.perf_counter() - started
            record = json.loads((out / "tokenize.json").read_text())
            found = digests(out)
            reference.setdefault("digests", found)
            print(f"| {name:<48} | {seconds:8.1f} | {record['text_bytes'] / 1e6 / seconds:6.2f} | "
                  f"{record['tokens'] / 1e6 / seconds:10.3f} | {len(record['shards']):6d} | "
                  f"{'yes' if found == reference['digests'] else 'NO':>10} |", flush=True)
            differ.extend(name for name in found if found[name] != reference["digests"].get(name))
            shutil.rmtree(out)

        common = dict(tokenizer_path=tokenizer, shard_tokens=args.shard_tokens, label="corpus", progress=False)
        inputs = [str(work / "text")]
        row(f"processes, {args.workers} workers", lambda out: tokenize_corpus(inputs, out, workers=args.workers,
                                                                               **common))
        env = ray_env()  # one token: this process's Ray keeps the first it is given
        os.environ.update({key: env[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})
        for nodes in args.nodes:
            cpus = args.workers if nodes == 1 else -(-args.workers // 2)
            with local_cluster(nodes=nodes, cpus=cpus, env=env) as (cluster, _):
                address = cluster[0].address
                ray = dict(engine="ray", address=address, **common)
                row(f"ray, {nodes} node{'s' * (nodes > 1)} x {cpus} CPUs",
                    lambda out: tokenize_corpus(inputs, out, **ray))
                if args.checks and nodes == 1:
                    killed = kill_tasks(cluster, times=2)
                    row(f"ray, 1 node x {cpus} CPUs, a worker killed twice",
                        lambda out: tokenize_corpus(inputs, out, **ray))
                    print(f"  (worker processes killed while they ran a task: {len(killed)})")
                    tasks = len(plan_tasks(find_inputs(inputs), args.shard_tokens))
                    row(f"ray, 1 node x {cpus} CPUs, command killed and rerun",
                        lambda out: killed_and_rerun(inputs[0], tokenizer, out, args.shard_tokens, address, env,
                                                         tasks))
        if args.address:
            row(f"ray at {args.address}", lambda out: tokenize_corpus(inputs, out, engine="ray",
                                                                      address=args.address, **common))
        listing = "".join(f"{digest}  {name}\n" for name, digest in reference["digests"].items())
        print(f"the processes row's {len(reference['digests'])} files: sha256 of their `sha256sum` listing "
              f"{hashlib.sha256(listing.encode()).hexdigest()}")
        if differ:
            sys.exit(f"files whose bytes differ from the processes row's: {', '.join(sorted(set(differ)))}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
