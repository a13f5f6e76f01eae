"""The allocation as `zpd slurm` reads it: Slurm's CPU counts, NodeAddr, where each
worker goes, the RDMA device map (zpd/ops/slurm_nodes.py)."""
from __future__ import annotations

import pytest

from zpd.ops.slurm_nodes import (Node, allocation, as_ip, control_cpus, cpus_per_node, ib_devices,
                                 node_addr, place, step_cpus, step_mem_per_cpu)


def test_cpus_per_node_reads_slurms_repeats():
    assert cpus_per_node("2(x3)", 3) == [2, 2, 2]
    assert cpus_per_node("64,32(x2),8", 4) == [64, 32, 32, 8]
    with pytest.raises(ValueError, match="names 2 nodes, the job has 3"):
        cpus_per_node("2(x2)", 3)
    with pytest.raises(ValueError, match="not Slurm's format"):
        cpus_per_node("2x3", 1)


def test_node_addr_is_slurms_nodeaddr():
    text = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1\n"
            "   NodeAddr=10.1.2.3 NodeHostName=vm Version=22.05.8\n")
    assert node_addr(text, "n2") == "10.1.2.3"
    assert node_addr("NodeName=gpu7 State=IDLE", "gpu7") == "gpu7"


def test_workers_take_the_nodes_after_the_first_then_the_first():
    assert place(3, 2) == [1, 2]                 # 1P1D on three nodes: n2, n3
    assert place(4, 4) == [1, 2, 3, 0]           # 2P2D on four nodes: node 0 takes the last
    assert place(5, 4) == [1, 2, 3, 4]           # 2P2D on five: one each, node 0 for the router
    assert place(2, 3) == [1, 0, 1]
    assert place(1, 2) == [0, 0]
    assert step_cpus(64, 2) == 32 and step_cpus(1, 3) == 1


def test_ib_device_map_is_checked_by_name():
    assert ib_devices("n1=mlx5_0 n2=mlx5_1,mlx5_2", ["n1", "n2"]) == {
        "n1": "mlx5_0", "n2": "mlx5_1,mlx5_2"}
    assert ib_devices("", ["n1"]) == {}
    with pytest.raises(ValueError, match="'n9' is not in the job"):
        ib_devices("n9=mlx5_0", ["n1", "n2"])
    with pytest.raises(ValueError, match="'n1' is not NODE=DEVICE"):
        ib_devices("n1", ["n1"])


def test_outside_a_job_the_error_says_where_to_run():
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set: run inside a Slurm job"):
        allocation({})


def test_a_nodeaddr_that_names_a_host_is_resolved():
    assert as_ip("127.0.0.1") == "127.0.0.1" and as_ip("::1") == "::1"
    assert as_ip("localhost") in ("127.0.0.1", "::1")
    with pytest.raises(ValueError, match="NodeAddr 'no-such-node.invalid' does not resolve"):
        as_ip("no-such-node.invalid")


def test_where_the_job_holds_memory_each_step_takes_its_cpus_share():
    node = Node("n1", "127.0.0.1", 4)
    assert step_mem_per_cpu({}, node) == 0                      # no --mem-per-cpu at all
    assert step_mem_per_cpu({"SLURM_MEM_PER_NODE": "1000"}, node) == 250
    assert step_mem_per_cpu({"SLURM_MEM_PER_CPU": "300"}, node) == 300


def test_the_routers_and_front_keep_cpus_only_where_the_workers_still_get_theirs():
    assert control_cpus(1, 2, 0) == 2          # -N3 1P1D on 2-CPU nodes: router and front
    assert control_cpus(2, 2, 0) == 0          # --routers 2: three steps on two CPUs overlap
    assert control_cpus(1, 2, 1) == 0          # -N2: the decode shares node 0
    assert control_cpus(1, 64, 1) == 2         # a GPU node's CPUs suffice for all
