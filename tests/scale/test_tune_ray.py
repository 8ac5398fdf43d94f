"""`olmax tune --engine ray` on a real Ray cluster on this machine: a head and two worker nodes started with `ray
start` (the tests' own ports, directories and token: tests/ray_cluster.py), and moto's S3 server on 127.0.0.1. The
search's table is `--jobs 1`'s with a worker node killed in the middle of it; a candidate whose worker is killed
twice is reported lost; a compile cache in the bucket is shared by the nodes; Ctrl-C stops the search at once and
keeps the compiles finished; a node without the target's extra refuses the search, one line. Every driver runs in
a process of its own, as the tokenize tests' do (a process that drove Ray keeps some of it after ray.shutdown)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
from ray_cluster import Node, kill_tasks, ray_env

from olmax import storage
from olmax.cli import main
from olmax.launch.supervisor import free_port
from olmax.scale.targets import aot_missing
from olmax.scale.tune_ray import TASK_NAME

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))]
TUNE = ["tune", "tiny", "--target", "tpu:v5p:2x2x2"]
TASK = f"ray::{TASK_NAME}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with a bucket `compiles`: the variables that point S3's clients at it."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=out)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, log.read_text()[-2000:]
                time.sleep(0.05)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="compiles")
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(s3):
    """A head and two worker nodes of 1 CPU each, which reach the S3 server: (the nodes, their environment)."""
    env, nodes = ray_env(**s3), []
    try:
        nodes.append(Node(env, "127.0.0.1", cpus=1))
        with ThreadPoolExecutor(2) as pool:  # the workers start side by side
            starting = [pool.submit(Node, env, "127.0.0.1", 1, nodes[0].address) for _ in range(2)]
        nodes += [node.result() for node in starting if node.exception() is None]
        for node in starting:
            node.result()  # a node that failed to start fails the tests, once those that started are to be stopped
        yield nodes, env
    finally:
        for node in reversed(nodes):
            node.stop()


def driver(nodes, env, *argv, wait=True):
    command = [sys.executable, "-m", "olmax.cli", *TUNE, *argv, "--engine", "ray", "--address", nodes[0].address]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True)


def table(stdout: str) -> str:
    """The ranked table of tune's output (the lines before its coverage line)."""
    return stdout.split("\nsearched ")[0]


def node_id(node: Node) -> str:
    """The Ray node id of a node started here (its session directory's port files are named by it)."""
    return next(Path(node.temp_dir).glob("session_latest/runtime_env_agent_port_*")).name.rsplit("_", 1)[1]


def test_a_node_without_the_targets_extra_refuses_the_search_in_one_line(cluster, tmp_path):
    """A node joins whose Python lacks libtpu (the aot extra): the search is refused before it starts, one line
    naming that node and the extra, not a failed compile on it for each candidate Ray gives it."""
    nodes, env = cluster
    (tmp_path / "sitecustomize.py").write_text("import sys\n\nsys.modules['libtpu'] = None  # as if not installed\n")
    bare = Node({**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}, "127.0.0.1", cpus=1,
                head=nodes[0].address)
    named = node_id(bare)[:8]
    try:
        done = driver(nodes, env, "--budget", "6")
    finally:
        bare.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("olmax: ConfigError: node ") and line.endswith(
        f" ({named}) cannot compile for tpu:v5p:2x2x2: compiling for TPU needs the aot extra (libtpu is not "
        "installed): pip install -e '.[aot]'"), line
    assert done.stdout == ""


