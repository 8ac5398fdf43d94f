"""The `ray` engine of `olmax tokenize`: each task (olmax.data.tokenize_tasks) a Ray task, on the cluster at --address
or on a local Ray started for the command and stopped after it.

A task reads its inputs and writes its shards itself; the driver sends the tokenizer once, through Ray's object
store, and holds no text. A task whose worker process or node is lost is run again by Ray and resumes after its
last committed shard; a bad input fails the command (running it again fails the same way). Once a task has failed,
the others are asked to stop (an actor's flag, read before each chunk) and the command waits for them to end:
ray.cancel of a task that is finishing at that moment aborts the driver inside Ray ("Check failed: it !=
submissible_tasks_.end()"), and a task killed in the middle leaves its staging directory behind. Imported only for
`--engine ray`: nothing else needs Ray installed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from olmax.data.tokenize_tasks import Progress, ProgressLine, Settings, Task, init_worker, remove_staging, run_task
from olmax.errors import BadInput, DataError, OlmaxError

log = logging.getLogger(__name__)

# Runs of a task after a loss of its worker or node (spot nodes come and go over a long job); Ray's default is 3.
TASK_RETRIES = 5
POLL_S = 1.0  # how often the progress line is brought up to date


class _Report:
    """A task's progress, sent to the driver's counter (an actor) without waiting for it."""

    def __init__(self, counter):
        self.counter = counter

    def read(self, file: int, size: int) -> None:
        self.counter.read.remote(file, size)

    def wrote(self, documents: int, tokens: int) -> None:
        self.counter.wrote.remote(documents, tokens)


class _Stop:
    """The command's request to its tasks to stop, an actor: set once a task has failed."""

    def __init__(self):
        self.requested = False

    def request(self) -> None:
        self.requested = True

    def asked(self) -> bool:
        return self.requested


def _until_stopped(stop, encode, chunks):
    """map(encode, chunks), ending (an OlmaxError no one reads: the command already has its failure) before a chunk
    once the command asks its tasks to stop; should the flag's actor be lost, the task goes on to its end."""
    for chunk in chunks:
        try:
            asked = ray.get(stop.asked.remote())
        except ray.exceptions.RayActorError:
            asked = False
        if asked:
            raise OlmaxError("the command stopped its tasks")
        yield encode(chunk)


def _tokenize_task(task: Task, settings: Settings, tokenizer_json: str, counter, stop) -> dict:
    init_worker(tokenizer_json, settings.eos_id, settings.dtype, settings.skip_bad, one_of_many=True)
    return run_task(task, settings, functools.partial(_until_stopped, stop), _Report(counter))


def _show_progress(line: ProgressLine, counter):
    """Bring the progress line up to date from the counter; the counter, or None once it is lost (its process
    killed, or its node's agent): progress is not work, so the tasks go on, their reports to it unanswered."""
    if counter is None:
        return None
    try:
        line.show(ray.get(counter.totals.remote()))
    except ray.exceptions.RayActorError as err:
        log.warning("olmax: tokenize's progress counter, a Ray actor, was lost (%s); the tasks go on, the progress "
                    "line stops", type(err).__name__)
        return None
    return counter


@contextlib.contextmanager
def joined(address: str | None, workers: int | None, error: type[BadInput] = DataError):
    """Ray inside the block: the cluster at `address` (or RAY_ADDRESS), else a local one started with `workers`
    CPUs; shut down after it. An address no cluster answers at, or not an address, is `error`."""
    where = f"--address {address}" if address else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}"
    fix = "give the address of its head node (host:port, as `ray start --head` printed it)"
    try:
        ray.init(address=address, num_cpus=None if address else workers, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
    except ConnectionError as err:
        raise error(f"{where}: no Ray cluster answers there ({err}); {fix}") from None
    except ValueError as err:  # an address Ray cannot read
        raise error(f"{where}: not a Ray cluster's address ({str(err).splitlines()[0]}); {fix}") from None
    try:
        yield
    finally:
        ray.shutdown()


def run_on_ray(tasks: list[Task], settings: Settings, tokenizer_json: str, line: ProgressLine) -> dict[int, dict]:
    """The records of `tasks`, run as Ray tasks (one CPU each) on the Ray `joined`."""
    running = {}
    try:
        tokenizer = ray.put(tokenizer_json)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        counter = ray.remote(num_cpus=0, scheduling_strategy=here)(Progress).remote()
        stop = ray.remote(num_cpus=0, scheduling_strategy=here)(_Stop).remote()
        remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_tokenize_task)
        running = {remote.remote(task, settings, tokenizer, counter, stop): task.index for task in tasks}
        done = {}
        while running:
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=POLL_S)
            for ref in ready:
                done[running.pop(ref)] = ray.get(ref)
            counter = _show_progress(line, counter)
        return done
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, OlmaxError):
            raise err.cause from None
        raise
    except ray.exceptions.RayError as err:  # a task lost more often than it is retried, or Ray itself failing
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        lost = isinstance(err, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                                ray.exceptions.OutOfMemoryError))
        what = f"a tokenize task failed on Ray after {TASK_RETRIES} retries" if lost else "Ray failed the tokenize"
        raise OlmaxError(f"{what} ({type(err).__name__}: {first}); its committed shards stay: run the same command "
                         "again to resume") from None
    finally:
        if running:
            _stop_tasks(stop, list(running), settings.out)


def _stop_tasks(stop, refs: list, out: str) -> None:
    """Ask the tasks of `refs` to stop, wait for them to end, then remove the staging directories on disk that
    tasks whose worker was lost left in `out`."""
    try:
        ray.get(stop.request.remote())
    except ray.exceptions.RayActorError:  # lost: the tasks run to their ends
        log.warning("olmax: tokenize's stop flag, a Ray actor, was lost; waiting for the running tasks to end")
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    remove_staging(out)
