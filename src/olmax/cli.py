"""olmax: reproducible, verifiable OLMo 3 pretraining on JAX."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from olmax.arguments import config_arguments, given, old_spelling
from olmax.errors import ExitCode, OlmaxError
from olmax.runtime import (LIBTPU_LOCKFILE, STOP_SIGNALS, Terminated, drop_held_signals, end_process,
                           hold_stop_signals, libtpu_lock_holder, quiet_cuda_plugin, raise_stop, release_stop_signals,
                           skip_absent_tpus)


def cmd_config_show(args) -> None:
    from olmax.config import dump, load_config

    from olmax.scale.targets import check_mesh, parse_target

    target = parse_target(args.target) if args.target else None
    cfg = load_config(args.config, args.overrides, target and target.name)
    if target:
        check_mesh(cfg.mesh, target)
    print(dump(cfg), end="")


def cmd_flops(args) -> None:
    from olmax.config import load_config
    from olmax.figures import si
    from olmax.model import flops

    cfg = load_config(args.config, args.overrides)
    seq = cfg.data.sequence_length
    count = flops.count(cfg.model, seq)
    per_device = args.instances_per_device or cfg.train.micro_batch_per_device or cfg.train.global_batch_instances
    tokens = per_device * seq
    report = {
        "params": count.params,
        "non_embedding_params": count.non_embedding_params,
        "active_params": count.active_params,
        "sequence_length": seq,
        "train_flops_per_token": count.per_token,
        "train_flops_per_token_all_global_attention": count.per_token_all_global,
        "instances_per_device_step": per_device,
        "train_tflop_per_device_step": count.per_token * tokens / 1e12,
        "train_tflop_per_device_step_all_global_attention": count.per_token_all_global * tokens / 1e12,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"params                    {count.params:,}")
    print(f"non-embedding params      {count.non_embedding_params:,}")
    print(f"active params / token     {count.active_params:,}  (FLOPs below count these)")
    sliding = any(not cfg.model.is_global(i) for i in range(cfg.model.n_layers))
    attention = "sliding windows exact" if sliding else "every layer global"
    print(f"train FLOP / token        {si(count.per_token, 'FLOP')}  ({attention}, seq {seq})")
    print(f"  all layers global       {si(count.per_token_all_global, 'FLOP')}")
    print(f"train FLOP / device-step  {si(report['train_tflop_per_device_step'] * 1e12, 'FLOP')}  "
          f"({per_device} x {seq} tokens)")
    print(f"  all layers global       {si(report['train_tflop_per_device_step_all_global_attention'] * 1e12, 'FLOP')}")


def cmd_train(args) -> None:
    from olmax.config import load_config
    from olmax.runtime import restart_with_huge_pages
    from olmax.train.goodput import process_start_time  # before jax: it records the process's exit after jax's

    restart_with_huge_pages()
    cfg = load_config(args.config, args.overrides)
    from olmax.launch.distributed import announce, close_host_log, host_log, join_cluster

    from olmax.train.watchdog import coordination_heartbeat

    cluster = join_cluster(coordination_heartbeat(cfg.train.hang_timeout))  # before anything touches a device
    import jax

    from olmax.config import target_layout
    from olmax.scale.targets import flag_profile, running_target

    target = running_target(jax.devices())
    if layout := target_layout(args.config, target):  # the config's settings for these devices
        cfg = load_config(args.config, args.overrides, target)
        if cluster.process_id == 0:
            print(f"layout for {target} ({layout[0]} in the config): {' '.join(layout[1])}", flush=True)
    from olmax.eval.in_loop import make_in_loop_eval
    from olmax.train.trainer import train

    def start(run_dir) -> None:
        # Once the run directory is checked and held; a run in a bucket keeps no host logs (a bucket has no
        # appending): its metrics and checkpoints are there.
        line = announce(run_dir, cluster)
        if cluster.process_id == 0:
            print(line, flush=True)

    try:
        # the step compiled with the flag profile of the target these devices make, as `olmax compile` predicted it
        train(cfg, make_eval=make_in_loop_eval, on_start=start, started=process_start_time(),
              compiler_options=flag_profile(target))
    except BaseException as err:
        host_log.info("stopped: %s", f"{type(err).__name__}: {err}")  # a record that keeps no frame alive
        raise
    else:
        host_log.info("finished")
    finally:
        close_host_log()
    if cluster.process_id == 0:
        from olmax.run_dir import RunDir

        run = RunDir(cfg.run_location)
        print(f"done: checkpoints in {run.checkpoints}, metrics in {run.metrics} and {run.tensorboard}")


def cmd_resume_check(args) -> None:
    from pathlib import Path

    from olmax.config import load_config
    from olmax.run_dir import check_own_files
    from olmax.train.resume_check import OUTPUTS, resume_check, write_results

    cfg = load_config(args.config, args.overrides)  # validate before starting any process
    out = Path(args.out or cfg.run_dir.parent / f"{cfg.name}-resume-check")
    check_own_files(*(out / name for name in OUTPUTS))
    rows = resume_check(args.config, args.overrides, args.at, args.steps, out)
    print(write_results(rows, out, args.at))
    worst = max(abs(r[3]) for r in rows)
    print(f"max |delta| {worst!r} over {len(rows)} steps after the resume at {args.at}; "
          f"table and plot in {out}")
    if worst != 0:
        sys.exit(ExitCode.FAILED)


def cmd_goodput(args) -> None:
    from olmax import storage
    from olmax.errors import BadInput
    from olmax.run_dir import RunDir, drawn, write_own
    from olmax.train.goodput import plot, read_record, report

    path = RunDir(args.run).goodput
    try:
        record = read_record(storage.read_text(str(path)))
    except (OSError, ValueError) as err:  # a StorageError is a ValueError
        raise BadInput(f"{path} cannot be read ({err}); give the run directory of an olmax train run") from None
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print(report(record))
    out = given(args, "out", "--out") or RunDir(args.run).goodput_plot  # never the current directory
    write_own(out, drawn(lambda png: plot(record, png, title=storage.basename(args.run))))  # through no link
    print(f"wrote {out}")


def cmd_demo(args) -> None:
    from olmax.demo import run_demo
    from olmax.runtime import restart_with_huge_pages

    restart_with_huge_pages()

    run_demo(args.overrides, fresh=args.fresh, moe=args.moe)


def build_parser() -> argparse.ArgumentParser:
    from olmax.config import presets

    parser = argparse.ArgumentParser(
        prog="olmax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`olmax COMMAND --help` describes each command. More in olmax's source: README.md, and docs/, a page "
        "a topic: the commands, the configs and their keys, the exit codes, runs on Slurm, TPU pods, Kubernetes and "
        "buckets.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="train (resumes from the latest checkpoint of the run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Trains CONFIG with its overrides; resumes from the run's latest checkpoint (output_dir); "
        "SIGTERM/SIGINT save a checkpoint and exit 75.",
        epilog=f"presets: {', '.join(presets())}\n(or a YAML file, which may start from one with `base: NAME`)\n\n"
        f"exit codes: {', '.join(f'{int(code)} {code.words or code.name.lower()}' for code in ExitCode)}\n"
        "(`olmax launch` runs the run again after "
        f"{', '.join(str(int(code)) for code in ExitCode if code.retried)}; docs/reliability.md's table says what each means)")
    config_arguments(p)
    p.set_defaults(func=cmd_train, handles_stop_signals=True)

    p = sub.add_parser("demo", help="the whole pipeline on the Python standard library, with a report",
                       description="Builds a corpus from the standard library, trains a tokenizer and writes shards "
                       "(cached in runs/demo/cache), trains the demo preset from scratch and writes "
                       "runs/demo/report.md, all under ./runs/demo.")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value on the demo preset")
    p.add_argument("--fresh", action="store_true", help="rebuild the cached corpus, tokenizer and shards")
    p.add_argument("--moe", action="store_true",
                   help="train the demo_moe preset (experts in every layer); its report plots each expert's load")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("resume-check", help="continuous run vs the same run resumed at --at: every delta must be 0")
    config_arguments(p)
    p.add_argument("--at", type=int, required=True, help="stop and resume after this step")
    p.add_argument("--steps", type=int, required=True, help="compare up to this step")
    p.add_argument("--out", help="default: runs/NAME-resume-check")
    p.set_defaults(func=cmd_resume_check)

    p = sub.add_parser("goodput", help="where a run's wall time went, by category, over its restarts")
    p.add_argument("run", help="the run directory (output_dir), local or in a bucket")
    p.add_argument("--out", help="the PNG of its attempts (default: goodput.png in the run directory)")
    old_spelling(p, "--png", "out", "write --out FILE")
    p.add_argument("--json", action="store_true", help="print the record instead")
    p.set_defaults(func=cmd_goodput)

    p = sub.add_parser("flops", help="parameter count and training FLOPs")
    config_arguments(p)
    p.add_argument("--instances-per-device", type=int, help="default: train.micro_batch_per_device")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser("config", help="config tools")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    config_arguments(show)
    show.add_argument("--target", help="with the config's layout for this target (gpu:b300x8, tpu:v5p:4x4x8), as "
                      "a run on those devices and `olmax compile --target` take it")
    show.set_defaults(func=cmd_config_show)

    from olmax.data import cli as data_cli
    from olmax.eval import cli as eval_cli
    from olmax.interop import cli as interop_cli
    from olmax.launch import cli as launch_cli
    from olmax.scale import cli as scale_cli

    data_cli.add_commands(sub)
    interop_cli.add_commands(sub)
    launch_cli.add_commands(sub)
    eval_cli.add_commands(sub)
    scale_cli.add_commands(sub)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, where `key=value` overrides may also come after the command's options."""
    from olmax.launch.cli import with_mode

    argv = with_mode(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        settings = " (settings are section.key=value overrides, e.g. train.steps=10)" \
            if hasattr(args, "overrides") and rest[0].startswith("--") else ""
        command_parser(parser, args).error(f"unrecognized arguments: {' '.join(rest)}{settings}")
    return args


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command `args` ran (`olmax config show`'s for `config show`): its usage, not the whole
    CLI's, goes with an error in its arguments."""
    while action := next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None):
        parser = action.choices[getattr(args, action.dest)]
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. An error olmax raises on purpose (olmax.errors) ends it with one line and its exit code:
    bad input exits 2 naming it; an interrupt never prints a traceback: train and launch stop cleanly (exit 75)
    whenever it comes, other commands exit 130 (SIGINT) or 143 (SIGTERM)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    hold_stop_signals()
    skip_absent_tpus()
    quiet_cuda_plugin()
    code, args = ExitCode.FAILED, None
    try:
        args = parse(argv)
        if not getattr(args, "handles_stop_signals", False):
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    signal.signal(sig, raise_stop)
            release_stop_signals()  # one that came during start-up raises KeyboardInterrupt here
        args.func(args)
        code = ExitCode.FINISHED
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        print(f"olmax: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        code = ExitCode.TERMINATED if terminated else ExitCode.INTERRUPTED
    except OlmaxError as err:
        print(f"olmax: {err.line()}", file=sys.stderr)
        code = err.exit_code
    except Exception as err:
        if "libtpu multi-process lockfile" in str(err) and (holder := libtpu_lock_holder()):
            print(f"olmax: process {holder} is using this machine's TPU chips (it holds {LIBTPU_LOCKFILE}); run "
                  "this again when it has ended", file=sys.stderr)
            code = ExitCode.FAILED
        else:
            raise
    finally:
        drop_held_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        if argv is None and code == ExitCode.PREEMPTED:
            # A run stopped by a signal has written its checkpoint: a repeated SIGTERM (srun ending a job's other
            # tasks once one exits, a second notice) must not turn exit 75 into a kill while the process exits.
            previous[signal.SIGTERM] = signal.SIG_IGN
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if argv is None and getattr(args, "func", None) is cmd_train:
        end_process(code)  # its last seconds on its goodput record
    return code


if __name__ == "__main__":
    sys.exit(main())
