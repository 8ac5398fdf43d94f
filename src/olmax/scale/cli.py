"""`olmax plan` and `olmax compile`: what a run costs on a target, and whether its step fits there."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

from olmax.config import ConfigError, load_config, target_layout


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="chip-seconds per step, step time, tokens/s per chip and chip-hours of a run on a target",
        description="Compiles the train step for the target (as `olmax compile`; cached by program) and predicts its "
        "time from the compiled program with the step-time model, then prints the run's cost at that step and where "
        "the step's time goes. With --mfu X it is arithmetic at that MFU instead, with no compilation. TARGET is "
        "tpu:KIND:TOPOLOGY (tpu:v5p:4x4x8, tpu:tpu7x:4x4x4) or gpu:KINDxN (gpu:h100x8).",
    )
    _config_and_target(p)
    _mfu_option(p)
    p.add_argument("--goodput", type=float, help="the share of wall time that is productive steps (what `olmax "
                   "goodput RUN` measured, e.g. 0.9): adds the chip-hours the run really costs")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _report_option(p)
    p.set_defaults(func=run_plan)

    p = subparsers.add_parser(
        "compile", help="compile the train step for a TPU slice or GPU host on this machine; does it fit?",
        description="Compiles the step `olmax train` runs (the config's mesh, remat and micro-batch) for the "
        "target's devices without the hardware, and reports per-device memory at the compiler's peak, the "
        "parameter / optimizer / activation split, FLOPs, and the step's time predicted from the compiled program. Needs the aot extra (TPU) or "
        "the aot-gpu extra (GPU). Exit 1 (DoesNotFit) when the step needs more memory than a device has.",
    )
    _config_and_target(p)
    _mfu_option(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _report_option(p)
    p.set_defaults(func=run_compile)

    p = subparsers.add_parser(
        "tune", help="search remat, mesh, micro-batch, tiles and flags for the fastest layout that fits a target",
        description="Enumerates the layouts of the config's step on the target (remat policies, the devices factored "
        "over data, fsdp, tensor and expert, micro-batches, Splash tiles, the target's XLA flag profile), compiles the "
        "most promising first (cached by program: a rerun compiles nothing new), judges each by the compiler's peak "
        "memory and the step-time model's prediction, prunes by memory as it learns, and prints the ranked table.",
    )
    _config_and_target(p, "section.key=value (settings tune does not search; a mesh axis, remat or micro-batch "
                       "given here is kept, and only the layouts that agree with it are searched)")
    p.add_argument("--budget", type=int, default=24, help="compiles at most (default 24: about an hour for the 7B "
                   "on a laptop's CPU at 2-3 minutes a compile)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="the share of a device's memory a layout must leave free to count as fitting (default 0.1)")
    p.add_argument("--jobs", type=int, help="compiles side by side (default: one a core, as many as memory allows); "
                   "with --engine ray, the CPUs of the local Ray")
    p.add_argument("--engine", choices=("processes", "ray"), default="processes",
                   help="processes: compiles on this host (default); ray: each compile a Ray task on a cluster (the "
                   "`ray` extra), as many at a time as its nodes' CPUs and memory hold, the search unchanged")
    p.add_argument("--address", help="with --engine ray: the Ray cluster to join (host:port of its head; default: a "
                   "local Ray started for the command)")
    p.add_argument("--depth", choices=("full", "reduced"), default="full",
                   help="full (default): compile every candidate whole; reduced: compile each with one and two units "
                   "of its repeated layers (a layer_pattern period on each pipeline stage) and extrapolate its peak "
                   "and step to the whole depth, confirm the best by a full compile, and compile whole from the first "
                   "confirmation that misses by more than 5%%")
    p.add_argument("--out", metavar="FILE", help="write the best layout to this new file (its directory made if "
                   "missing) as a config file, the whole config of the program ranked (CONFIG, its layout for the "
                   "target, the settings given, the layout searched): `olmax train FILE`, or `olmax train CONFIG "
                   "FILE`")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    _report_option(p)
    p.set_defaults(func=run_tune)

    p = subparsers.add_parser(
        "report", help="the page of a run directory, or of report.json files of compiles and plans side by side",
        description="Of a run directory (output_dir, local or in a bucket): OUT/index.html (default RUN/page), one "
        "self-contained page of the run (loss, LR, grad norm and throughput against step and wall time with "
        "restarts, checkpoints and skipped steps marked; held-out loss per domain; goodput; an MoE's expert load per "
        "layer; the config and the commands to resume, evaluate and convert), with report.json and config.yaml. Of "
        "report.json files written by --report: OUT/index.html, a comparison page of the reports (memory, pipeline "
        "bubble, collectives per mesh axis, cost), and the comparison as a Markdown table in BENCHMARKS.md's form; "
        "of one report, OUT gets that report's own page again.",
    )
    p.add_argument("reports", nargs="+", metavar="RUN | REPORT.json",
                   help="a run directory (local or a bucket URL), or report.json files written by --report")
    p.add_argument("--out", help="directory for index.html and report.json (a run's default: RUN/page)")
    p.add_argument("--watch", type=float, metavar="SECONDS",
                   help="a run's page: write it again every SECONDS (at most a day) while the run goes on (Ctrl-C "
                   "stops)")
    p.set_defaults(func=run_report)


def _config_and_target(parser: argparse.ArgumentParser, overrides: str = "section.key=value") -> None:
    parser.add_argument("config", help="preset name (olmo3_7b, tiny, ...) or a YAML path")
    parser.add_argument("overrides", nargs="*", default=[], help=overrides)  # optional: not "required" in usage errors
    parser.add_argument("--target", required=True, help="tpu:KIND:TOPOLOGY (tpu:v5p:4x4x8) or gpu:KINDxN (gpu:h100x8)")


def _report_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--report", metavar="DIR",
                        help="also write DIR/index.html (a page: mesh, memory, parameters, collectives, pipeline "
                        "ticks, cost) and DIR/report.json")


PAGE_FILES = ("index.html", "report.json", "config.yaml")  # what a page's directory gets (config.yaml: a run's)


def _report_dir(value: str | None, option: str = "--report") -> str | None:
    """The directory the page goes to (a local path, made now, or a bucket URL), refused before any work when it
    cannot be written there."""
    from olmax import storage
    from olmax.config import writable_dir
    from olmax.run_dir import own_dir, refuse_link

    if value is None:
        return None
    if not value.strip() or "\0" in value:
        raise ConfigError(f"{option} {value!r}: give a directory for the page (created if missing), or a bucket URL")
    if storage.is_remote(value):
        storage.check_writable(value)
        return value
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"{option} {value}: a file is there; give a directory (created if missing)")
    writable_dir(Path(value), option)
    refuse_link(value)  # the page's directory itself (opened through no link when written)
    # the page's files replace an earlier page's, never a file of something else, nor one through a link
    if link := next((name for name in PAGE_FILES if os.path.islink(os.path.join(value, name))), None):
        raise ConfigError(f"{option} {value}: its {link} is a symbolic link, which olmax does not write through; "
                          "give another directory")
    if taken := next((name for name in PAGE_FILES if os.path.isdir(os.path.join(value, name))), None):
        raise ConfigError(f"{option} {value}: its {taken} is a directory, where the page writes a file; give another "
                          "directory")
    if os.path.lexists(os.path.join(value, "index.html")) and not os.path.isfile(os.path.join(value, "report.json")):
        raise ConfigError(f"{option} {value}: it holds an index.html with no report.json beside it (not a page "
                          "olmax wrote); give a new or empty directory")
    try:
        own_dir(value)
    except OSError as err:
        raise ConfigError(f"{option} {value} cannot be made ({err.strerror}); give a directory that can be "
                          "written") from None
    return value


def _new_file(value: str, option: str) -> None:
    """Refuse `value` before any work unless it is a new file that can be written (made with its directory, which
    is not a symbolic link: it is opened through none)."""
    from olmax.config import writable_dir
    from olmax.run_dir import refuse_link

    if os.path.isdir(value):
        raise ConfigError(f"{option} {value}: a directory is there; give a new file to write to")
    if os.path.lexists(value):
        kind = "a symbolic link" if os.path.islink(value) else "a file"
        raise ConfigError(f"{option} {value}: {kind} is there already; give a new file, or delete it first")
    writable_dir(Path(value).absolute().parent, option)
    refuse_link(Path(value).absolute().parent)


def _compile_cache() -> None:
    """Refuse a compile cache (`OLMAX_COMPILE_CACHE`) that cannot be used before anything is compiled or written."""
    from olmax.scale.compile_cache import usable_cache_dir

    usable_cache_dir()


def _write_report(report: dict, directory: str | None, overrides: list[str]) -> None:
    if directory is not None:
        from olmax.scale.layout_page import write

        print(f"olmax: report {write({**report, 'overrides': overrides}, directory)}", file=sys.stderr)


def _load(args: argparse.Namespace, target):
    """The config as it runs on the target (its layout there, the overrides), its mesh taking the target's devices."""
    from olmax.scale.targets import check_mesh

    cfg = load_config(args.config, args.overrides, target.name)
    check_mesh(cfg.mesh, target)
    return cfg


