"""Process set-up of a training process: glibc's malloc backs its big buffers with huge pages.

XLA's CPU client mallocs the buffers of every step when the step starts and frees
them when it ends (3.4 GB of temporaries for the train-throughput benchmark's
model). glibc serves any allocation above 32 MB with a fresh mmap and unmaps it on
free, so every step page-faults all of that memory in again, 4 KiB at a time:
measured on the benchmark, 1.4-3.5 CPU-s of kernel time in each 5-7 s step. With
glibc's `glibc.malloc.hugetlb=1` tunable those mappings are transparent huge pages
(2 MiB), and the same steps spend 0.5 CPU-s in the kernel. Tunables are read when a
process starts, so `olmax train` and `olmax demo` start themselves again with it set.
Results do not change: only where memory comes from.

Set OLMAX_HUGE_PAGES=0 to leave glibc's defaults.

The CLI also holds SIGINT/SIGTERM from its first line on (`hold_stop_signals`):
they wait, blocked and pending, until a command is ready to stop cleanly
(`release_stop_signals`), so an interrupt during start-up (imports, config,
restore, compilation) neither prints a KeyboardInterrupt traceback nor kills the
process in the middle of XLA's work, and none is lost: blocked before any other
thread exists, they are blocked in every thread started later (numpy's, XLA's),
so no thread can take one and drop it, and pending signals survive the restart
above. `preemption_signals` is the handler a training process then runs: it
sets a flag and takes no lock.

Before any of that, `skip_absent_tpus` keeps JAX off its TPU backend on a machine
with no accelerator attached: with the `aot` extra installed, JAX would otherwise load
libtpu in every process that touches a device, which prints its probing for TPUs
and takes libtpu's one-process lockfile for the life of the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.abc
import importlib.util
import multiprocessing
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn

GLIBC = ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else None
GLIBC_HUGETLB = GLIBC is not None and tuple(map(int, platform.libc_ver()[1].split("."))) >= (2, 35)
HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips show up as Google's PCI devices (as JAX's hardware_utils finds them)
NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")  # JAX's test for a visible NVIDIA GPU
LIBTPU_LOCKFILE = Path("/tmp/libtpu_lockfile")  # libtpu's lock on the machine's TPU chips
CUDA_PLUGIN = "jax_cuda12_plugin"
LAUNCHER_STARTED = "OLMAX_LAUNCHER_STARTED"  # set by `olmax launch` for its first attempt: when the launcher started
CUDA_PLUGIN_NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc",
                     "Could not find cuda drivers on your machine")


def skip_absent_tpus() -> None:
    """Run JAX on the CPU (JAX_PLATFORMS=cpu, inherited by the processes this one starts) on a machine with
    neither a TPU nor an NVIDIA GPU attached: JAX, left to choose, tries every backend it knows, TPU first.
    A JAX_PLATFORMS already set is kept, and so is JAX's own choice where a GPU is, or any Google PCI device
    (a TPU, or only Google's network card: then the probing stays). Compiling for a TPU target loads libtpu
    without its backend (`scale.targets.compile_only_devices`)."""
    if "JAX_PLATFORMS" in os.environ or any(map(os.path.exists, NVIDIA_DEVICES)):
        return
    vendors = Path("/sys/bus/pci/devices").glob("*/vendor")
    if not any(vendor.read_text().strip() == GOOGLE_PCI_VENDOR for vendor in vendors):
        os.environ["JAX_PLATFORMS"] = "cpu"


def quiet_cuda_plugin() -> None:
    """Drop the CUDA plugin's start-up lines on a machine with no NVIDIA GPU where the plugin is installed (the
    aot-gpu extra, to compile for GPUs): its native code printed `Could not find cuda drivers on your machine`
    with absl's pre-init warning four times in every process, three when JAX loads and one when its plugins
    register. JAX is not loaded here (a command refusing bad input never loads it): the first `import jax`
    after this call loads it and registers its plugins with those lines dropped; registering creates no
    backend, so a multi-process run still joins its cluster first. Anything else written to stderr meanwhile is
    passed on. olmax's package import calls it, so a script using olmax's modules is quiet too."""
    if (any(map(os.path.exists, NVIDIA_DEVICES)) or "jax" in sys.modules
            or any(isinstance(finder, _QuietJaxImport) for finder in sys.meta_path)
            or importlib.util.find_spec(CUDA_PLUGIN) is None):
        return
    sys.meta_path.insert(0, _QuietJaxImport())


class _QuietJaxImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The first `import jax`: JAX's own loading, and its plugins' registration, with stderr caught and the CUDA
    plugin's lines dropped."""

    def find_spec(self, name, path, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                self.loader.exec_module(module)
                from jax._src import xla_bridge

                xla_bridge._discover_and_register_pjrt_plugins()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                    if not any(noise in line for noise in CUDA_PLUGIN_NOISE):
                        sys.stderr.write(line)


def libtpu_lock_holder() -> int | None:
    """The process holding libtpu's lockfile, if one does (libtpu's own error then says to delete the file)."""
    try:
        stat = LIBTPU_LOCKFILE.stat()
    except FileNotFoundError:
        return None
    file = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for fields in map(str.split, Path("/proc/locks").read_text().splitlines()):
        if fields[1] != "->" and fields[5] == file:  # "->": a process waiting for the lock
            return int(fields[4])
    return None


def hold_stop_signals() -> None:
    """Block SIGINT/SIGTERM in this thread and in the threads it starts from now on; call it first thing."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    """Unblock SIGINT/SIGTERM in this thread: those that came while held run the handlers installed now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopSignals:
    """Whether SIGTERM/SIGINT came: a plain attribute, set by the handler (this object). A handler runs on the main
    thread between two of its bytecodes, wherever that thread is, so it takes no lock: threading.Event.set took its
    condition's lock, which the main thread held when a second SIGTERM came while the first one's handler was
    inside Event.set (a deadlock, or a traceback in the handler)."""

    def __init__(self):
        self.came = False

    def __call__(self, signum, frame) -> None:
        self.came = True


@contextlib.contextmanager
def preemption_signals(acknowledge: Callable[[int], None] | None = None):
    """StopSignals, set by SIGTERM/SIGINT while inside, or already before when they arrived during start-up (signal
    handlers only exist on the main thread). Once it is set, SIGTERM keeps setting it after the block: the process
    is on its way out with its checkpoint written (olmax.cli keeps ignoring it as the process exits).

    `acknowledge(signal number)` is called at once for the first signal, from a thread of its own: the handler
    runs only when the main thread next runs Python, which a compile (a C++ call) holds off for tens of
    seconds. Python's C-level handler writes the signal's number to a wakeup file descriptor as it arrives."""
    stop = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    wakeup = _Acknowledger(acknowledge) if acknowledge else None
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    release_stop_signals()
    try:
        yield stop
    finally:
        if stop.came:  # stopping already: a repeated SIGTERM (srun ending a job's other tasks once one has
            del previous[signal.SIGTERM]  # exited 75, a second notice) must not cut the checkpointed exit short
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if wakeup:
            wakeup.close()


class _Acknowledger:
    """Calls `acknowledge` with the first stop signal's number as soon as it arrives (signal.set_wakeup_fd)."""

    def __init__(self, acknowledge: Callable[[int], None]):
        self.read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd's requirement: the handler never blocks
        self.previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self.write = write
        self.thread = threading.Thread(target=self._wait, args=(acknowledge,), name="olmax stop signal", daemon=True)
        self.thread.start()

    def _wait(self, acknowledge: Callable[[int], None]) -> None:
        while number := os.read(self.read, 1):  # empty once closed
            if number[0] in STOP_SIGNALS:
                acknowledge(number[0])
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous)
        os.close(self.write)
        self.thread.join()
        os.close(self.read)


