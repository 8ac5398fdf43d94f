"""Runs on Cloud TPU pods and Kubernetes: the command or manifest that starts `olmax train` on every host.

TPU pod: `gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...` runs the same command on every
worker VM of the slice (https://cloud.google.com/tpu/docs/jax-pods); each worker installs olmax and starts
`olmax train`, which joins the others through JAX's TPU detection (the VM metadata).

Kubernetes: a JobSet (jobset.x-k8s.io/v1alpha2, what XPK submits) of one replicated Job with a pod per host.
On a GKE TPU slice, GKE places the pods by the nodeSelector's accelerator and topology labels and gives
each its TPU_WORKER_* variables, from which JAX's detection joins them. On GPU nodes each pod is told its
place by OLMAX_* variables: the Job's completion index, and the first pod's DNS name (JobSet gives every pod
a hostname under a headless service named after the JobSet). A pod that exits 2 (bad input) fails the
JobSet for good; any other failure (a crash, or a preemption: SIGTERM, checkpoint, exit 75) restarts every
pod, up to maxRestarts times, and the run resumes from its latest checkpoint.
"""

from __future__ import annotations

import re
import shlex

from olmax.config import ConfigError, RunConfig
from olmax.errors import NOT_RETRIED
from olmax.launch.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

# GKE node labels of TPU slices (cloud.google.com/gke-tpu-accelerator) and chips per TPU VM of a multi-host slice.
GKE_TPUS = {"v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice", "v6e": "tpu-v6e-slice"}
TPU_CHIPS_PER_HOST = 4
# GKE node labels of GPUs (cloud.google.com/gke-accelerator).
GKE_GPUS = {"h100": "nvidia-h100-80gb", "h200": "nvidia-h200-141gb"}
COORDINATOR_PORT = 8476
CONTAINER = "olmax"


def tpu_pod_command(name: str, zone: str, config: str, overrides: list[str], *, project: str | None = None,
                    install: str = "olmax[aot]") -> list[str]:
    """The gcloud command that installs olmax on every worker of TPU VM `name` and starts the run there."""
    train = shlex.join(["python3", "-m", "olmax.cli", "train", config, *overrides])
    remote = f"python3 -m pip install -q {shlex.quote(install)} && {train}"
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, f"--zone={zone}",
            *([f"--project={project}"] if project else []), "--worker=all", "--command", remote]


def shell_line(argv: list[str]) -> str:
    """`argv` as a shell line, double-quoting what needs quotes where that is enough (easier to read than
    shlex's nested single quotes)."""
    def word(arg: str) -> str:
        if shlex.quote(arg) == arg:
            return arg
        return f'"{arg}"' if not any(c in arg for c in '"$`\\!') else shlex.quote(arg)
    return " ".join(word(arg) for arg in argv)


def k8s_name(text: str) -> str:
    """A DNS-1035 label (lowercase letters, digits, '-'; starts with a letter), as Kubernetes names must be."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name if name[:1].isalpha() else f"run-{name}"


def jobset(cfg: RunConfig, config: str, overrides: list[str], *, image: str, platform: str, kind: str,
           topology: str, chips: int, max_restarts: int) -> dict:
    """The JobSet running `olmax train config overrides` on a TPU slice (platform "tpu", libtpu's topology) or
    on GPU hosts (platform "gpu", `chips` GPUs, 8 a host)."""
    name = k8s_name(cfg.name)
    if platform == "tpu":
        if kind not in GKE_TPUS:
            raise ConfigError(f"no GKE TPU node label known for {kind!r}; one of {sorted(GKE_TPUS)}")
        per_host = min(chips, TPU_CHIPS_PER_HOST)
        resource = "google.com/tpu"
        node_selector = {"cloud.google.com/gke-tpu-accelerator": GKE_TPUS[kind],
                         "cloud.google.com/gke-tpu-topology": topology}
    else:
        if kind not in GKE_GPUS:
            raise ConfigError(f"no GKE GPU node label known for {kind!r}; one of {sorted(GKE_GPUS)}")
        per_host = int(topology.split("x")[-1])
        resource = "nvidia.com/gpu"
        node_selector = {"cloud.google.com/gke-accelerator": GKE_GPUS[kind]}
    hosts = chips // per_host
    container = {
        "name": CONTAINER,
        "image": image,
        "command": ["olmax", "train", config, *overrides],
        "resources": {"requests": {resource: per_host}, "limits": {resource: per_host}},
    }
    if platform == "gpu" and hosts > 1:
        completion_index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        container["env"] = [
            # JobSet's pod hostnames: JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX, under the subdomain JOBSET.
            {"name": ENV_COORDINATOR, "value": f"{name}-slice-0-0.{name}:{COORDINATOR_PORT}"},
            {"name": ENV_NUM_PROCESSES, "value": str(hosts)},
            {"name": ENV_PROCESS_ID, "valueFrom": {"fieldRef": {"fieldPath": completion_index}}},
        ]
    pod = {"restartPolicy": "Never", "nodeSelector": node_selector, "containers": [container]}
    if platform == "tpu":
        pod |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}  # as XPK runs TPU slices
    job = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,  # a failed pod fails the Job; the JobSet then restarts all of them together
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
            "containerName": CONTAINER, "operator": "In", "values": list(NOT_RETRIED)}}]},
        "template": {"spec": pod},
    }
    metadata = {"name": name}
    if platform == "tpu":  # one JobSet per slice (node pool)
        metadata["annotations"] = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {
                "maxRestarts": max_restarts,
                # Bad input: retrying cannot help.
                "rules": [{"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": job}}],
        },
    }
