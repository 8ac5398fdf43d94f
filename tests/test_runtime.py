"""A training process restarts itself once with glibc's malloc on huge pages, with its arguments intact; on a
machine without TPUs, commands leave libtpu alone (the `aot` extra installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmax.data.synthetic import write_synthetic_shards
from olmax.runtime import GOOGLE_PCI_VENDOR, HUGE_PAGES, NVIDIA_DEVICES, huge_pages_env, libtpu_lock_holder

PROBE = (
    "import os, sys\n"
    "print('started', flush=True)\n"
    "from olmax.runtime import restart_with_huge_pages\n"
    "restart_with_huge_pages()\n"
    "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n"
)

needs_huge_pages = pytest.mark.skipif(
    "GLIBC_TUNABLES" not in huge_pages_env({}), reason="no glibc >= 2.35 or no transparent huge pages here")


def probe(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OLMAX_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", PROBE, "train", "a b", "x=1"], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@needs_huge_pages
def test_restarts_once_with_the_tunable_and_the_same_arguments():
    assert probe() == ["started", "started", f"{HUGE_PAGES} ['train', 'a b', 'x=1']"]


@needs_huge_pages
def test_other_tunables_are_kept_and_a_set_one_is_not_overridden():
    assert probe(GLIBC_TUNABLES="glibc.malloc.tcache_count=0")[-1].startswith(
        f"glibc.malloc.tcache_count=0:{HUGE_PAGES} ")
    assert probe(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == ["started", "glibc.malloc.hugetlb=0 ['train', 'a b', 'x=1']"]


def test_opt_out_leaves_the_process_alone():
    assert probe(OLMAX_HUGE_PAGES="0") == ["started", "None ['train', 'a b', 'x=1']"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the aot extra (libtpu)")
@pytest.mark.slow
@pytest.mark.skipif(any(v.read_text().strip() == GOOGLE_PCI_VENDOR for v in Path("/sys/bus/pci/devices").glob(
    "*/vendor")) or any(map(os.path.exists, NVIDIA_DEVICES)), reason="a TPU or GPU may be attached")
def test_without_tpus_train_leaves_libtpu_alone_and_compile_runs_beside_it(tmp_path):
    """JAX left to choose its platforms (no JAX_PLATFORMS): `olmax train` neither loads libtpu (no probing lines,
    no lockfile) nor stops a TPU compile running at the same time."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"OLMAX_HUGE_PAGES": "0"}
    shards = write_synthetic_shards(tmp_path / "mix", vocab_size=512, eos_id=0, n_tokens=50_000, n_shards=1, seed=0)
    olmax = [sys.executable, "-m", "olmax.cli"]
    out, err = tmp_path / "train.out", tmp_path / "train.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: a full pipe would block the run
        train = subprocess.Popen([*olmax, "train", "tiny", "mesh.fsdp=1", f"data.paths={json.dumps(shards)}",
                                  f"output_dir={tmp_path / 'run'}", "train.steps=100000", "train.log_every=1",
                                  "checkpoint.every=10000"], stdout=stdout, stderr=stderr, text=True, env=env)
    try:
        steps = wait_for_steps(train, out, err, at_least=1)
        maps = Path(f"/proc/{train.pid}/maps").read_text()
        assert "libtpu" not in maps and libtpu_lock_holder() != train.pid
        compiled = subprocess.run([*olmax, "compile", "tiny", "--target", "tpu:v5p:2x2x2"], capture_output=True,
                                  text=True, env=env, timeout=600)
        assert compiled.returncode == 0, compiled.stderr[-3000:]
        assert train.poll() is None, "the run stopped during the compile: " + err.read_text()[-3000:]
        wait_for_steps(train, out, err, at_least=steps + 1)
    finally:
        train.kill()
        train.wait(timeout=60)
    assert "TPU" not in err.read_text() and "libtpu" not in err.read_text(), err.read_text()[-3000:]


