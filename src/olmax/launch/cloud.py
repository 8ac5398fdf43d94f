"""Runs on Cloud TPU pods and Kubernetes: the command or manifest that starts `olmax train` on every host.

TPU pod: `gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...` runs the same command on every
worker VM of the slice (https://cloud.google.com/tpu/docs/jax-pods); each worker installs olmax (a wheel
copied there first with `gcloud ... scp`, or a pip requirement it can fetch) and starts `olmax train`
detached from the ssh session (setsid, nohup; its output in ~/olmax-train.log), so that a closed terminal
does not end the run; the workers join through JAX's TPU detection (the VM metadata).

Kubernetes: a JobSet (jobset.x-k8s.io/v1alpha2, what XPK submits) of one replicated Job with a pod per host.
On a GKE TPU slice, GKE places the pods by the nodeSelector's accelerator and topology labels and gives
each its TPU_WORKER_* variables, from which JAX's detection joins them. On GPU nodes each pod is told its
place by OLMAX_* variables: the Job's completion index, and the first pod's DNS name (JobSet gives every pod
a hostname under a headless service named after the JobSet), and gets a memory-backed /dev/shm. A pod that
exits 2, 3 or 74 (bad input, divergence, a full disk: what `olmax launch` does not retry either) fails the
JobSet for good; any other failure (a crash, or a preemption: SIGTERM, checkpoint, exit 75) restarts every
pod, up to maxRestarts times, and the run resumes from its latest checkpoint. Pods get
`terminationGracePeriodSeconds` between SIGTERM and SIGKILL to write that checkpoint.

Both are started once: the cluster runs them (`Launcher.follow` has nothing to follow), their records go
to runs/NAME here (or launch.records_dir), the run directory being the hosts' path.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

from olmax.config import RunConfig
from olmax.errors import NOT_RETRIED, ConfigError
from olmax.launch import values
from olmax.launch.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from olmax.launch.launcher import Launcher
from olmax.run_dir import RunDir, replace_own

# GKE node labels of TPU slices (cloud.google.com/gke-tpu-accelerator) and chips per TPU VM of a multi-host slice.
GKE_TPUS = {"v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice", "v6e": "tpu-v6e-slice"}
TPU_CHIPS_PER_HOST = 4
# GKE node labels of GPUs (cloud.google.com/gke-accelerator).
GKE_GPUS = {"h100": "nvidia-h100-80gb", "h200": "nvidia-h200-141gb"}
COORDINATOR_PORT = 8476
CONTAINER = "olmax"
REPLICATED_JOB = "slice"
# Between SIGTERM and SIGKILL: a 7B's checkpoint (about 100 GB with Adam's moments) written to a bucket.
GRACE_SECONDS = 600
TRAIN_LOG = "olmax-train.log"  # in each worker's home directory


def tpu_pod_commands(name: str, zone: str, config: str, overrides: list[str], *, project: str | None = None,
                     wheel: str | None = None, install: str | None = None) -> list[list[str]]:
    """The gcloud commands that install olmax on every worker of TPU VM `name` (`wheel`, a file here copied to
    each worker, or `install`, a pip requirement each can fetch) and start the run there, detached."""
    where = [f"--zone={values.plain('--zone', zone)}",
             *([f"--project={values.plain('--project', project)}"] if project else []), "--worker=all"]
    vm = values.plain("TPU VM name", name)
    commands = []
    if wheel is not None:
        wheel_name = values.plain("--wheel", Path(wheel).name)
        commands.append(["gcloud", "compute", "tpus", "tpu-vm", "scp", wheel, f"{vm}:{wheel_name}", *where])
        install = f"./{wheel_name}[aot]"  # JAX with libtpu, as on the workers' chips
    train = shlex.join(["python3", "-m", "olmax.cli", "train", config, *overrides])
    remote = (f"python3 -m pip install -q {shlex.quote(install)} && "
              f"(setsid nohup {train} > {TRAIN_LOG} 2>&1 < /dev/null &) && "
              f'echo "olmax: training on $(hostname); output in ~/{TRAIN_LOG}"')
    commands.append(["gcloud", "compute", "tpus", "tpu-vm", "ssh", vm, *where, "--command", remote])
    return commands


def shell_line(argv: list[str]) -> str:
    """`argv` as a shell line, double-quoting what needs quotes where that is enough (easier to read than
    shlex's nested single quotes)."""
    def word(arg: str) -> str:
        if shlex.quote(arg) == arg:
            return arg
        return f'"{arg}"' if not any(c in arg for c in '"$`\\!') else shlex.quote(arg)
    return " ".join(word(arg) for arg in argv)


def jobset(cfg: RunConfig, config: str, overrides: list[str], *, image: str, platform: str, kind: str,
           topology: str, chips: int, max_restarts: int, grace_seconds: int = GRACE_SECONDS) -> dict:
    """The JobSet running `olmax train config overrides` on a TPU slice (platform "tpu", libtpu's topology) or
    on GPU hosts (platform "gpu", `chips` GPUs, 8 a host)."""
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
    # Pods are named JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX, a DNS label too.
    name = values.k8s_name(cfg.name, room=len(f"-{REPLICATED_JOB}-0-{hosts - 1}"))
    container = {
        "name": CONTAINER,
        "image": values.plain("--image", image),
        "command": ["olmax", "train", config, *overrides],
        "resources": {"requests": {resource: per_host}, "limits": {resource: per_host}},
    }
    if platform == "gpu" and hosts > 1:
        completion_index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        container["env"] = [
            # JobSet's pod hostnames: JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX, under the subdomain JOBSET.
            {"name": ENV_COORDINATOR, "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{COORDINATOR_PORT}"},
            {"name": ENV_NUM_PROCESSES, "value": str(hosts)},
            {"name": ENV_PROCESS_ID, "valueFrom": {"fieldRef": {"fieldPath": completion_index}}},
        ]
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace_seconds, "nodeSelector": node_selector,
           "containers": [container]}
    if platform == "tpu":
        pod |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}  # as XPK runs TPU slices
    else:  # NCCL and the data loader share memory through /dev/shm, 64 MiB in a container by default
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
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
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


