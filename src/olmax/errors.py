"""How olmax commands end: the exit codes and every error olmax raises on purpose, free of imports so the CLI
can catch them without loading jax.

`ExitCode` is the contract between a command and whatever runs it: `olmax launch` (the supervisor, the
Slurm launcher), the Slurm job script and the Kubernetes JobSet read the codes from it, and the table of exit codes
in docs/reliability.md is checked against it. A new code is one line of it: the value, what `olmax launch` records
for it, and whether it runs the run again after it.

Every error below ends a command with its class's `exit_code` and the one line `olmax: {err.line()}`,
never a traceback. Every error meaning "the input is wrong" (a config, data file, checkpoint, HF directory,
eval set, target, cluster) derives from `BadInput` (exit 2); its message names the file, field or value and
the fix. The modules that raise an error import it from here.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    """An exit status, with `words` (what `olmax launch` records for a process that exits with it; None: a
    crash) and `retried` (whether `olmax launch` runs the run again after it)."""

    def __new__(cls, code: int, words: str | None, retried: bool):
        member = int.__new__(cls, code)
        member._value_ = code
        member.words, member.retried = words, retried
        return member

    FINISHED = 0, "finished", False
    FAILED = 1, None, True  # a crash, a failed check (resume-check, parity, compile); `olmax launch` gave up
    BAD_INPUT = 2, "bad input", False  # retrying cannot help
    DIVERGED = 3, "diverged", False  # the parameters are not finite: a resume would repeat the same steps bitwise
    STORAGE_UNAVAILABLE = 69, "storage unavailable", True  # EX_UNAVAILABLE: a store failed past storage.retry_seconds
    DISK_FULL = 74, "disk full", False  # EX_IOERR: only freeing space helps
    PREEMPTED = 75, "preempted", True  # EX_TEMPFAIL: stopped by a signal after a checkpoint; run again to resume
    INTERRUPTED = 130, None, True  # 128 + SIGINT, as a shell reports it: commands other than train and launch
    TERMINATED = 143, None, True  # 128 + SIGTERM: the same, for SIGTERM


NOT_RETRIED = tuple(int(code) for code in ExitCode if not code.retried and code != ExitCode.FINISHED)


class OlmaxError(Exception):
    """An error olmax raises on purpose: the command ends with `exit_code` and the one line `olmax: line()`."""

    exit_code = ExitCode.FAILED

    def line(self) -> str:
        return str(self)


class Preempted(OlmaxError):
    """SIGTERM/SIGINT arrived; the step in flight finished and a checkpoint was written (or nothing needed one)."""

    exit_code = ExitCode.PREEMPTED

    def line(self) -> str:
        return f"{self}; run the same command again to resume"


class Diverged(OlmaxError):
    """The parameters became NaN or infinite; no checkpoint of them was written."""

    exit_code = ExitCode.DIVERGED


class DiskFull(OlmaxError):
    """The disk filled up while a checkpoint was written; its partial write was removed."""

    exit_code = ExitCode.DISK_FULL


class DoesNotFit(OlmaxError):
    """The step needs more memory per device than the target has; `report` holds what is known."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report

    def line(self) -> str:
        return f"DoesNotFit: {self}"


class BadInput(OlmaxError, ValueError):
    """Input that cannot be used; the message names the file, field or value and the fix."""

    exit_code = ExitCode.BAD_INPUT

    def line(self) -> str:
        return f"{type(self).__name__}: {self}"


class ConfigError(BadInput):
    """A config that cannot describe a run; the message names the field and the fix."""


class TargetError(ConfigError):
    """A target olmax does not know, or the `aot` extra missing for it."""


class ClusterError(ConfigError):
    """This process belongs to a multi-process job but cannot join it."""


class CoordinatorUnreachable(OlmaxError):
    """Process 0's coordinator did not answer: it may not be up yet, or its node is gone; worth a retry (exit 1)."""


class SlurmError(ConfigError):
    """Slurm refused the job (or is not there): retrying the same submission cannot help."""


class StorageError(BadInput):
    """A store said no for good (missing object, denied, no bucket, unreachable) or kept failing past the
    retry budget; the message names the URL and what to check."""


class MissingObject(StorageError):
    """No such object or bucket."""


class MissingBucket(MissingObject):
    """No such bucket."""


class AlreadyExists(StorageError):
    """An exclusive write found the object there."""


class StorageUnavailable(StorageError):
    """Transient faults outlasted storage.retry_seconds: an outage, not bad input, so it has its own exit code
    and `olmax launch`, Slurm jobs and JobSets run the command again after a backoff."""

    exit_code = ExitCode.STORAGE_UNAVAILABLE


class LeaseLost(OlmaxError):
    """Another run took this run's bucket lease over; this one stopped, writing nothing more."""

    exit_code = ExitCode.PREEMPTED  # as a preemption: the other run goes on, or this one is run again later


class RunDirError(BadInput):
    """Another process holds the run directory, or it cannot be written; the message names the holder or the fix."""


class DataError(BadInput):
    """Bad data input; the message names the file or field and the fix."""


class CheckpointError(BadInput):
    """A checkpoint that cannot be used for this run; the message says why and what to do."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read or do not match their checksums (a torn or corrupted write)."""


class EvalError(BadInput):
    """An evaluation that cannot run as asked; the message says why and what to do."""


class InteropError(BadInput):
    """Input that cannot be converted or compared; the message names the file, field or tensors."""

