"""`olmax launch`: train under the resume-until-done supervisor."""

from __future__ import annotations

import argparse
import sys


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="train, restarting after crashes and preemptions until the run reaches its step target",
        description="Runs `olmax train CONFIG OVERRIDES` as child process(es); the trainer resumes from the run's "
        "latest checkpoint, so after a crash (any exit but 0, 2, 75, or a signal) it is restarted after an "
        "exponential backoff, after a preemption (exit 75) at once. Bad input (exit 2) is not retried. Every "
        "attempt is logged to RUN_DIR/launch.jsonl. Exit: 0 finished, 2 bad input, 75 the launcher was "
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
    p.add_argument("--retry-backoff", type=float, default=300.0, metavar="S",
                   help="seconds before the first restart after a failure (default 300)")
    p.add_argument("--backoff-factor", type=float, default=2.0, metavar="F",
                   help="each further failure in a row waits F times longer (default 2)")
    p.add_argument("--backoff-max", type=float, default=3600.0, metavar="S",
                   help="the longest wait between attempts (default 3600)")
    p.add_argument("--max-retries", type=int, default=50, metavar="K",
                   help="give up after K restarts in a row that wrote no new checkpoint (default 50)")
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
