"""`olmax launch local|slurm|tpu-pod|k8s`: train under a launcher that runs the job until the run is done."""

from __future__ import annotations

import argparse
import math
import sys

from olmax.arguments import config_arguments

MODES = ("local", "slurm", "tpu-pod", "k8s")
CONTRACT = ("After a crash (any exit but 0, 2, 3, 74, 75, or a signal) or a storage outage (exit 69) the run is "
            "restarted after an exponential backoff, after a preemption (exit 75) at once; bad input (exit 2), a divergence (exit 3: the parameters "
            "became NaN/inf) and a full disk (exit 74) are not retried. The trainer resumes from the run's latest "
            "checkpoint. Exit: 0 finished, 2 bad input, 3 diverged, 74 disk full, 75 the launcher was signalled "
            "(SIGTERM/SIGINT are passed on: the run checkpoints and stops), 1 gave up.")
RECORDS = ("Records (launch.jsonl, one line per attempt; job scripts, manifests, Slurm's output) go to "
           "launch.records_dir, else the run directory, else runs/NAME here, or for a run in a bucket its URL "
           "mirrored under runs/ here: runs/s3/BUCKET/PATH.")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="train, restarting after crashes and preemptions until the run reaches its step target",
        description="Runs `olmax train CONFIG OVERRIDES` here (local), as a Slurm batch job (slurm), on every "
        f"worker of a Cloud TPU VM (tpu-pod) or as a Kubernetes JobSet (k8s). {CONTRACT} {RECORDS} "
        "`olmax launch MODE --help` lists each mode's options. The spellings of earlier releases (`olmax launch "
        "CONFIG` for local; --nprocs, --slurm, --tpu-pod NAME, --k8s) still work.",
    )
    modes = p.add_subparsers(dest="launch_mode", required=True, metavar="{local,slurm,tpu-pod,k8s}")

    local = _mode(modes, "local", "processes on this machine, restarted until the run is done",
                  "Runs `olmax train` as child process(es) here and restarts them by the rules below. "
                  f"{CONTRACT} {RECORDS} On CPU, OLMAX_LOCAL_DEVICES=D in the environment gives each process D "
                  "devices.")
    local.add_argument("--nprocs", type=int, default=1, metavar="N",
                       help="processes of one multi-process run (jax.distributed over 127.0.0.1) (default 1)")
    _retries(local, "restarts", first_backoff=10.0)

    slurm = _mode(modes, "slurm", "a Slurm batch job, requeued after preemptions and submitted again after failures",
                  "Writes the batch script (the config's launch.slurm section) to RECORDS/slurm/job.sh, submits it "
                  "with sbatch and watches the job with scontrol: the job requeues itself after a preemption or its "
                  f"time limit (exit 75), and is submitted again after failures. {CONTRACT} {RECORDS}")
    slurm.add_argument("--poll-seconds", type=float, default=30.0, metavar="S",
                       help="how often to ask Slurm about the job (default 30)")
    slurm.add_argument("--status-seconds", type=float, default=600.0, metavar="S",
                       help="say the job's state and the run's last committed step when it changes and every S "
                            "seconds while it does not (default 600)")
    _retries(slurm, "runs of the job", first_backoff=300.0)

    tpu = _mode(modes, "tpu-pod", "the run on every worker of a Cloud TPU VM, started once, detached",
                "Installs olmax on every worker of TPU VM NAME (gcloud compute tpus tpu-vm ssh --worker=all) and "
                "starts `olmax train` there, detached from the ssh session (setsid, nohup; output in "
                "~/olmax-train.log on each worker). After a preemption or a crash, run the same command again: "
                "the run resumes from its latest checkpoint.", ("vm", "the TPU VM (slice) to run on (required)"))
    tpu.add_argument("--zone", help="the TPU VM's zone (required)")
    tpu.add_argument("--project", help="the Google Cloud project (default: gcloud's configured one)")
    tpu.add_argument("--wheel", metavar="FILE",
                     help="an olmax wheel here (`python -m pip wheel --no-deps -w dist .` in the source), copied to "
                          "every worker and installed with its aot extra (no default: this or --install)")
    tpu.add_argument("--install", metavar="SPEC",
                     help="a pip requirement every worker can fetch and install instead: a wheel's URL, "
                          "'olmax[aot] @ git+https://...@COMMIT' (no default: this or --wheel)")

    k8s = _mode(modes, "k8s", "a Kubernetes JobSet for `kubectl apply`",
                "Writes RECORDS/jobset.yaml (RECORDS: launch.records_dir, else runs/NAME here: the run directory "
                "is the pods' path): one pod per host of the slice, restarted together after a crash or a "
                "preemption, failed for good on exit 2, 3 or 74.")
    k8s.add_argument("--target", help="the slice, as olmax compile names it: tpu:v5p:4x4x4, gpu:h100x16 (required)")
    k8s.add_argument("--image", help="the container image with olmax installed (required)")
    k8s.add_argument("--max-retries", type=int, default=50, metavar="K",
                     help="the JobSet's maxRestarts: restarts of all pods before it fails (default 50)")
    k8s.add_argument("--grace-seconds", type=int, default=600, metavar="S",
                     help="terminationGracePeriodSeconds: how long a pod has between SIGTERM and SIGKILL to write "
                          "its checkpoint (default 600)")


