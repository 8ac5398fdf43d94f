"""The coordinator of a multi-process run: its address from the cluster's description, resolved by each node,
and the error that names it when it cannot be reached."""

import subprocess
import sys

import pytest
from jax._src.clusters.slurm_cluster import SlurmCluster

from olmax.launch.distributed import ClusterError, coordinator_address
from olmax.launch.supervisor import free_port
from testlib import child_env


def test_the_first_node_of_the_slurm_node_list_is_resolved_to_an_address(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4096")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost,node-b")
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    # JAX's port for job 4096: 4096 % 4096 + 61440
    assert coordinator_address(SlurmCluster) in ("127.0.0.1:61440", "[::1]:61440")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "olmax-no-such-node[1-2]")
    with pytest.raises(ClusterError, match="'olmax-no-such-node1:61440' does not resolve on "):
        coordinator_address(SlurmCluster)


def test_a_coordinator_that_does_not_answer_is_named_with_its_address_and_port(tmp_path):
    port = free_port()  # nobody listens there
    env = child_env(1, OLMAX_COORDINATOR=f"127.0.0.1:{port}", OLMAX_NUM_PROCESSES="2",
                    OLMAX_PROCESS_ID="1", OLMAX_COORDINATOR_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", "from olmax.launch.distributed import join_cluster; join_cluster()"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("olmax.errors.CoordinatorUnreachable: process 1 of 2 (OLMAX_* variables) on "), last
    assert f"could not reach the coordinator at address 127.0.0.1 port {port} within 2 s" in last, last
