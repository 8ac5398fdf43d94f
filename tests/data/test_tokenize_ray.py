"""`olmax tokenize --engine ray` on real Ray clusters: a head started with `ray start` (the tests' own ports,
directories and token: tests/ray_cluster.py), and the local Ray the command starts itself. The output is the bytes
of the single-host path (tokenize.json aside, which records the engine), with Ray's workers killed in the middle
of the job, and with the command itself killed and run again. A job spread over two nodes, one of them dying, is
tests/launch/test_ray_two_nodes.py's."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zstandard
from ray_cluster import kill_tasks, local_cluster, ray_env
from testlib import write_text_corpus

from olmax.data.tokenize import tokenize_corpus, train_tokenizer

pytestmark = pytest.mark.slow
SETTINGS = ["--shard-tokens", "40000", "--label", "web"]  # and in the fixture's and the first test's calls


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """16 files (JSONL plain, .gz and .zst, and .txt), a tokenizer, and the single-host output: (the input
    directory, the tokenizer, the output's directory)."""
    root = tmp_path_factory.mktemp("ray-corpus")
    paths = write_text_corpus(root / "text", files=16, lines=250)
    tokenizer = train_tokenizer([str(paths[0])], root / "tokenizer.json", vocab_size=400, progress=False)
    tokenize_corpus([str(root / "text")], root / "single-host", tokenizer_path=tokenizer, shard_tokens=40000,
                    label="web", workers=0, progress=False)
    return root / "text", tokenizer, root / "single-host"


@pytest.fixture(scope="module")
def cluster():
    """A head of 2 CPUs (two tasks at once): (its node, the environment to drive it)."""
    with local_cluster(nodes=1, cpus=2) as started:
        yield started


def run_cli(text, tokenizer, out, *argv, env=None, wait=True):
    command = [sys.executable, "-m", "olmax.cli", "tokenize", str(text), "--tokenizer", str(tokenizer), "--out",
               str(out), *SETTINGS, "--quiet", *argv]
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if not wait:
        return subprocess.Popen(command, env=env)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def assert_same_bytes(out, single_host):
    def digests(root):
        found = {}
        for path in sorted(Path(root).iterdir()):
            data = path.read_bytes()
            if path.name == "tokenize.json":  # the engine recorded, nothing else differs
                data = data.replace(b'"engine": "ray"', b'"engine": "processes"')
            found[path.name] = hashlib.sha256(data).hexdigest()
        return found

    assert digests(out) == digests(single_host)
    assert json.loads((Path(out) / "tokenize.json").read_text())["engine"] == "ray"


def test_a_ray_cluster_writes_the_single_host_bytes_with_a_worker_killed_twice(corpus, cluster, tmp_path):
    """Two tasks' workers and the progress line's counter (an actor) killed: the tasks are run again, the counter
    is not (progress is not work). The command runs in a process of its own, as every Ray driver of this suite
    does: a process that drove Ray keeps some of it after ray.shutdown (Ray's handlers for SIGBUS and SIGTRAP stay
    installed, /proc/self/status shows), and test processes were aborted in an unrelated later test (twice, in
    the same eval test; no cause of the abort itself found) while this test ran the command in-process."""
    text, tokenizer, single_host = corpus
    nodes, env = cluster
    killed, counters = kill_tasks(nodes, times=2), kill_tasks(nodes, times=1, name="ray::Progress")
    done = run_cli(text, tokenizer, tmp_path / "out", "--engine", "ray", "--address", nodes[0].address, env=env)
    assert len(killed) == 2  # both in the middle of the job: a killed task's retry is still to come
    assert len(counters) == 1 and "progress counter, a Ray actor, was lost" in done.stderr, done.stderr[-3000:]
    assert len(list((tmp_path / "out").glob("*.npy"))) > 16
    assert_same_bytes(tmp_path / "out", single_host)


def test_a_failed_task_stops_the_others_and_leaves_the_output_as_it_was(corpus, cluster, tmp_path):
    """Truncated .zst inputs: the driver force-cancelled the other tasks on the first failure, which aborted it
    inside Ray in 2 runs of 5 (`Check failed: it != submissible_tasks_.end()`, exit 1, no olmax line), and left
    `.tokenize` and `.tokenize.lock` in --out, and a staging directory of a cancelled task."""
    _, tokenizer, _ = corpus
    nodes, env = cluster
    line = (json.dumps({"text": "a document cut short " * 2000}) + "\n").encode()
    (tmp_path / "in").mkdir()
    for number in range(4):  # each a task (at least --shard-tokens bytes), none with a whole document
        whole = zstandard.ZstdCompressor().compress(line * (number + 1))
        (tmp_path / "in" / f"cut-{number}.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    done = subprocess.run([sys.executable, "-m", "olmax.cli", "tokenize", str(tmp_path / "in"), "--tokenizer",
                           str(tokenizer), "--out", str(tmp_path / "out"), "--shard-tokens", "16", "--engine", "ray",
                           "--address", nodes[0].address, "--skip-bad", "--quiet"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("olmax: DataError: ") and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert ".jsonl.zst: cannot read it (EOFError: the file ends inside a zstd frame" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_local_ray_of_a_killed_command_is_gone_and_the_same_command_finishes_the_job(corpus, tmp_path):
    text, tokenizer, single_host = corpus
    ray_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 characters
    env = ray_env(RAY_TMPDIR=ray_dir)
    out = tmp_path / "out"
    driver = run_cli(text, tokenizer, out, "--engine", "ray", "--workers", "2", env=env, wait=False)
    while len(list((out / ".tokenize").glob("part-*.json")) if (out / ".tokenize").exists() else []) < 2:
        assert driver.poll() is None, "tokenize ended before it was killed"
        time.sleep(0.01)
    driver.kill()
    driver.wait()
    assert not (out / "mix.txt").exists()
    run_cli(text, tokenizer, out, "--engine", "ray", "--workers", "2", env=env)
    assert_same_bytes(out, single_host)
    # The Ray the command started is stopped: no process left names its directory (Ray's agents, whose command
    # lines do not, leave by themselves once their raylet is gone).
    left = subprocess.run(["pgrep", "-f", ray_dir], capture_output=True, text=True).stdout.split()
    shutil.rmtree(ray_dir)
    assert left == []