def _mfu_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mfu", type=float,
                        help="cost the run at this model FLOPs utilization instead of the step time the step-time "
                        "model predicts from the compiled program")


def _mfu(value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise ConfigError(f"--mfu {value}: give a fraction in (0, 1], e.g. 0.445")
    return value


def run_plan(args: argparse.Namespace) -> None:
    from olmax.scale.plan import format_plan, plan
    from olmax.scale.targets import parse_target

    target = parse_target(args.target)
    if args.goodput is not None and not 0 < args.goodput <= 1:
        raise ConfigError(f"--goodput {args.goodput}: give a fraction in (0, 1], e.g. 0.9")
    cfg, mfu = _load(args, target), _mfu(args.mfu)
    if mfu is None:
        _compile_cache()
    directory = _report_dir(args.report)
    prediction, err = None, None
    if mfu is None:
        compiled, err = _compile(args, target)
        prediction = compiled.get("step_time")
        if prediction is None:
            print(format_plan(plan(cfg, target, goodput=args.goodput)))
            print(f"olmax: {err.line()}; no step to predict (--mfu X costs it at an assumed MFU)", file=sys.stderr)
            sys.exit(err.exit_code)
    report = plan(cfg, target, mfu, args.goodput, prediction)
    if prediction is not None:
        report["step_time"] = prediction
    print(json.dumps(report, indent=2) if args.json else format_plan(report, prediction))
    _write_report(report, directory, args.overrides)
    if err is not None:  # a GPU step that compiled but needs more memory than the device has: predicted, refused
        print(f"olmax: {err.line()}", file=sys.stderr)
        sys.exit(err.exit_code)


def _compile(args: argparse.Namespace, target):
    """(the compile report of the config for the target, the DoesNotFit when the step does not fit), saying each phase
    and, in every 30 s of silence, what it still waits for; a SIGINT or SIGTERM ends it at once (exit 130, 143)."""
    from olmax.errors import DoesNotFit
    from olmax.progress import ticking
    from olmax.runtime import stopping_at_once
    from olmax.scale.compile import compile_train_step

    command = f"olmax {args.func.__name__.removeprefix('run_')}"
    cfg = _load(args, target)
    phase = ["starting"]

    def say(line: str) -> None:
        phase[0] = line
        print(f"{command}: {line}", file=sys.stderr, flush=True)

    try:
        with stopping_at_once(say), ticking(lambda seconds: f"{command}: [{seconds:.0f} s] still waiting for XLA "
                                                           f"(last: {phase[0]})"):
            return compile_train_step(cfg, target, _mfu(args.mfu), progress=say), None
    except DoesNotFit as err:
        return err.report, err


def run_compile(args: argparse.Namespace) -> None:
    from olmax.scale.targets import parse_target

    target = parse_target(args.target)
    _load(args, target)  # refused before anything else
    layout = target_layout(args.config, target.name)
    layout = layout and {"target": layout[0], "settings": layout[1]}
    _compile_cache()
    directory = _report_dir(args.report)
    report, err = _compile(args, target)
    report["layout"] = layout
    print(json.dumps(report, indent=2) if args.json else format_compile(report))
    _write_report(report, directory, args.overrides)
    if err is not None:
        print(f"olmax: {err.line()}", file=sys.stderr)
        sys.exit(err.exit_code)


def run_tune(args: argparse.Namespace) -> None:
    from olmax.errors import RunDirError
    from olmax.run_dir import OwnDir
    from olmax.runtime import stopping_at_once
    from olmax.scale import tune, tune_space, tune_text
    from olmax.scale.targets import aot_missing, parse_target

    target = parse_target(args.target)
    if args.budget < 1:
        raise ConfigError(f"--budget {args.budget}: give the number of compiles to run, at least 1")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom}: give a fraction in [0, 1), e.g. 0.1")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: give at least 1")
    _engine_options(args)
    if args.out:
        _new_file(args.out, "--out")
    # a bad config, or settings no layout agrees with, are refused before the environment is asked to compile
    tune_space.given(tune_space.space(load_config(args.config, args.overrides, target.name), target), args.overrides)
    if args.engine == "processes" and (reason := aot_missing(target.platform)):
        raise ConfigError(reason)  # (a Ray cluster's nodes are asked themselves, before the search)
    _compile_cache()
    directory = _report_dir(args.report)
    engine = None
    if args.engine == "ray":
        from olmax.scale.tune_ray import on_ray

        engine = functools.partial(on_ray, args.address, args.jobs)
    # its compiles end at once, here, in its workers, or on Ray (the tasks of a driver gone); those finished are kept
    # in the compile cache
    with stopping_at_once(tune.print_err):
        search = tune.tune(args.config, args.overrides, target, args.budget, args.headroom,
                           args.jobs or tune.default_jobs(), tune.print_err, args.depth == "reduced", engine)
    report = {"config": args.config, "overrides": args.overrides, "target": target.name, "budget": args.budget,
              "headroom": args.headroom, "depth": args.depth, "space": search.size, "compiled": search.compiled, "seconds": search.seconds,
              "memory_per_device": target.accelerator.memory_per_device,
              "results": [r.row() for r in search.ranked()]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(tune_text.table(search, target))
        print(tune_text.coverage(search))
        print(tune_text.main_line(search))
    unwritten = None
    if args.out and search.best is not None:
        layout = tune_text.overlay(args.config, args.overrides, search, target)
        try:  # a new file (O_EXCL: not one made since the check, nor through a link) in its directory opened once
            with OwnDir(Path(args.out).absolute().parent) as out_dir:
                out_dir.create(Path(args.out).name, layout)
            print(f"olmax: best layout {args.out}", file=sys.stderr)
        except (OSError, RunDirError) as err:  # something took its place during the search: printed instead
            why = ("something appeared there during the search" if isinstance(err, FileExistsError)
                   else getattr(err, "strerror", None) or str(err))
            print(f"olmax tune: the best layout, not written to {args.out}:\n{layout}", file=sys.stderr, end="")
            unwritten = f"--out {args.out}: {why}; the best layout is printed above: save it to a new file"
    if directory is not None:
        from olmax.scale.tune_page import write_tune

        print(f"olmax: report {write_tune(report, directory)}", file=sys.stderr)
    if unwritten:
        raise ConfigError(unwritten)
    if search.best is None:
        from olmax.errors import ExitCode

        sys.exit(ExitCode.FAILED)


def _engine_options(args: argparse.Namespace) -> None:
    """--engine ray's options, refused (ConfigError) before anything else where they cannot go together."""
    import importlib.util

    if args.address is not None and args.engine != "ray":
        raise ConfigError("--address names a Ray cluster: give it with --engine ray")
    if args.address is not None and args.jobs is not None:
        raise ConfigError("--jobs sets the CPUs of a local Ray; the nodes of the cluster at --address have theirs: "
                          "give one of them")
    if args.engine == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("--engine ray needs Ray, which is not installed: pip install 'olmax[ray]'")


def run_report(args: argparse.Namespace) -> None:
    from olmax import storage
    from olmax.scale.comparison import markdown_table, write_comparison
    from olmax.scale.layout_page import write
    from olmax.scale.report_json import load

    if len(args.reports) == 1 and (storage.is_remote(args.reports[0]) and not args.reports[0].endswith(".json")
                                   or os.path.isdir(args.reports[0])):
        return _run_page(args.reports[0], args.out, args.watch)
    if args.watch is not None:
        raise ConfigError("--watch: only a run's page is written again; give one run directory")
    if missing := next((p for p in args.reports if not storage.is_remote(p) and not os.path.lexists(p)), None):
        raise ConfigError(f"{missing}: no such file or directory; give a run directory (output_dir), or report.json "
                          "files of --report")
    reports = [load(path) for path in args.reports]
    if args.out is None:
        raise ConfigError("--out: give the directory for the page of the report.json files")
    directory = _report_dir(args.out, "--out")
    print(markdown_table(reports))
    written = write(reports[0], directory) if len(reports) == 1 else write_comparison(reports, directory)
    print(f"olmax: report {written}", file=sys.stderr)


WATCH_MOST = 86400.0  # a day between two writes of a run's page; more is a mistyped --watch (time.sleep refuses 1e10)


def _run_page(run: str, out: str | None, watch: float | None) -> None:
    """The page of the run directory `run`, written again every `watch` seconds when given."""
    import time

    from olmax import storage
    from olmax.run_dir import RunDir
    from olmax.train.run_page import write

    if watch is not None and not 0 < watch <= WATCH_MOST:
        raise ConfigError(f"--watch {watch}: give the seconds between two writes of the page, more than 0 and at "
                          f"most {WATCH_MOST:,.0f} (a day), e.g. 60")
    files = RunDir(run)
    if not any(storage.exists(str(path)) for path in (files.metrics, files.goodput, files.checkpoints)):
        raise ConfigError(f"{run}: not a run directory (no metrics.jsonl, goodput.json or checkpoints/ there); give "
                          "the output_dir of an olmax train run, or report.json files of --report")
    directory = _report_dir(out or str(files.page), "--out")
    while True:
        print(f"olmax: run page {write(run, directory)}", file=sys.stderr, flush=True)
        if watch is None:
            return
        time.sleep(watch)


def _tiles(tiles: dict | None) -> str:
    if not tiles:
        return ""
    return (f" (tiles: {tiles['block_q']} queries x {tiles['block_kv']} keys, {tiles['block_kv_compute']} keys a step, "
            f"head_dim {tiles['head_dim']})")


FP8_NOTE = {False: "", True: " (fp8 projections)", "mxfp8": " (MXFP8 projections and experts)"}


def _exchange(e: dict) -> str:
    from olmax.figures import size

    parts = f", in {e['parts']} parts" if e["parts"] > 1 else ""
    return (f"expert exchange: {e['kind']}{parts}; a layer's receive buffer {e['receive_rows']:,} rows "
            f"({size(e['receive_bytes'])} of hidden states) a part, {e['expected_rows']:,.0f} expected to arrive")


def format_compile(r: dict) -> str:
    from olmax.figures import percent, si, size

    device = r["memory_per_device"]

    def row(label: str, value: float, share: bool = False) -> str:  # in the unit that shows the value best
        return f"{label:36}{size(value):>12}" + (f"   {percent(value / device)} of the device" if share else "")

    mesh = " x ".join(f"{axis} {size}" for axis, size in r["mesh"].items())
    loss = "loss on whole sequences" if r["loss_chunk"] is None else f"loss in chunks of {r['loss_chunk']} positions"
    lines = [
        f"{r['config']} for {r['target']}: {r['devices']} x {r['device_kind']}, mesh {mesh}",
        f"{r['instances_per_device_micro_step']} x {r['sequence_length']} tokens per device per micro-step, "
        f"{r['micro_steps']} micro-step(s) per step, {r['compute_dtype']} compute"
        f"{FP8_NOTE[r['fp8']]}, {r['attention']} attention{_tiles(r.get('attention_tiles'))}, "
        f"{'experts by ' + r['moe_dispatch'] + ', ' if r.get('moe_dispatch') else ''}{loss}, "
        f"remat {r['remat']}",
        *([f"layout for {r['layout']['target']} from the config: {' '.join(r['layout']['settings'])}"]
          if r.get("layout") else []),
        *([_exchange(r["expert_exchange"])] if r.get("expert_exchange") else []),
        "",
        "per device",
        row("device memory", device),
    ]
    if "peak" in r:
        lines += [
            row("peak (compiler)", r["peak"], share=True),
            row("  arguments", r["arguments"]),
            row("    parameters (fp32)", r["parameters"]),
            row("    optimizer state", r["optimizer_state"]),
            row("    batch", r["batch"]),
            row("  gradients (fp32)", r["gradients"]),
            *[row(f"  {s['segment']}", s["bytes"]) for s in r["memory_stack"][4:-1]],
        ]
    else:
        if "required" in r:
            lines.append(row("temporaries (compiler's check)", r["required"], share=True))
        lines += [
            row("arguments", r["parameters"] + r["optimizer_state"] + r["batch"], share=True),
            row("  parameters (fp32)", r["parameters"]),
            row("  optimizer state", r["optimizer_state"]),
            row("  batch", r["batch"]),
            f"compiler: {r['compiler_error']}",
        ]
    if "program" in r:
        program = r["program"]
        kernels = ", ".join(f"{name} x{n}" for name, n in program["custom_calls"].items())
        mxfp8 = f", {program['mxfp8_matmuls']} MXFP8 (cuDNN block-scaled)" if program.get("mxfp8_matmuls") else ""
        # the SparseCores only where the program uses them or the target's flags offload collectives to them
        offload = program["sparsecore_collectives"] or any("sparse_core" in flag for flag in r.get("xla_flags") or {})
        lines += [f"compiled: {program['float8_matmuls']} of {program['matmuls']} matmuls float8{mxfp8}; "
                  f"custom calls {kernels or 'none'}"
                  + (f"; {program['sparsecore_collectives']} collectives on the SparseCores" if offload else "")]
    if r.get("xla_flags"):
        flags = " ".join(f"--{name}={str(value).lower()}" for name, value in r["xla_flags"].items())
        lines += [f"XLA flags ({r['target'].split(':')[1]} profile): {flags}"]
    exact, full = r["plan"]["exact_window"], r["plan"]["all_global"]
    lines += [
        "",
        f"FLOP / device-step     {si(exact['tflop_per_device_step'] * 1e12, 'FLOP')} (sliding windows exact), "
        f"{si(full['tflop_per_device_step'] * 1e12, 'FLOP')} (every layer global)",
    ]
    if "step_seconds" in exact:
        how = "given" if r["plan"]["mfu_from"] == "given" else "predicted"
        lines.append(f"{how}: step {exact['step_seconds']:,.3g} s, MFU {percent(exact['mfu'])} (exact count), "
                     f"{percent(full['mfu'])} (every layer global), {exact['tokens_per_second_per_chip']:,.0f} tokens/s "
                     "per chip")
    if r.get("step_time"):
        from olmax.scale.plan import format_prediction

        lines += format_prediction(r["step_time"])
    lines.append(f"compiled before, in {r['compile_seconds']:,.0f} s: this time the program came from the compile cache"
                 if r.get("compile_cached") else f"compile {r['compile_seconds']:,.0f} s")
    return "\n".join(lines)
