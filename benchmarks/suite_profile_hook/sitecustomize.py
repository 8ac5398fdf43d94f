"""Loaded by every Python process of a profiled test run (benchmarks/suite_profile.py puts this directory first on
PYTHONPATH): records where the process spends its time, as JSON lines in $SUITE_PROFILE_DIR/<pid>.jsonl, each
attributed to the test running when it happened ($PYTEST_CURRENT_TEST, inherited by the processes a test starts).

Kinds: start-up (process start until `jax` and until `olmax.cli` are imported, the later one counts; only for
processes a test started), compile-miss / compile-hit (XLA backend compiles, split by the persistent cache's answer), trace
(tracing and lowering to MLIR), train (time inside olmax.train.trainer.train, compiles included, and the steps it
ran), sleep
(time.sleep on the main thread). Lines are written as they happen, so a process killed with SIGKILL keeps what it recorded."""

import importlib.abc
import json
import os
import sys
import threading
import time

OUT = os.environ.get("SUITE_PROFILE_DIR")


def _record(kind: str, secs: float, **counts) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    with open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(json.dumps({"kind": kind, "secs": secs, "test": test, "child": _CHILD, **counts}) + "\n")


def _process_age() -> float:
    """Seconds since this process started (its start time in /proc, in clock ticks since boot)."""
    with open(f"/proc/{os.getpid()}/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after one of `hooks`' modules has executed (the module is then in sys.modules)."""

    def __init__(self, hooks):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module, hook = spec.loader.exec_module, self.hooks.pop(name)

                def exec_and_hook(module, exec_module=exec_module, hook=hook):
                    exec_module(module)
                    hook(module)
                spec.loader.exec_module = exec_and_hook
                return spec
        return None


def _started(_module) -> None:
    if _CHILD:
        _record("start-up", _process_age())


_state = threading.local()


def _listen_to_jax(_module) -> None:
    from jax._src import monitoring

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _state.hit = True

    def on_duration(event, secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            _record("compile-hit" if getattr(_state, "hit", False) else "compile-miss", secs)
            _state.hit = False
        elif event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"):
            _record("trace", secs)

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    _started(_module)


def _time_training(module) -> None:
    train = module.train

    def timed_train(*args, **kwargs):
        start, history = time.perf_counter(), []
        try:
            history = train(*args, **kwargs)
            return history
        finally:
            _record("train", time.perf_counter() - start, steps=len(history))
    module.train = timed_train


def _timed_sleep(secs, _sleep=time.sleep):
    if threading.current_thread() is not threading.main_thread():  # a helper thread: not what the test waits on
        return _sleep(secs)
    start = time.perf_counter()
    try:
        _sleep(secs)
    finally:
        _record("sleep", time.perf_counter() - start)


if OUT:
    _CHILD = bool(os.environ.get("PYTEST_CURRENT_TEST"))  # started by a test (not a pytest process itself)
    sys.meta_path.insert(0, _AfterImport({"jax": _listen_to_jax, "olmax.cli": _started,
                                          "olmax.train.trainer": _time_training}))
    time.sleep = _timed_sleep