class Terminated(KeyboardInterrupt):
    """SIGTERM where SIGINT is KeyboardInterrupt: the same stop (every `except KeyboardInterrupt` cleans up after
    it), ending the command with 143, 128 + SIGTERM, where SIGINT's ends it with 130."""


def raise_stop(signum: int, frame) -> None:
    """The handler of a command that stops where it is on SIGINT (KeyboardInterrupt) or SIGTERM (Terminated)."""
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def stopping_at_once(say: Callable[[str], None]):
    """Inside, SIGINT or SIGTERM ends the process at once, from a thread of its own as the signal arrives: `say`
    is told ("stopping (SIGINT)"), the processes multiprocessing started (compile workers) are killed, and the
    process exits 128 + the signal (130, 143) without unwinding. For work with nothing to save in which no
    exception can stop it: an XLA compile holds the main thread in C++ for minutes (the interrupt came when it
    ended: 12 minutes for the 7B on 128 v5p chips), and an exception raised in a callback is lost (jax's gc
    callback swallowed a KeyboardInterrupt, and one raised inside a C++ call aborted the process). Enter it once the
    work's modules are imported: importing jax's Pallas GPU ops installs absl's failure handler over SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int) -> None:
        name = signal.Signals(number).name
        say(f"stopping ({name})")
        for child in multiprocessing.active_children():
            child.kill()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + number)

    wakeup = _Acknowledger(stop)
    previous = {sig: signal.signal(sig, _noted) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        wakeup.close()


def _noted(signum: int, frame) -> None:
    """Python's part of a stop signal inside `stopping_at_once`: nothing (its thread acts on it)."""


def drop_held_signals() -> None:
    """Forget the stop signals that came while held: a command that has ended can no longer act on them."""
    while signal.sigtimedwait(STOP_SIGNALS, 0) is not None:
        pass


def end_process(code: int) -> NoReturn:
    """Exit a training process whose command has returned `code`: as Python's own exit does, its threads are
    joined (a checkpoint still being written finishes), its exit handlers run (its goodput record's last) and its
    output is flushed; then the process ends without the interpreter's teardown of jax's and XLA's objects, a
    second of nothing on the run's clock alone (measured on the tiny config, 2026-12-03) and three on a loaded
    machine, which no goodput record could account for."""
    threading._shutdown()  # what Python's exit does first: executors told to stop, non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def huge_pages_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with glibc's malloc asking the kernel for transparent huge pages, where it can."""
    tunables = env.get("GLIBC_TUNABLES", "")
    thp = THP_MODE.read_text() if THP_MODE.exists() else ""
    if not GLIBC_HUGETLB or "glibc.malloc.hugetlb" in tunables or not ("[always]" in thp or "[madvise]" in thp):
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """Replace this process by the same command with `huge_pages_env`, unless it has it already.

    Call it first thing: nothing done before it survives.
    """
    if os.environ.get("OLMAX_HUGE_PAGES", "1") == "0":
        return
    env = huge_pages_env(dict(os.environ))
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def process_start_time() -> float:
    """When this process started (Linux: /proc, to the clock tick), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return time.time()
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's btime is whole seconds
    return boot + ticks / os.sysconf("SC_CLK_TCK")