class TpuPodLauncher(Launcher):
    """`olmax launch tpu-pod`: the run started on every worker of a TPU VM, once."""

    mode = "tpu-pod"
    run_dir_is_here = False

    def __init__(self, config: str, overrides: list[str] = (), *, vm: str, zone: str | None, project: str | None,
                 wheel: str | None, install: str | None, **launcher):
        super().__init__(config, overrides, **launcher)  # a bad config fails here, not on every worker
        if not zone:
            raise ConfigError("olmax launch tpu-pod: give the TPU VM's zone with --zone")
        if (wheel is None) == (install is None):
            raise ConfigError("olmax launch tpu-pod: give --wheel WHEEL (an olmax wheel here, built from this "
                              "source with `python -m pip wheel --no-deps -w dist .`) or --install SPEC (a pip "
                              "requirement every worker can fetch: a wheel's URL, git+https://...@COMMIT)")
        if wheel is not None and not (wheel.endswith(".whl") and Path(wheel).is_file()):
            raise ConfigError(f"olmax launch tpu-pod: --wheel {wheel} is not a wheel (a .whl file) here")
        self.commands = tpu_pod_commands(vm, zone, config, self.overrides, project=project, wheel=wheel,
                                         install=install)

    def render(self) -> str:
        return "".join(shell_line(command) + "\n" for command in self.commands)

    def submit(self) -> int:
        if shutil.which("gcloud") is None:
            raise ConfigError("olmax launch tpu-pod: gcloud is not on PATH; install the Google Cloud CLI")
        for command in self.commands:
            self.echo(f"olmax launch: {shell_line(command)}")
            if code := subprocess.run(command).returncode:
                return code
        return 0

    def follow(self, code: int) -> tuple[int, float]:
        return code, 0.0


class K8sLauncher(Launcher):
    """`olmax launch k8s`: the JobSet written here, for `kubectl apply`."""

    mode = "k8s"
    run_dir_is_here = False

    def __init__(self, config: str, overrides: list[str] = (), *, target, image: str,
                 grace_seconds: int = GRACE_SECONDS, **launcher):
        """`target`: the slice (olmax.scale.targets.Target: name, platform, kind, topology, chips)."""
        super().__init__(config, overrides, target=target.name, **launcher)
        self.manifest = jobset(self.cfg, config, self.overrides, image=image, platform=target.platform,
                               kind=target.kind, topology=target.topology, chips=target.chips,
                               max_restarts=self.policy.max_retries, grace_seconds=grace_seconds)

    def render(self) -> str:
        return yaml.safe_dump(self.manifest, sort_keys=False)

    def path_warning(self, field: str, path: str) -> str | None:
        if field == "output_dir" and not Path(path).is_absolute():
            raise ConfigError(f"output_dir {path} is relative: the pods would write the run inside their containers, "
                              "lost with them; give a bucket URL (gs://..., s3://...) or an absolute path on a volume "
                              "you mount in the JobSet")
        return (f"{field} {path} is a path in the pods, and the JobSet mounts no volume: add one holding it to "
                "jobset.yaml (GCS FUSE, Filestore), or give a bucket URL")

    def submit(self) -> int:
        path = RunDir(self.records).jobset
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_own(path, self.render())
        path = path.resolve()
        print(f"wrote {path}; start the run with: kubectl apply -f {path}")
        return 0

    def follow(self, code: int) -> tuple[int, float]:
        return code, 0.0
