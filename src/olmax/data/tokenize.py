"""Text to OLMo shards, and byte-level BPE training, with HF `tokenizers` (the tokenizer a local file).

Input: JSONL (one document per line, its `text` field), .txt (one document per
file), or directories of them (recursively, in sorted order); each may be
.gz or .zst compressed; local paths or, through olmax.storage, gs:// and s3://
objects and prefixes and https:// files. Output, in a new or empty directory
(local or in a bucket):

- `part-TTTTT-PPPPP.npy`: raw headerless uint16 (vocab <= 65536) or uint32 tokens,
  EOS after every document, documents whole, at most `shard_tokens` per shard;
- `part-TTTTT-PPPPP.docs.npz`: the sidecar, `token_offsets` [documents + 1]
  (document d is tokens [offsets[d], offsets[d + 1]), its EOS included) and
  `text_bytes` [documents] (UTF-8 bytes of its text, for bits per byte);
- `mix.txt`: OLMo-core's `label,path` mix file over the shards;
- `shards.json`: their token dtype, vocab size and EOS id (reading them as
  another dtype is an error);
- `tokenize.json`: what was run and the `data.*` settings that read the result.

The input files are read by tasks: consecutive files are gathered into one task
until they hold min(shard_tokens, TASK_BYTES) bytes (a larger file is a task of
its own). Task T writes its documents, in order, into the shards part-T-00000,
part-T-00001, ...: the output is a function of the inputs and settings alone, the
same bytes whatever runs the tasks. The `processes` engine runs them one after
another on this host, the documents of each tokenized by worker processes; the
`ray` engine runs each as a Ray task on a cluster, which reads its inputs and
writes its shards itself (olmax.data.tokenize_ray).

Each shard is committed on its own: written beside (in a bucket, uploaded), then
its record written into `.tokenize/`, the commit. The same command run again on
an unfinished output resumes each task after its last committed shard, as a Ray
task retried after its worker or node was lost does. The mix file, shards.json
and tokenize.json are written when every task is done, and `.tokenize/` removed;
the same command run again on the finished output finds it in tokenize.json and
does nothing. One command at a time writes an output: it holds `.tokenize.lock`
there as `olmax train` holds a run directory (olmax.run_lock). What the tasks
run, whatever the engine, is olmax.data.tokenize_tasks.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib.util
import json
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from olmax import run_lock, storage
from olmax.data.shards import DataError, write_shards_record
from olmax.data.tokenize_tasks import (WORK, Progress, ProgressLine, Settings, Task, find_inputs, init_worker,
                                       plan_tasks, read_documents, run_task)
from olmax.outputs import check_new_output

ENGINES = ("processes", "ray")
LOCK = ".tokenize.lock"  # held by the command writing the output (olmax.run_lock); on disk removed when it is done
COUNTS = ("documents", "tokens", "text_bytes", "skipped_documents")
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


@dataclass
class TokenizeResult:
    shards: list[str]
    mix_file: str
    documents: int
    tokens: int
    text_bytes: int
    skipped_documents: int
    seconds: float
    vocab_size: int
    eos_id: int
    pad_id: int | None
    token_dtype: str
    done_before: bool  # the output was this same command's, finished before: nothing was done


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(read_tokenizer(path))


def read_tokenizer(path: str | os.PathLike) -> str:
    """The text of a tokenizer.json (local or in a bucket), checked to load."""
    from tokenizers import Tokenizer

    if storage.is_remote(path):
        text = storage.read_text(str(path))
    elif Path(path).is_dir():
        raise DataError(f"tokenizer file {path} is a directory; pass the tokenizer.json file (e.g. in it)")
    elif not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass a local tokenizer.json or train one with "
                        "`olmax tokenizer train`")
    else:
        text = Path(path).read_text()
    try:
        Tokenizer.from_str(text)
    except Exception as err:
        raise DataError(f"tokenizer file {path} does not load ({err}); pass a HF tokenizers tokenizer.json") from None
    return text


def special_id(tokenizer, token: str, path) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"tokenizer {path} has no token {token!r}; name its end-of-document token with --eos-token")
    return token_id


def tokenize_corpus(
    inputs: list[str],
    out_dir: str | os.PathLike,
    *,
    tokenizer_path: str | os.PathLike,
    eos_token: str = EOS_TOKEN,
    shard_tokens: int = 1 << 28,
    workers: int | None = None,
    label: str | None = None,
    progress: bool = True,
    engine: str = "processes",
    address: str | None = None,
    skip_bad: bool = False,
) -> TokenizeResult:
    """Tokenize the inputs into shards + sidecars + mix file in out_dir (new or empty, or the unfinished output of
    this same command, which it finishes). `engine="ray"` runs the tasks on the Ray cluster at `address` (default:
    a local one started for the command, with `workers` CPUs)."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    _check_arguments(engine, address, workers, shard_tokens)
    out = str(out_dir) if storage.is_remote(out_dir) else os.path.abspath(out_dir)
    if not storage.is_remote(out) and Path(out).exists() and not Path(out).is_dir():
        check_new_output(out, "tokenize", DataError)  # names it as a file, before the lock is made in it
    label = _mix_label(label, out)
    files = find_inputs(inputs)
    tokenizer_json = read_tokenizer(tokenizer_path)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer_name = str(tokenizer_path) if storage.is_remote(tokenizer_path) else str(Path(tokenizer_path).resolve())
    eos_id = special_id(tokenizer, eos_token, tokenizer_path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    settings = Settings(out, eos_id, dtype, shard_tokens, skip_bad)
    tasks = plan_tasks(files, shard_tokens)
    plan = {"inputs": files, "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
            "eos_token": eos_token, "shard_tokens": shard_tokens}
    # What tokenize.json records of the command, to recognize its finished output: the plan, by value (no paths).
    command = {"input_bytes": [size for _, size in files], "tokenizer_sha256": plan["tokenizer_sha256"],
               "eos_token": eos_token, "shard_tokens": shard_tokens, "label": label}
    made = not storage.is_remote(out) and not Path(out).exists()
    with run_lock.hold(out, lock=storage.join(out, LOCK), setting="--out"):  # one command at a time on `out`
        summary = _finished(out, [f for f, _ in files], command)
        done_before = summary is not None
        if not done_before:
            with _engine(engine, address, workers) as run_tasks:
                done = _resume_or_start(out, json.loads(json.dumps(plan)))
                pending = [task for task in tasks if task.index not in done]
                done_files = [size for task in tasks if task.index in done for _, _, size in task.files]
                line = ProgressLine(progress, len(files), sum(size for _, size in files), len(done_files),
                                    sum(done_files))
                try:
                    done.update(run_tasks(pending, settings, tokenizer_json, line))
                except BaseException:
                    _remove_if_unbegun(out, made)
                    raise
                finally:
                    line.close()
            records = [done[task.index] for task in tasks]
            if any(record["shards"] for record in records):
                summary = _finish(out, records, label, {
                    "vocab_size": vocab_size, "eos_id": eos_id, "pad_id": tokenizer.token_to_id(PAD_TOKEN),
                    "token_dtype": dtype, "tokenizer": tokenizer_name, "inputs": [f for f, _ in files],
                    "engine": engine, "command": command})
        if summary is not None:
            _remove_work(out)
    if summary is None:
        storage.remove(out)  # it holds nothing but the work directory
        raise DataError(f"the inputs {inputs} hold no documents with text (empty ones are skipped)")
    shown = str(out_dir)
    return TokenizeResult(
        shards=[storage.join(shown, name) for name in summary["shards"]], mix_file=storage.join(shown, "mix.txt"),
        **{key: summary[key] for key in (*COUNTS, "vocab_size", "eos_id", "pad_id", "token_dtype")},
        seconds=time.perf_counter() - started, done_before=done_before)


def _finish(out: str, records: list[dict], label: str, facts: dict) -> dict:
    """Write the mix file, shards.json and tokenize.json of an output whose tasks are done (their `records`); the
    tokenize.json record: the shards, their counts and `facts`, the same bytes for the same inputs and settings
    wherever the output is (no time, no out path)."""
    names = [name for record in records for name in record["shards"]]
    storage.write_bytes(storage.join(out, "mix.txt"), "".join(f"{label},{name}\n" for name in names).encode())
    write_shards_record(out, names, token_dtype=facts["token_dtype"], vocab_size=facts["vocab_size"],
                        eos_id=facts["eos_id"])
    summary = {"shards": names, "mix_file": "mix.txt", **{key: sum(r[key] for r in records) for key in COUNTS},
               **facts}
    storage.write_bytes(storage.join(out, "tokenize.json"), (json.dumps(summary, indent=1) + "\n").encode())
    return summary


def _check_arguments(engine: str, address: str | None, workers: int | None, shard_tokens: int) -> None:
    if workers is not None and workers < 0:
        raise DataError(f"--workers {workers}: give the number of tokenizer processes, 0 (none: this one) or more")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: give the most tokens a shard holds, 1 or more")
    if engine not in ENGINES:
        raise DataError(f"--engine {engine}: not one of {', '.join(ENGINES)}")
    if address is not None and engine != "ray":
        raise DataError("--address names a Ray cluster: give it with --engine ray")
    if engine == "ray" and address is not None and workers is not None:
        raise DataError("--workers sets the CPUs of a local Ray; the tasks use every CPU of the cluster at --address: "
                        "leave --workers out")
    if engine == "ray" and workers == 0:
        raise DataError("--workers 0 starts a Ray with no CPU to run the tasks on: give 1 or more")
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        raise DataError("--engine ray needs Ray, which is not installed: pip install 'olmax[ray]'")


def _mix_label(label: str | None, out: str) -> str:
    """The label of the shards in mix.txt: `label`, else the output directory's name; DataError where a mix file's
    `label,path` line would not read it back as it is (a comma, a line break, spaces around it, a leading #)."""
    name = storage.basename(out) if storage.is_remote(out) else Path(out).resolve().name
    shown = f"--label {label!r}" if label is not None else f"the name of --out, {name!r}, the default --label,"
    label = name if label is None else label
    if not label.strip() or label != label.strip() or "," in label or len(label.splitlines()) > 1 or label[0] == "#":
        raise DataError(f"{shown} cannot label a mix file's `label,path` lines: give a --label of one line, without "
                        "a comma, a leading # or spaces around it")
    return label


def _finished(out: str, inputs: list[str], command: dict) -> dict | None:
    """The record (tokenize.json) of `out` when it is the finished output of this same command, else None. A
    command killed while it removed its work directory finished all the same: what is left of it goes."""
    try:
        summary = json.loads(storage.read_text(storage.join(out, "tokenize.json")))
    except (OSError, ValueError):  # none (MissingObject), or torn by a kill while it was written: not finished
        return None
    if not isinstance(summary, dict) or (summary.get("inputs"), summary.get("command")) != (inputs, command):
        return None
    return summary


def _remove_work(out: str) -> None:
    """Remove the work directory and, on disk, the lock (while it is held: a command that opens it after finds it
    gone and makes another, to find the output finished)."""
    if storage.exists(storage.join(out, WORK)):
        storage.remove(storage.join(out, WORK))
    if not storage.is_remote(out):
        Path(out, LOCK).unlink(missing_ok=True)


def _remove_if_unbegun(out: str, made: bool) -> None:
    """After a failure (its tasks ended): when no shard or task of `out`, a directory, is committed, there is
    nothing to resume, and the output is left as it was before the command: its work directory and lock removed,
    and `out` too if the command `made` it."""
    if storage.is_remote(out) or any(name.startswith(("part-", "task-")) for name in os.listdir(Path(out, WORK))):
        return
    _remove_work(out)
    if made:
        with contextlib.suppress(OSError):  # not empty: something else is in it now
            os.rmdir(out)


@contextlib.contextmanager
def _engine(engine: str, address: str | None, workers: int | None):
    """The engine's `run_tasks(tasks, settings, tokenizer_json, line)`, their records; Ray joined (or started)
    first, so that a cluster it cannot join is refused before the output is begun."""
    if engine == "ray":
        from olmax.data.tokenize_ray import joined, run_on_ray

        with joined(address, workers):
            yield run_on_ray
        return
    yield lambda tasks, settings, tokenizer_json, line: _run_here(tasks, settings, tokenizer_json, workers,
                                                                   Progress(line))


def _resume_or_start(out: str, plan: dict) -> dict[int, dict]:
    """The records of the tasks an earlier run of this command on `out` finished ({} for a new or empty `out`,
    where the plan is written)."""
    work = storage.join(out, WORK)
    plan_path = storage.join(work, "plan.json")
    if storage.exists(plan_path):
        if json.loads(storage.read_text(plan_path)) != plan:
            raise DataError(f"{out} holds the unfinished output of a tokenize of other inputs or settings: run that "
                            f"command again to finish it, or delete {out}")
        names = [name for name in storage.listdir(work) if name.startswith("task-")]
        with ThreadPoolExecutor(16) as pool:
            records = pool.map(lambda name: json.loads(storage.read_text(storage.join(work, name))), names)
        return {int(name[5:10]): record for name, record in zip(names, records)}
    check_new_output(out, "tokenize", DataError, ignoring=(LOCK,))
    storage.write_bytes(plan_path, json.dumps(plan).encode())
    return {}


def _run_here(tasks: list[Task], settings: Settings, tokenizer_json: str, workers: int | None,
              progress: Progress) -> dict[int, dict]:
    """The `processes` engine: the tasks one after another, their chunks tokenized by `workers` processes (0:
    in this one, with the tokenizer's own threads)."""
    workers = os.cpu_count() if workers is None else workers
    args = (tokenizer_json, settings.eos_id, settings.dtype, settings.skip_bad)
    if workers == 0:
        init_worker(*args, one_of_many=False)
        return {task.index: run_task(task, settings, map, progress) for task in tasks}
    with multiprocessing.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(*args, True)) as pool:

        def encode_map(fn, chunks):
            """pool.imap, reading no more than 2 chunks a worker ahead (imap reads all of its input at once)."""
            ahead = collections.deque()
            for chunk in chunks:
                ahead.append(pool.apply_async(fn, (chunk,)))
                if len(ahead) > 2 * workers:
                    yield ahead.popleft().get()
            while ahead:
                yield ahead.popleft().get()

        return {task.index: run_task(task, settings, encode_map, progress) for task in tasks}


def train_tokenizer(
    inputs: list[str], out_path: str | os.PathLike, *, vocab_size: int, progress: bool = True
) -> str:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with EOS id 0 and pad id 1; save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_path)
    if out.is_dir():
        raise DataError(f"{out} is a directory; give the tokenizer file to write, e.g. {out / 'tokenizer.json'}")
    if out.exists():
        raise DataError(f"{out} exists; give a new file name, or delete it to train the tokenizer again")
    files = find_inputs(inputs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator((text for path, _ in files for text in read_documents(path)), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    tokenizer.save(str(partial))
    os.replace(partial, out)
    return str(out)