def _mode(modes, name: str, summary: str, description: str, *first: tuple[str, str]) -> argparse.ArgumentParser:
    """A mode's parser: its `first` positionals (name, help), the config and overrides, --dry-run."""
    p = modes.add_parser(name, help=summary, description=description)
    for positional, help in first:
        p.add_argument(positional, help=help)
    config_arguments(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run (command, batch script or JobSet) and start nothing (default: off)")
    p.set_defaults(func=run_launch, handles_stop_signals=True)
    return p


def _retries(p: argparse.ArgumentParser, what: str, first_backoff: float) -> None:
    p.add_argument("--retry-backoff", type=float, default=first_backoff, metavar="S",
                   help=f"seconds before the first restart after a failure (default {first_backoff:g}); an attempt "
                        "that wrote a checkpoint starts the count again")
    p.add_argument("--backoff-factor", type=float, default=2.0, metavar="F",
                   help="each further failure in a row waits F times longer (default 2)")
    p.add_argument("--backoff-max", type=float, default=3600.0, metavar="S",
                   help="the longest wait between attempts (default 3600)")
    p.add_argument("--max-retries", type=int, default=50, metavar="K",
                   help=f"give up after K {what} in a row that wrote no new checkpoint (default 50)")


def with_mode(argv: list[str]) -> list[str]:
    """`olmax launch` arguments as earlier releases spelled them (no mode: local; --nprocs N, --slurm,
    --tpu-pod NAME [--run], --k8s) in today's (`olmax launch MODE ...`), saying so in one line on stderr."""
    if not argv or argv[0] != "launch" or (len(argv) > 1 and argv[1] in (*MODES, "-h", "--help")):
        return argv
    from olmax.errors import ConfigError

    modes, rest, old, args = [], [], [], iter(argv[1:])
    for arg in args:
        name = arg.partition("=")[0]
        if name in ("--slurm", "--k8s"):
            modes.append((arg, [arg[2:]]))
        elif name == "--tpu-pod":
            modes.append((name, ["tpu-pod", arg.partition("=")[2] or next(args, "")]))
        elif name != "--run":
            rest.append(arg)
        if name in ("--slurm", "--k8s", "--tpu-pod", "--run", "--nprocs"):
            old.append(name)
    if len(modes) > 1:
        raise ConfigError(f"olmax launch: {' and '.join(flag for flag, _ in modes)} are different ways to run; "
                          "choose one")
    flag, mode = modes[0] if modes else ("", ["local"])
    if flag and "--nprocs" in old:
        raise ConfigError(f"olmax launch: --nprocs goes with local runs; {flag} runs the processes its config "
                          "asks for: drop --nprocs")
    if "--run" in old and flag != "--tpu-pod":
        raise ConfigError("olmax launch: --run went with --tpu-pod")
    if flag == "--tpu-pod" and "--run" not in old:
        rest.append("--dry-run")  # without --run, --tpu-pod printed the command
    new = ["launch", *mode, *rest]
    if old:
        print(f"olmax: {' '.join(old)} is the old spelling, kept for one release: write `olmax launch "
              f"{' '.join(mode)} ...` (olmax launch --help)", file=sys.stderr)
    return new


def run_launch(args: argparse.Namespace) -> None:
    from olmax.errors import ConfigError
    from olmax.launch.launcher import Backoff
    from olmax.runtime import process_start_time

    if args.launch_mode in ("local", "slurm"):
        seconds = (args.retry_backoff, args.backoff_factor, args.backoff_max)
        if args.max_retries < 0 or not all(map(math.isfinite, seconds)) or args.retry_backoff < 0 \
                or args.backoff_factor < 1 or args.backoff_max < 0:
            raise ConfigError(f"olmax launch {args.launch_mode}: need --max-retries >= 0, --retry-backoff >= 0, "
                              "--backoff-factor >= 1 and --backoff-max >= 0, all finite")
        retries = {"backoff": Backoff(args.retry_backoff, args.backoff_factor, args.backoff_max),
                   "max_retries": args.max_retries}
    if args.launch_mode == "local":
        from olmax.launch.supervisor import Supervisor

        if args.nprocs < 1:
            raise ConfigError("olmax launch local: need --nprocs >= 1")
        launcher = Supervisor(args.config, args.overrides, nprocs=args.nprocs, started=process_start_time(), **retries)
    elif args.launch_mode == "slurm":
        from olmax.launch.slurm import SlurmLauncher

        if not (0 < args.poll_seconds < math.inf and 0 < args.status_seconds < math.inf):
            raise ConfigError("olmax launch slurm: need --poll-seconds > 0 and --status-seconds > 0, finite")
        launcher = SlurmLauncher(args.config, args.overrides, poll=args.poll_seconds,
                                 status_seconds=args.status_seconds, **retries)
    elif args.launch_mode == "tpu-pod":
        from olmax.launch.cloud import TpuPodLauncher

        launcher = TpuPodLauncher(args.config, args.overrides, vm=args.vm, zone=args.zone, project=args.project,
                                  wheel=args.wheel, install=args.install)
    else:
        from olmax.launch.cloud import K8sLauncher
        from olmax.scale.targets import parse_target

        if not (args.target and args.image):
            raise ConfigError("olmax launch k8s: give the slice with --target (tpu:v5p:4x4x4, gpu:h100x16) and the "
                              "container image with --image")
        if args.max_retries < 0 or args.grace_seconds < 1:
            raise ConfigError("olmax launch k8s: need --max-retries >= 0 and --grace-seconds >= 1")
        launcher = K8sLauncher(args.config, args.overrides, target=parse_target(args.target), image=args.image,
                               max_retries=args.max_retries, grace_seconds=args.grace_seconds)
    if args.launch_mode in ("slurm", "k8s"):  # the processes start elsewhere: what they would refuse, refused here
        for warning in launcher.check():
            print(f"olmax launch {args.launch_mode}: warning: {warning}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(launcher.render(), end="")
        return
    if code := launcher.run():
        sys.exit(code)
