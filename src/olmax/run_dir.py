"""A run directory, local or in a bucket: the one place that names the files of a run.

    RUN/                   output_dir: a local directory or a bucket URL (gs://, s3://)
      checkpoints/N/       the state after step N (olmax.checkpoint); in a bucket, committed by its marker
      metrics.jsonl        one JSON record per logged step (olmax.train.metrics)
      tensorboard/events*  the same metrics as TensorBoard event files
      goodput.json         the run's wall time by category, over its attempts (olmax.train.goodput)
      goodput.png          `olmax goodput RUN`'s chart of them
      wandb.json           the id of the run's Weights & Biases run (olmax.train.wandb_log)
      wandb/               W&B's own files: its logs, and offline its runs' records (`wandb sync` uploads them)
      page/                `olmax report RUN`'s page of the run: index.html, report.json (olmax.train.run_page)
      run.lock             the lock of the process that holds the run, or a bucket run's lease (olmax.run_lock)
      committed.json       a bucket run's own record of its newest committed step (olmax.train.bucket_run)
      logs/host-NN.log     each process's log (olmax.launch.distributed)
      launch.jsonl         `olmax launch`'s attempts (olmax.launch); with the two below, in
      slurm/job.sh, JOBID.out  launch.records_dir when that is set, and runs/SCHEME/BUCKET/PATH here for a run in a bucket
      jobset.yaml          (a bucket has no appending) or on a TPU pod's or a JobSet's hosts

Everything else asks a `RunDir` for a path (`RunDir(cfg.run_location).metrics`), its committed checkpoint
steps, its metrics records or its lock file; nothing else spells these names. A new file of a run is one line
in `RunDir`'s table (`goodput = File("goodput.jsonl")`; then `run.goodput` is its path) and its line above.

olmax writes its files there, and every other file it writes over (a page, a plot, a table), through an `OwnDir`:
the directory opened once, never through a symbolic link at its own name, and every file created, written and
renamed relative to that handle (`write_files`, `write_own` for a path or a URL, `replace_own`, `open_own`,
`own_dir`). A link where olmax expects its own file or directory (planted by whoever else can write there, before
the command or while it runs) would have it truncate or overwrite the link's target, and a directory renamed away
with a link put in its place would have it write into the link's target: the link is refused (RunDirError, exit 2)
naming it, as is a directory where olmax writes a file; a directory swapped while olmax writes in it keeps what
is written. A full disk while writing one is DiskFull (exit 74) naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import re
import stat
import time
from pathlib import Path

from olmax import storage
from olmax.errors import DiskFull, RunDirError

log = logging.getLogger(__name__)

STEP = re.compile(r"0|[1-9][0-9]*")  # a checkpoint step's directory name, as Orbax writes and reads it


class File:
    """A path in every run directory: `run.NAME` is that path of `run`, `RunDir.NAME.name` the relative path."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, run: RunDir | None, owner=None):
        return self if run is None else run.path(self.name)