def wait_for_steps(proc: subprocess.Popen, out: Path, err: Path, at_least: int, timeout: float = 600) -> int:
    """The number of step lines in `out` once it is at least `at_least`; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = sum(line.startswith("step ") for line in out.read_text().splitlines())
        if steps >= at_least:
            return steps
        assert proc.poll() is None, f"train exited {proc.returncode}: " + err.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no step {at_least} in {timeout} s: " + out.read_text()[-2000:] + err.read_text()[-2000:])


HELD = (
    "import os, signal, threading, time\n"
    "from olmax.runtime import hold_stop_signals, release_stop_signals, restart_with_huge_pages\n"
    "hold_stop_signals()\n"
    "if 'glibc.malloc.hugetlb' not in os.environ.get('GLIBC_TUNABLES', ''):\n"
    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # as numpy's, started while held\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    print('pending', signal.SIGINT in signal.sigpending(), flush=True)\n"
    "    restart_with_huge_pages()\n"
    "signal.signal(signal.SIGINT, lambda *_: print('handled', flush=True))\n"
    "release_stop_signals()\n"
    "print('done', flush=True)\n"
)


def test_a_stop_signal_at_start_up_waits_for_its_handler_whatever_thread_and_across_the_restart():
    """No thread started after the hold can take the signal (and lose it in the huge-pages exec): it stays
    pending, in this process or the one it becomes, until the handler is installed and released."""
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OLMAX_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", HELD], env=base, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines() == ["pending True", "handled", "done"], out


def test_the_libtpu_lock_holder_is_found(tmp_path, monkeypatch):
    """libtpu locks its lockfile with a POSIX lock; the holder's PID names it in the one-line error that replaces
    libtpu's advice to delete the file."""
    import fcntl

    from olmax import runtime

    monkeypatch.setattr(runtime, "LIBTPU_LOCKFILE", tmp_path / "libtpu_lockfile")
    assert runtime.libtpu_lock_holder() is None
    with open(tmp_path / "libtpu_lockfile", "w") as lockfile:
        assert runtime.libtpu_lock_holder() is None
        fcntl.lockf(lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert runtime.libtpu_lock_holder() == os.getpid()


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None or any(map(os.path.exists, NVIDIA_DEVICES)),
                    reason="needs JAX's CUDA plugin (the aot-gpu extra) on a machine without an NVIDIA GPU")
def test_with_the_cuda_plugin_a_cpu_command_prints_nothing_of_its_start_up():
    """The plugin's native code wrote `cudart_stub.cc ... Could not find cuda drivers` and absl's pre-init
    warning to stderr four times in every command: at JAX's import and when its plugins register."""
    code = "import sys; from olmax.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "flops", "tiny", "--json"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout)["params"] > 0
    assert out.stderr == ""


ENDING = (
    "import atexit, sys, threading, time\n"
    "from olmax.runtime import end_process\n"
    "out = sys.argv[1]\n"
    "def slow_write():\n"
    "    time.sleep(0.3)\n"
    "    open(out, 'a').write('thread\\n')\n"
    "class Torn:\n"
    "    def __del__(self):\n"
    "        open(out, 'a').write('teardown\\n')\n"
    "kept = Torn()\n"
    "atexit.register(lambda: open(out, 'a').write('atexit\\n'))\n"
    "threading.Thread(target=slow_write).start()\n"
    "print('printed', end='')\n"
    "end_process(75)\n"
)


def test_a_training_process_ends_as_python_does_less_the_interpreters_teardown(tmp_path):
    """A thread still writing finishes, exit handlers run after it, output is flushed and the exit code kept; what
    the interpreter's teardown would do (here an object's finalizer) does not happen."""
    out = tmp_path / "order"
    done = subprocess.run([sys.executable, "-c", ENDING, str(out)], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (75, "printed")
    assert out.read_text().splitlines() == ["thread", "atexit"]


def test_a_process_start_is_known_to_the_clock_tick():
    """What the goodput record counts from: the process's creation, between the moment it was asked for and the
    moment it ran (before, /proc/stat's whole-second boot time put it up to a second early)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    code = "from olmax.train.goodput import process_start_time; print(repr(process_start_time()))"
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    after = time.time()
    started = float(child.communicate()[0])
    assert before - tick <= started <= after + tick


# A SIGTERM at every line the stop handler runs, each handled at once by the same handler (nested): what a repeated
# SIGTERM does when it comes while the first one's handler runs. A handler that takes a lock (threading.Event.set)
# waits there for itself; faulthandler then ends the process with its stacks instead of a hung test.
NESTED_SIGNALS = """
import faulthandler, os, signal, sys
faulthandler.dump_traceback_later(60, exit=True)
from olmax.runtime import preemption_signals

def every_line(frame, event, arg):
    if event == "line":
        os.kill(os.getpid(), signal.SIGTERM)
    return every_line

with preemption_signals() as stop:
    handler, nested = signal.getsignal(signal.SIGTERM), []

    def again(signum, frame):
        trace = sys.gettrace()
        sys.settrace(None)
        handler(signum, frame)
        nested.append(signum)
        sys.settrace(trace)

    def first(signum, frame):
        signal.signal(signal.SIGTERM, again)
        sys.settrace(every_line)
        handler(signum, frame)
        sys.settrace(None)

    signal.signal(signal.SIGTERM, first)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    print(len(nested) > 0, stop.came)
"""


def test_a_signal_while_the_stop_handler_runs_is_taken_too():
    """The stop handler takes no lock: SIGTERMs that come while it runs, at any of its lines, are handled at once
    (deterministic: each line of the first handler delivers one), and the run stops as asked."""
    done = subprocess.run([sys.executable, "-c", NESTED_SIGNALS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr[-3000:]
