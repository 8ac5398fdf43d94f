"""The watchdog of multi-process runs: its timeout rule, and two real processes (jax.distributed, gloo on
127.0.0.1) of which one is frozen with SIGSTOP in the middle of its collectives: the other ends within the
timeout, exit 75, naming the frozen one."""

import os
import signal
import subprocess
import sys
import time

import pytest

from olmax.launch.supervisor import free_port
from olmax.train.watchdog import STEP_FACTOR, Watchdog, hang_timeout
from testlib import child_env


def test_the_timeout_is_the_floor_until_steps_are_slow_enough_then_a_multiple_of_the_slowest():
    assert hang_timeout(60, []) == 60
    assert hang_timeout(60, [1.0, 2.0, 0.5]) == 60
    assert hang_timeout(60, [1.0, 20.0, 0.5]) == 20 * STEP_FACTOR


def test_intervals_are_measured_between_beats_so_the_first_step_s_compilation_is_not_one():
    watchdog = Watchdog(30, 75)
    assert watchdog.timeout() == 30 and watchdog.last_beat is None  # not armed while the first step compiles
    watchdog.beat(1)
    assert watchdog.intervals == []
    watchdog.last_beat -= 10.0  # the second step took 10 s
    watchdog.beat(2)
    assert watchdog.step == 2 and watchdog.intervals[0] == pytest.approx(10.0, abs=0.5)
    assert watchdog.timeout() == pytest.approx(10.0 * STEP_FACTOR, abs=2.5)


# Each process: steps of one all-gather across both, a beat after each; "step 20" once it has done 20.
STEPPER = """
import numpy as np
from jax.experimental import multihost_utils
from olmax.launch.distributed import join_cluster
join_cluster()
from olmax.train.watchdog import watching
with watching(FLOOR, 75) as watchdog:
    for step in range(1, 10**9):
        multihost_utils.process_allgather(np.int32(step))
        watchdog.beat(step)
        if step == 20:
            print("step 20", flush=True)
"""
FLOOR = 5.0


@pytest.mark.slow
def test_a_frozen_process_ends_the_other_with_exit_75_naming_it(tmp_path):
    env = child_env(1, OLMAX_COORDINATOR=f"127.0.0.1:{free_port()}", OLMAX_NUM_PROCESSES="2")
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", STEPPER.replace("FLOOR", str(FLOOR))],
                                          env={**env, "OLMAX_PROCESS_ID": str(i)}, stdout=out, stderr=subprocess.STDOUT))
    try:
        while "step 20" not in logs[1].read_text():
            assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        # The bound of the contract: the timeout plus one minute (the machine may be loaded).
        code = procs[0].wait(timeout=FLOOR + 60)
        detected = time.monotonic() - frozen
    finally:
        for p in procs:
            p.kill()
            p.wait()
    output = logs[0].read_text()
    assert code == 75, output[-3000:]
    [line] = [x for x in output.splitlines() if x.startswith("olmax: watchdog:")]
    assert "process 0 of 2 finished no step for" in line and "process 1 on " in line, line
    assert "stopped making progress (its heartbeat stood still" in line and "exiting 75" in line, line
    assert detected >= FLOOR
    print(f"\nfrozen process detected after {detected:.1f} s (floor {FLOOR} s): {line}")