def test_a_candidate_lost_twice_is_a_row_and_ctrl_c_keeps_the_compiles_in_a_bucket(cluster, s3, monkeypatch):
    """One search, OLMAX_COMPILE_CACHE=s3://...: a candidate's worker is killed, and its rerun's on the other node
    too: the candidate is a row of the search, lost, and the search goes on. The nodes keep their compiles in the
    bucket. Ctrl-C once a row fits and the lost row is the search's, with a compile running: the search stops at
    once (exit 130, one line), the compiles under way end with it (Ray ends a driver's tasks), and the bucket holds
    the whole entry of each compile that finished. Cost: a search on the Ray cluster until then."""
    nodes, env = cluster
    alive = [n for n in nodes if n.process.poll() is None]
    killed = kill_tasks(alive, times=1, name=TASK), kill_tasks(alive, times=1, name=f"{TASK}-again")
    running = driver(alive, {**env, "OLMAX_COMPILE_CACHE": "s3://compiles/cache"}, "--budget", "12", wait=False)
    # a budget the search cannot finish before the interrupt (its compiles run ahead of it on 3 slots): 12 of tiny's
    said, fitted, lost = [], False, False
    for line in running.stderr:  # a row that fits and the row lost (in either order)
        said.append(line)
        fitted |= bool(re.match(r"olmax tune: \[\d+/12\] .*: fits", line))
        lost |= bool(re.match(r"olmax tune: \[\d+/12\] .*: lost, its worker was lost 2 times \(WorkerCrashedError "
                              r"on node", line))  # a row of the search (not a compile run ahead of it)
        if fitted and lost:
            break
    while not any(line.startswith(TASK) for node in alive for line in node.processes().values()):
        assert running.poll() is None, running.communicate()
        time.sleep(0.01)
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=300)
    err = "".join(said) + err
    assert running.returncode == 130 and out == "", err[-3000:]
    assert err.splitlines()[-1] == "olmax tune: stopping (SIGINT)", err[-3000:]
    assert [len(k) for k in killed] == [1, 1]
    assert "compiling it again on another node" in err and "reported lost" in err, err[-3000:]
    # each layout compiled that fits, once (one compiled ahead of the search is said again as its row)
    fits = len(set(re.findall(r"olmax tune: (?:\[\d+/12\]|compiled ahead of the search:) (.*): fits", err)))
    while any(line.startswith(TASK) for node in alive for line in node.processes().values()):
        time.sleep(0.01)  # the compiles under way end (their driver gone)
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    entries = storage.listdir("s3://compiles/cache")
    assert len(entries) >= fits > 0 and all(
        storage.listdir(f"s3://compiles/cache/{e}") == ["program.hlo.gz", "result.json"] for e in entries)


def test_the_table_is_that_of_jobs_1_on_three_processes_and_on_ray_with_a_worker_node_killed(cluster, capsys):
    """`--budget 6` with three compiles at a time, the search's next compiles started ahead of it, gives the table
    `--jobs 1` prints, compile for compile: `--jobs 3` on this host (which took batches of three from one state of the
    search, and so compiled another candidate here), and `--engine ray` on the head and two worker nodes, a compile
    at a time each, a worker node running a compile killed (its raylet and every process of it): the compile is run
    again on another node. (Last: it leaves the cluster one worker node.)
    Cost: three searches of 6 compiles (--jobs 1, --jobs 3, Ray with a node killed): the tables compared need each
    compile's figures."""
    nodes, env = cluster
    assert main([*TUNE, "--budget", "6", "--jobs", "1"]) == 0
    expected = table(capsys.readouterr().out)
    assert main([*TUNE, "--budget", "6", "--jobs", "3"]) == 0
    assert table(capsys.readouterr().out) == expected
    running = driver(nodes, env, "--budget", "6", wait=False)
    victim = None
    while victim is None:
        assert running.poll() is None, running.communicate()
        victim = next((n for n in nodes[1:] if any(line.startswith(TASK) for line in n.processes().values())), None)
        time.sleep(0.01)
    lost = node_id(victim)[:8]
    victim.stop()
    out, err = running.communicate(timeout=600)
    assert running.returncode == 0, err[-3000:]
    # (the node is named where the task had said where it runs before its node was killed)
    assert "compiling it again on another node" in err and (f"({lost}) " in err or "on its node" in err), err[-3000:]
    assert "reported lost" not in err
    assert table(out) == expected and expected.count("\n") == 6


@pytest.mark.parametrize("argv, message", [
    (["--address", "HEAD:6379"], "ConfigError: --address names a Ray cluster: give it with --engine ray"),
    (["--engine", "ray", "--address", "HEAD:6379", "--jobs", "2"], "ConfigError: --jobs sets the CPUs of a local Ray"),
    (["--engine", "ray", "--address", "garbage"], "ClusterError: --address garbage: not a Ray cluster's address "
                                                  "(Invalid address format: garbage); give the address of its head"),
])
def test_ray_options_that_cannot_be_used_are_one_line_before_any_compile(argv, message, capsys):
    assert main([*TUNE, "--budget", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"olmax: {message}") and err.count("\n") == 1, err
