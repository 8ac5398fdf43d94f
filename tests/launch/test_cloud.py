"""`olmax launch --tpu-pod` and `--k8s` for olmo3_7b on a v5p-128 slice (64 chips, 4x4x4: 16 TPU VMs of 4 chips),
checked field by field against gcloud's and the JobSet/Job APIs' documented formats. No cloud is reachable here."""

import shlex

import pytest
import yaml

from olmax.cli import main

OVERRIDES = ["data.mix_file=/mnt/data/OLMo-mix-0925.txt", "output_dir=/mnt/runs/olmo3_7b"]


def test_tpu_pod_command_installs_and_trains_on_every_worker(capsys):
    assert main(["launch", "--tpu-pod", "olmo-v5p-128", "--zone", "us-east5-a", "--project", "my-project",
                 "olmo3_7b", *OVERRIDES]) == 0
    line = capsys.readouterr().out.strip()
    argv = shlex.split(line)  # the printed line is one shell command
    assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    assert argv[5] == "olmo-v5p-128"
    assert argv[6:9] == ["--zone=us-east5-a", "--project=my-project", "--worker=all"]
    assert argv[9] == "--command"
    install, train = argv[10].split(" && ")
    assert shlex.split(install) == ["python3", "-m", "pip", "install", "-q", "olmax[aot]"]
    assert shlex.split(train) == ["python3", "-m", "olmax.cli", "train", "olmo3_7b", *OVERRIDES]
    assert len(argv) == 11


def test_tpu_pod_trains_into_a_bucket_and_writes_nothing_here(tmp_path, capsys, monkeypatch):
    """Every worker's `olmax train` writes the bucket run directory (each process its own shards)."""
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--tpu-pod", "pod", "--zone", "z", "olmo3_7b", "output_dir=gs://runs/olmo3_7b"]) == 0
    train = shlex.split(capsys.readouterr().out)[-1].split(" && ")[1]
    assert shlex.split(train)[-1] == "output_dir=gs://runs/olmo3_7b"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, says", [
    (["--tpu-pod", "x", "olmo3_7b"], "--zone"),
    (["--tpu-pod", "x", "--zone", "z", "olmo3_7b", "train.steps=0"], "train.steps"),
    (["--k8s", "--image", "i", "olmo3_7b"], "--target"),
    (["--k8s", "--image", "i", "--target", "tpu:v4:2x2x2", "olmo3_7b"], "unknown TPU 'v4'"),
    (["--k8s", "--slurm", "olmo3_7b"], "choose one"),
])
def test_bad_cloud_launches_exit_2_with_one_line(tmp_path, capsys, argv, says):
    assert main(["launch", *argv, f"output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("olmax: ")
    assert not (tmp_path / "run").exists()


def _manifest(tmp_path, capsys, target):
    assert main(["launch", "--k8s", "--target", target, "--image", "us-docker.pkg.dev/my-project/olmax:0.1.0",
                 "--max-retries", "10", "olmo3_7b", "data.mix_file=/mnt/data/OLMo-mix-0925.txt",
                 f"output_dir={tmp_path}/run"]) == 0
    path = tmp_path / "run" / "jobset.yaml"
    assert capsys.readouterr().out.strip() == f"wrote {path}; start the run with: kubectl apply -f {path}"
    return yaml.safe_load(path.read_text())


def test_jobset_for_a_v5p_128_slice(tmp_path, capsys):
    m = _manifest(tmp_path, capsys, "tpu:v5p:4x4x4")
    assert (m["apiVersion"], m["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert m["metadata"] == {"name": "olmo3-7b-stage1", "annotations": {
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
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    [container] = pod["containers"]
    assert container == {
        "name": "olmax", "image": "us-docker.pkg.dev/my-project/olmax:0.1.0",
        "command": ["olmax", "train", "olmo3_7b", "data.mix_file=/mnt/data/OLMo-mix-0925.txt",
                    f"output_dir={tmp_path}/run"],
        "resources": {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}},
    }  # no OLMAX_* variables: the pods join through JAX's GKE TPU detection


def test_jobset_for_two_gpu_hosts_tells_each_pod_its_place(tmp_path, capsys):
    m = _manifest(tmp_path, capsys, "gpu:h100x16")
    assert "annotations" not in m["metadata"]
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"]) == (2, 2)
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert container["env"] == [
        {"name": "OLMAX_COORDINATOR", "value": "olmo3-7b-stage1-slice-0-0.olmo3-7b-stage1:8476"},
        {"name": "OLMAX_NUM_PROCESSES", "value": "2"},
        {"name": "OLMAX_PROCESS_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
    ]
