"""`olmax launch tpu-pod` and `k8s` for olmo3_7b on a v5p-128 slice (64 chips, 4x4x4: 16 TPU VMs of 4 chips),
checked field by field against gcloud's and the JobSet/Job APIs' documented formats. No cloud is reachable here."""

import pathlib
import shlex
import textwrap

import pytest
import yaml
from testlib import docs

from olmax.cli import main

OVERRIDES = ["data.mix_file=/mnt/data/OLMo-mix-0925.txt", "output_dir=/mnt/runs/olmo3_7b"]


INSTALL = "olmax[aot] @ git+https://github.com/example/olmax@0123abc"


def _tpu_pod(capsys, *argv):
    assert main(["launch", "tpu-pod", *argv, "--dry-run"]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines()]  # each printed line is one command


def test_tpu_pod_command_installs_and_trains_on_every_worker_detached(capsys):
    [argv] = _tpu_pod(capsys, "olmo-v5p-128", "--zone", "us-east5-a", "--project", "my-project", "--install", INSTALL,
                      "olmo3_7b", *OVERRIDES)
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    assert argv[5] == "olmo-v5p-128"
    assert argv[6:9] == ["--zone=us-east5-a", "--project=my-project", "--worker=all"]
    assert argv[9] == "--command"
    install, train, said = argv[10].split(" && ")
    assert shlex.split(install) == ["python3", "-m", "pip", "install", "-q", INSTALL]
    # detached from the ssh session: its own session, no terminal, output in a file
    assert shlex.split(train.removeprefix("(").removesuffix(" &)")) == [
        "setsid", "nohup", "python3", "-m", "olmax.cli", "train", "olmo3_7b", *OVERRIDES, ">", "olmax-train.log",
        "2>&1", "<", "/dev/null"]
    assert said.startswith("echo ")
    assert len(argv) == 11


def test_tpu_pod_copies_a_wheel_to_every_worker_and_installs_it(tmp_path, capsys):
    wheel = tmp_path / "olmax-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    scp, ssh = _tpu_pod(capsys, "pod", "--zone", "z", "--wheel", str(wheel), "olmo3_7b")
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(wheel), "pod:olmax-0.1.0-py3-none-any.whl",
                   "--zone=z", "--worker=all"]
    assert shlex.split(ssh[-1].split(" && ")[0]) == ["python3", "-m", "pip", "install", "-q",
                                                      "./olmax-0.1.0-py3-none-any.whl[aot]"]


def test_tpu_pod_trains_into_a_bucket_and_writes_nothing_here(tmp_path, capsys, monkeypatch):
    """Every worker's `olmax train` writes the bucket run directory (each process its own shards)."""
    monkeypatch.chdir(tmp_path)
    [argv] = _tpu_pod(capsys, "pod", "--zone", "z", "--install", INSTALL, "olmo3_7b", "output_dir=gs://runs/olmo3_7b")
    train = argv[-1].split(" && ")[1]
    assert "output_dir=gs://runs/olmo3_7b" in shlex.split(train)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, says", [
    (["tpu-pod", "x", "olmo3_7b", "--install", INSTALL], "--zone"),
    (["tpu-pod", "x", "--zone", "z", "olmo3_7b"], "give --wheel WHEEL"),
    (["tpu-pod", "x", "--zone", "z", "--wheel", "/nonexistent/olmax.whl", "olmo3_7b"], "is not a wheel"),
    (["tpu-pod", "x", "--zone", "z", "--install", INSTALL, "olmo3_7b", "train.steps=0"], "train.steps"),
    (["k8s", "--image", "i", "olmo3_7b"], "--target"),
    (["k8s", "--image", "i", "--target", "tpu:v4:2x2x2", "olmo3_7b"], "unknown TPU 'v4'"),
    (["k8s", "--image", "i", "--target", "gpu:h100x8", "--grace-seconds", "0", "olmo3_7b"], "--grace-seconds"),
    (["--k8s", "--slurm", "olmo3_7b"], "choose one"),
])
def test_bad_cloud_launches_exit_2_with_one_line(tmp_path, capsys, argv, says):
    assert main(["launch", *argv, f"output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("olmax: ")
    assert not (tmp_path / "run").exists()


def _manifest(tmp_path, capsys, target, monkeypatch):
    """The JobSet goes to runs/NAME here (the records), not into output_dir: that is the pods' path."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "k8s", "--target", target, "--image", "us-docker.pkg.dev/my-project/olmax:0.1.0",
            "--max-retries", "10", "olmo3_7b", "data.mix_file=/mnt/data/OLMo-mix-0925.txt", "output_dir=/mnt/runs/7b"]
    assert main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    assert main(argv) == 0
    path = tmp_path / "runs" / "olmo3_7b_stage1" / "jobset.yaml"
    assert capsys.readouterr().out.strip() == f"wrote {path}; start the run with: kubectl apply -f {path}"
    assert path.read_text() == printed
    assert not pathlib.Path("/mnt/runs/7b").exists()
    return yaml.safe_load(printed)


def test_jobset_for_a_v5p_128_slice(tmp_path, capsys, monkeypatch):
    m = _manifest(tmp_path, capsys, "tpu:v5p:4x4x4", monkeypatch)
    assert (m["apiVersion"], m["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert m["metadata"] == {"name": "olmo3-7b-stage1-dff40122", "annotations": {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 10, "rules": [
        {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    [replicated] = m["spec"]["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("slice", 1)
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (16, 16, "Indexed", 0)
    assert job["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": "olmax", "operator": "In", "values": [2, 3, 74]}}]}
    pod = job["template"]["spec"]
    assert (pod["restartPolicy"], pod["terminationGracePeriodSeconds"]) == ("Never", 600)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    [container] = pod["containers"]
    assert container == {
        "name": "olmax", "image": "us-docker.pkg.dev/my-project/olmax:0.1.0",
        "command": ["olmax", "train", "olmo3_7b", "data.mix_file=/mnt/data/OLMo-mix-0925.txt",
                    "output_dir=/mnt/runs/7b"],
        "resources": {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}},
    }  # no OLMAX_* variables: the pods join through JAX's GKE TPU detection


def test_jobset_for_two_gpu_hosts_tells_each_pod_its_place(tmp_path, capsys, monkeypatch):
    m = _manifest(tmp_path, capsys, "gpu:h100x16", monkeypatch)
    assert "annotations" not in m["metadata"]
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"]) == (2, 2)
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert container["env"] == [
        {"name": "OLMAX_COORDINATOR", "value": "olmo3-7b-stage1-dff40122-slice-0-0.olmo3-7b-stage1-dff40122:8476"},
        {"name": "OLMAX_NUM_PROCESSES", "value": "2"},
        {"name": "OLMAX_PROCESS_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
    ]


def test_the_docs_jobset_is_the_one_olmax_writes(capsys):
    """docs/clusters.md shows the manifest for olmo3_7b on a v5p-128, failure policy and all, as `--dry-run` prints
    it."""
    shown = docs("clusters.md").split("    ```yaml\n", 1)[1].split("    ```\n", 1)[0]
    assert main(["launch", "k8s", "--target", "tpu:v5p:4x4x4", "--image", "us-docker.pkg.dev/my-project/olmax/olmax:0.1.0",
                 "olmo3_7b", "data.mix_file=/mnt/data/OLMo-mix-0925.txt", "output_dir=/mnt/runs/olmo3_7b",
                 "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(textwrap.dedent(shown)) == yaml.safe_load(printed)