class RunDir:
    """The paths of one run directory: a Path for a local one, a URL (str) for one in a bucket."""

    checkpoints = File("checkpoints")
    metrics = File("metrics.jsonl")
    tensorboard = File("tensorboard")
    goodput = File("goodput.json")
    goodput_plot = File("goodput.png")
    events = File("tensorboard/events")  # the event files' prefix
    lock = File("run.lock")
    logs = File("logs")
    launch_records = File("launch.jsonl")
    slurm_script = File("slurm/job.sh")
    jobset = File("jobset.yaml")
    committed_record = File("committed.json")  # a bucket run's record of its newest committed step (train.bucket_run)
    wandb_record = File("wandb.json")
    wandb_files = File("wandb")
    page = File("page")

    METRIC_FILES = (metrics.name, tensorboard.name, goodput.name, wandb_record.name)  # what a bucket run uploads as it goes and `compare` reads

    def __init__(self, location: str | os.PathLike):
        self.remote = storage.is_remote(location)
        self.location = str(location).rstrip("/") if self.remote else Path(location)

    def __repr__(self) -> str:
        return f"RunDir({str(self.location)!r})"

    def path(self, name: str):
        return storage.join(self.location, name) if self.remote else self.location / name

    def refuse_links(self) -> None:
        """RunDirError naming the run directory, or the first of its own files and directories (and their
        `.partial` files), or of what is in its checkpoints directory (a step's directory: Orbax refuses to delete a
        link when the step is no longer kept, failing the run), that is a symbolic link: called before anything is
        written (see the module's doc)."""
        if not self.remote:
            refuse_link(self.location)
        for value in vars(RunDir).values():
            if isinstance(value, File):
                parts = value.name.split("/")
                for depth in range(1, len(parts) + 1):  # slurm/, then slurm/job.sh
                    refuse_link(self.path("/".join(parts[:depth])))
                refuse_link(self.path(value.name + PARTIAL))
        if os.path.isdir(self.checkpoints):
            for entry in os.scandir(self.checkpoints):
                refuse_link(entry.path)

    def checkpoint_meta(self, step: int):
        """The meta of checkpoint `step` (step, tokens, data position, the resolved config): the JSON file Orbax's
        JsonSave writes for the checkpoint's `meta` item."""
        return self.path(f"{self.checkpoints.name}/{step}/meta/metadata")

    def host_log(self, process: int) -> Path:
        return self.logs / f"host-{process:02d}.log"

    def slurm_output(self, job: str) -> Path:
        """The output of Slurm job `job` (`%j` in a batch script: Slurm fills in the job id)."""
        return self.slurm_script.parent / f"{job}.out"

    def committed_steps(self) -> list[int]:
        """The steps of the run's committed checkpoints, in order (see `committed_steps`); none in a bucket that
        does not exist yet."""
        if self.remote and not storage.is_dir(self.checkpoints):
            return []
        return committed_steps(self.checkpoints)

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, None if there is none."""
        return max(self.committed_steps(), default=None)

    def metric_records(self) -> list[str]:
        """The lines of metrics.jsonl (a local run's), without any that is not a JSON record with a step (a line
        torn by a crash mid-write), each dropped with a warning."""
        lines = []
        text = self.metrics.read_text(errors="replace") if self.metrics.exists() else ""
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                if isinstance(json.loads(line)["step"], int):
                    lines.append(line)
                    continue
            except (ValueError, KeyError, TypeError):
                pass
            log.warning("%s:%d is not a whole metrics record (torn by a crash mid-write?); dropped: %.80r",
                        self.metrics, number, line)
        return lines


PARTIAL = ".partial"  # the suffix of a file being written, renamed over the file when whole (`OwnDir.write`)
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def refuse_link(path: str | os.PathLike) -> None:
    """RunDirError when `path` is a symbolic link, where olmax writes a file or directory of its own (one readlink:
    a link removed between a test and a read of its target is no error)."""
    try:
        target = os.readlink(path)
    except OSError:  # not a link (EINVAL), or nothing there
        return
    raise RunDirError(_link_words(path, target))


def _link_words(path, target: str) -> str:
    return (f"{path} is a symbolic link (to {target}) where olmax writes its own file; it follows no link where it "
            "writes: remove the link, or have olmax write elsewhere")


@contextlib.contextmanager
def writing(path: str | os.PathLike):
    """A full disk while writing `path`, as DiskFull naming it."""
    try:
        yield
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise DiskFull(f"disk full writing {path}: free space and run again") from None


class OwnDir:
    """A local directory olmax writes files of its own in, opened once: made if missing (with its missing parents),
    never through a symbolic link at its own name or at a directory made here (the directories above it that exist
    are the user's path, followed). Every file in it is then checked, created, written and renamed relative to
    this handle, so a rename of the directory, or a link put in its place, while olmax writes moves no byte
    elsewhere: what was opened is what is written (the checks by name saw only the last component of a path)."""

    def __init__(self, path: str | os.PathLike, make: bool = True):
        self.path = Path(path)
        self.fd = _open_dir(self.path, make)

    def __enter__(self) -> OwnDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check(self, *names: str) -> None:
        """RunDirError naming the first of `names` (files olmax writes whole, see `write`) that is a symbolic link
        or a directory, or whose NAME.partial is one: a writer of several files checks them all first, so that
        none is written when a later one would be refused."""
        for name in names:
            for each in (name, name + PARTIAL):
                try:
                    kind = os.stat(each, dir_fd=self.fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(kind):
                    try:
                        target = os.readlink(each, dir_fd=self.fd)
                    except OSError:
                        target = "a target removed since"
                    raise RunDirError(_link_words(self.path / each, target))
                if stat.S_ISDIR(kind):
                    raise RunDirError(f"{self.path / each} is a directory where olmax writes a file of its own; move "
                                      "it away, or have olmax write elsewhere")

    def write(self, name: str, data: str | bytes) -> None:
        """Write NAME whole (text as UTF-8): into a new NAME.partial (O_EXCL: never through a link), renamed over
        NAME, so that a crash leaves the old file or the new one. Neither may be a symbolic link nor a directory,
        when the write starts and again when it ends (a link planted between the last check and the rename is
        replaced itself, never followed); a refused or failed write leaves no NAME.partial."""
        partial = name + PARTIAL
        self.check(name)
        with writing(self.path / name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial, dir_fd=self.fd)  # left by a process killed while writing it
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=self.fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data.encode() if isinstance(data, str) else data)
                self.check(name)  # what was planted there while the file was written
                os.replace(partial, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial, dir_fd=self.fd)
                self.check(name)  # a directory made there since the check: named, not IsADirectoryError
                raise

    def create(self, name: str, data: str | bytes) -> None:
        """Write NAME, a new file (FileExistsError when anything is there, a link included)."""
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd)
        with writing(self.path / name), os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    def open(self, name: str, append: bool = False):
        """NAME opened for writing text (created, or truncated unless `append`), not through a symbolic link."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR):
                self.check(name)
            raise
        return os.fdopen(fd, "a" if append else "w")


def _open_dir(given: Path, make: bool) -> int:
    """A handle of the directory `given`: its existing parents followed, each directory from there on (made when
    missing and `make`) opened relative to the one above through no link."""
    path = Path(os.path.abspath(given))
    existing, below = path.parent, [path.name]
    while make and existing != existing.parent and not existing.exists():
        existing, below = existing.parent, [existing.name, *below]
    if not path.name:  # the root
        return os.open(path, DIRECTORY)
    fd = os.open(existing, DIRECTORY)
    try:
        for depth, name in enumerate(below):
            child = _open_below(fd, name, make, given if depth == len(below) - 1 else existing.joinpath(*below[:depth + 1]))
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


TRIES = 3  # opens of a directory whose name changes meanwhile (made, renamed away) before it is refused


def _open_below(fd: int, name: str, make: bool, where: Path) -> int:
    """The directory NAME in the directory `fd` (made when missing and `make`) opened through no link; RunDirError
    naming `where` when a link or a file is there."""
    for _ in range(TRIES):
        if make:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=fd)
        try:
            return os.open(name, DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            if not make:
                raise
            continue  # renamed away since it was made: made again
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY's answer to a link may be either
                raise
        try:
            kind = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(kind):
            try:
                target = os.readlink(name, dir_fd=fd)
            except OSError:
                target = "a target removed since"
            raise RunDirError(_link_words(where, target))
        if not stat.S_ISDIR(kind):
            raise RunDirError(f"{where} is a file where olmax writes a directory of its own; move it away, or have "
                              "olmax write elsewhere")
    raise RunDirError(f"{where} was renamed or replaced each of the {TRIES} times olmax opened it, while it writes "
                      "there: stop what moves it, or have olmax write elsewhere")


def check_own_files(*paths: str | os.PathLike) -> None:
    """`OwnDir.check` of local files by their paths (a bucket URL has no links), each in its directory as it is now
    (one that does not exist yet has nothing to refuse): a command checks what it will write before its work."""
    for path in paths:
        if storage.is_remote(path):
            continue
        path = Path(path)
        try:
            with OwnDir(path.parent, make=False) as directory:
                directory.check(path.name)
        except (FileNotFoundError, NotADirectoryError):
            continue


def open_own(path: str | os.PathLike, append: bool = False):
    """`path` opened for writing text (created, or truncated unless `append`), not through a symbolic link, in its
    directory opened as an `OwnDir` (which must exist)."""
    path = Path(path)
    with OwnDir(path.parent, make=False) as directory:
        return directory.open(path.name, append)


def replace_own(path: str | os.PathLike, data: str | bytes) -> None:
    """`OwnDir.write` of `path` in its directory (which must exist)."""
    path = Path(path)
    with OwnDir(path.parent, make=False) as directory:
        directory.write(path.name, data)


def drawn(draw) -> bytes:
    """The bytes `draw(file)` writes into a file in memory (a figure's savefig), for `write_own`."""
    buffer = io.BytesIO()
    draw(buffer)
    return buffer.getvalue()


def write_own(path: str | os.PathLike, data: str | bytes) -> None:
    """A file of olmax's own written whole at `path`, a local path (its directory made if missing; see `OwnDir`)
    or a bucket URL (one object)."""
    if storage.is_remote(path):
        storage.write_bytes(str(path), data.encode() if isinstance(data, str) else data)
        return
    path = Path(path)
    with OwnDir(path.parent) as directory:
        directory.write(path.name, data)


def write_files(directory: str | os.PathLike, files: dict[str, str | bytes]) -> None:
    """Files of olmax's own ({name: content}) written whole into `directory`, a local one (made if missing, opened
    once: see `OwnDir`) or a bucket URL (one object each); on disk, none is written when one would be refused."""
    if storage.is_remote(directory):
        for name, data in files.items():
            write_own(storage.join(str(directory), name), data)
        return
    with OwnDir(directory) as own:
        own.check(*files)
        for name, data in files.items():
            own.write(name, data)


def set_aside(path: Path) -> Path:
    """Rename `path`, a file olmax cannot use, out of its way (PATH.damaged-TIME), kept for a person to look at;
    the new path."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(path, aside)
    return aside


def own_dir(path: str | os.PathLike) -> Path:
    """The directory `path` (made with its parents if missing), refused when it is a symbolic link (see `OwnDir`)."""
    OwnDir(path).close()
    return Path(path)


def committed_steps(checkpoints: str | os.PathLike) -> list[int]:
    """The committed steps of a checkpoints directory, in order (olmax.checkpoint.Checkpointer lists its steps
    here too): on disk, the directories named by their step, as Orbax names them (it writes a step into a
    temporary directory, `N.orbax-checkpoint-tmp-*`, and renames it to `N` when complete); in a bucket, the step
    prefixes with their commit marker (storage.COMMIT_MARKER, uploaded last; an uncommitted one is named in a
    warning)."""
    if not storage.is_remote(checkpoints):
        directory = Path(checkpoints)
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if STEP.fullmatch(p.name) and p.is_dir())
    steps = []
    for name in storage.listdir(checkpoints):
        if not STEP.fullmatch(name):
            continue
        if storage.committed(storage.join(checkpoints, name)):
            steps.append(int(name))
        else:
            log.warning("%s has no commit marker (its upload was cut short); not a checkpoint, skipped",
                        storage.join(checkpoints, name))
    return sorted(steps)
