"""`olmax launch`: train under the resume-until-done supervisor."""

from __future__ import annotations

import argparse
import sys


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="train, restarting after crashes and preemptions until the run reaches its step target",
        description="Runs `olmax train CONFIG OVERRIDES` as child process(es); the trainer resumes from the run's "
        "latest checkpoint, so after a crash (any exit but 0, 2, 3, 74, 75, or a signal) it is restarted after an "
        "exponential backoff (so is a storage outage, exit 69), after a preemption (exit 75) at once. Bad input (exit 2), a divergence (exit 3: "
        "the parameters became NaN/inf) and a full disk (exit 74) are not retried. Every attempt is logged to "
        "launch.jsonl in the run directory (or launch.records_dir; runs/NAME here for a run in a bucket). Exit: 0 finished, 2 bad input, 3 diverged, 74 disk full, 75 the launcher was "
        "signalled (SIGTERM/SIGINT are passed on: the run checkpoints and stops), 1 gave up. On CPU, "
        "OLMAX_LOCAL_DEVICES=D in the environment gives each process D devices. With --slurm the run is a Slurm "
        "batch job (the config's launch.slurm section) instead, requeued after preemptions and submitted again "
        "after failures by the same rules.",
    )
    p.add_argument("config", help="preset name (olmo3_7b, tiny, ...) or a YAML path")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--nprocs", type=int, default=1,
                   help="local processes of one multi-process run (jax.distributed over 127.0.0.1); default 1")
    p.add_argument("--slurm", action="store_true",
                   help="submit the run as a Slurm batch job (launch.slurm.* in the config) and watch it until done")
    p.add_argument("--dry-run", action="store_true", help="with --slurm: print the batch script, submit nothing")
    p.add_argument("--poll-seconds", type=float, default=30.0, metavar="S",
                   help="with --slurm: how often to ask Slurm about the job (default 30)")
    p.add_argument("--tpu-pod", metavar="NAME",
                   help="print the gcloud command that installs olmax on every worker of TPU VM NAME and starts "
                        "the run there (with --zone; --run executes it)")
    p.add_argument("--zone", help="with --tpu-pod: the TPU VM's zone")
    p.add_argument("--project", help="with --tpu-pod: the Google Cloud project (default: gcloud's)")
    p.add_argument("--install", default="olmax[aot]", metavar="SPEC",
                   help="with --tpu-pod: what each worker pip-installs (default olmax[aot]; a wheel or git URL)")
    p.add_argument("--run", action="store_true", help="with --tpu-pod: run the command, not just print it")
    p.add_argument("--k8s", action="store_true",
                   help="write RUN_DIR/jobset.yaml, a JobSet for `kubectl apply` (with --target and --image)")
    p.add_argument("--target", help="with --k8s: the slice, as olmax compile names it (tpu:v5p:4x4x4, gpu:h100x16)")
    p.add_argument("--image", help="with --k8s: the container image with olmax installed")
    p.add_argument("--retry-backoff", type=float, default=300.0, metavar="S",
                   help="seconds before the first restart after a failure (default 300)")
    p.add_argument("--backoff-factor", type=float, default=2.0, metavar="F",
                   help="each further failure in a row waits F times longer (default 2)")
    p.add_argument("--backoff-max", type=float, default=3600.0, metavar="S",
                   help="the longest wait between attempts (default 3600)")
    p.add_argument("--max-retries", type=int, default=50, metavar="K",
                   help="give up after K restarts in a row that wrote no new checkpoint (default 50; with --k8s "
                        "the JobSet's maxRestarts)")
    p.set_defaults(func=run_launch, handles_stop_signals=True)


def run_launch(args: argparse.Namespace) -> None:
    from olmax.config import ConfigError, load_config
    from olmax.launch.supervisor import Backoff, launch

    if args.nprocs < 1 or args.max_retries < 0 or args.retry_backoff < 0 or args.backoff_factor < 1 \
            or args.backoff_max < 0 or args.poll_seconds <= 0:
        raise ConfigError("olmax launch: need --nprocs >= 1, --max-retries >= 0, --retry-backoff >= 0, "
                          "--backoff-factor >= 1, --backoff-max >= 0 and --poll-seconds > 0")
    if args.dry_run and not args.slurm:
        raise ConfigError("olmax launch: --dry-run goes with --slurm")
    if args.slurm and args.nprocs != 1:
        raise ConfigError("olmax launch: --slurm runs launch.slurm.nodes x tasks_per_node processes; drop --nprocs")
    modes = [flag for flag, on in (("--slurm", args.slurm), ("--tpu-pod", args.tpu_pod), ("--k8s", args.k8s)) if on]
    if len(modes) > 1:
        raise ConfigError(f"olmax launch: {' and '.join(modes)} are different ways to run; choose one")
    if args.tpu_pod:
        return _tpu_pod(args)
    if args.k8s:
        return _k8s(args)
    backoff = Backoff(args.retry_backoff, args.backoff_factor, args.backoff_max)
    if args.dry_run:
        from olmax.launch.slurm import batch_script

        print(batch_script(load_config(args.config, args.overrides), args.config, args.overrides), end="")
        return
    if args.slurm:
        from olmax.launch.slurm import SlurmLauncher

        code = SlurmLauncher(args.config, args.overrides, backoff=backoff, max_retries=args.max_retries,
                             poll=args.poll_seconds).run()
    else:
        code = launch(args.config, args.overrides, nprocs=args.nprocs, backoff=backoff, max_retries=args.max_retries)
    if code:
        sys.exit(code)


def _tpu_pod(args: argparse.Namespace) -> None:
    import shutil
    import subprocess

    from olmax.config import ConfigError, load_config
    from olmax.launch.cloud import shell_line, tpu_pod_command

    if not args.zone:
        raise ConfigError("olmax launch --tpu-pod: give the TPU VM's zone with --zone")
    from olmax import storage
    from olmax.launch.supervisor import launch_dir

    cfg = load_config(args.config, args.overrides)  # a bad config fails here, not on every worker
    if not storage.is_remote(cfg.run_location):  # a bucket run directory is written by the workers' processes
        launch_dir(cfg)
    command = tpu_pod_command(args.tpu_pod, args.zone, args.config, args.overrides, project=args.project,
                              install=args.install)
    print(shell_line(command), flush=True)
    if args.run:
        if shutil.which("gcloud") is None:
            raise ConfigError("olmax launch --tpu-pod --run: gcloud is not on PATH; install the Google Cloud CLI")
        sys.exit(subprocess.run(command).returncode)


def _k8s(args: argparse.Namespace) -> None:
    import yaml

    from olmax.config import ConfigError, load_config
    from olmax.launch.cloud import jobset
    from olmax.launch.supervisor import launch_dir
    from olmax.run_dir import RunDir
    from olmax.scale.targets import parse_target

    if not (args.target and args.image):
        raise ConfigError("olmax launch --k8s: give the slice with --target (tpu:v5p:4x4x4, gpu:h100x16) and the "
                          "container image with --image")
    target = parse_target(args.target)
    cfg = load_config(args.config, args.overrides, target.name)
    manifest = jobset(cfg, args.config, args.overrides, image=args.image, platform=target.platform, kind=target.kind,
                      topology=target.topology, chips=target.chips, max_restarts=args.max_retries)
    path = RunDir(launch_dir(cfg)).jobset
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    print(f"wrote {path}; start the run with: kubectl apply -f {path}")
