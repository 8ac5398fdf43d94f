"""`olmax tokenize --engine ray` on a two-node Ray cluster: Ray's head in one network namespace, a worker node in
the other (tests/launch/netns_cluster.py), the inputs and the output in a bucket (moto's S3 server on the bridge,
which both nodes reach): the nodes share nothing the job reads or writes. Every process of the worker node is
killed while it runs a task; the job ends on the head node alone, with the single-host path's bytes."""

import json
import subprocess
import sys
import time

import boto3
import pytest
from netns_cluster import RAY_NETWORK, kill_namespace, on_node, start_moto, two_node_network
from ray_cluster import Node, ray_env
from testlib import write_text_corpus

from olmax import storage
from olmax.data.tokenize import tokenize_corpus, train_tokenizer

HEAD, WORKER = RAY_NETWORK.nodes  # olmaxray1, olmaxray2


@pytest.mark.slow
def test_a_two_node_ray_cluster_survives_its_worker_node_and_writes_the_single_host_bytes(tmp_path, monkeypatch):
    paths = write_text_corpus(tmp_path / "text", files=16, lines=250)
    tokenizer = train_tokenizer([str(paths[0])], tmp_path / "tokenizer.json", vocab_size=400, progress=False)
    local = tokenize_corpus([str(tmp_path / "text")], tmp_path / "single-host", tokenizer_path=tokenizer,
                            shard_tokens=40000, label="web", workers=0, progress=False)
    with two_node_network(RAY_NETWORK):
        moto, url = start_moto(tmp_path, RAY_NETWORK.controller[1])
        s3 = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
              "AWS_DEFAULT_REGION": "us-east-1"}
        nodes = []
        try:
            for key, value in s3.items():  # this process's uploads and reads
                monkeypatch.setenv(key, value)
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket="corpus")
            storage.upload(tmp_path / "text", "s3://corpus/text")
            env = ray_env(**s3)
            nodes.append(Node(env, RAY_NETWORK.nodes[HEAD], cpus=1, wrap=lambda argv: on_node(HEAD, argv)))
            nodes.append(Node(env, RAY_NETWORK.nodes[WORKER], cpus=1, head=nodes[0].address,
                              wrap=lambda argv: on_node(WORKER, argv)))
            argv = ["tokenize", "s3://corpus/text", "--tokenizer", tokenizer, "--out", "s3://corpus/shards",
                    "--shard-tokens", "40000", "--label", "web", "--engine", "ray", "--address", nodes[0].address,
                    "--quiet"]
            driver = subprocess.Popen(on_node(HEAD, [sys.executable, "-m", "olmax.cli", *argv]), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 300
            while not any(line.startswith("ray::_tokenize_task") for line in nodes[1].processes().values()):
                assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
                time.sleep(0.01)
            killed = kill_namespace(WORKER)  # the worker node dies: its raylet, its workers, its task
            stdout, stderr = driver.communicate(timeout=600)
            assert driver.returncode == 0, stderr[-3000:]
            names = [storage.basename(p) for p in local.shards]
            files = [*names, *(n.replace(".npy", ".docs.npz") for n in names), "mix.txt", "shards.json"]
            assert storage.listdir("s3://corpus/shards") == sorted([*files, "tokenize.json"])
            for name in files:
                assert storage.read_bytes(f"s3://corpus/shards/{name}") == (tmp_path / "single-host" / name).read_bytes()
            record = json.loads(storage.read_text("s3://corpus/shards/tokenize.json"))
            expected = json.loads((tmp_path / "single-host" / "tokenize.json").read_text())
            assert record == {**expected, "inputs": [f"s3://corpus/text/{p.name}" for p in paths], "engine": "ray"}
            print(f"\ntwo Ray nodes ({', '.join(f'{n} {a}' for n, a in RAY_NETWORK.nodes.items())}), S3 on "
                  f"{url}: {len(killed)} processes of {WORKER} killed while it ran a task; {len(names)} shards in "
                  "the bucket, the single-host bytes")
        finally:
            for node in nodes:
                node.stop()
            moto.terminate()
            moto.wait(timeout=30)
