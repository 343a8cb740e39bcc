"""Layouts that cannot work fail before any worker starts, saying what to do instead."""

from __future__ import annotations

import pytest

from tandem.core.config import ParallelConfig
from tandem.core.errors import ConfigError
from tandem.core.parallel.topology import Mode, resolve_topology


def test_one_device_needs_no_choice() -> None:
    topo = resolve_topology(ParallelConfig())
    assert topo.mode is Mode.SINGLE_PROCESS and topo.world_size == 1


def test_neither_single_process_nor_master_address() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_topology(ParallelConfig(devices="cpu:0,cpu:1"))
    message = str(err.value)
    assert "TANDEM_ENABLE_SINGLE_PROCESS=1" in message and "--master-node-addr" in message


def test_tensor_parallel_size_must_match_the_devices() -> None:
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4 does not match.*2 per node"):
        resolve_topology(
            ParallelConfig(devices="cpu:0,cpu:1", tensor_parallel_size=4, single_process=True)
        )
    topo = resolve_topology(
        ParallelConfig(
            devices="cpu:0,cpu:1",
            tensor_parallel_size=4,
            single_process=True,
            nnodes=2,
            master_node_addr="127.0.0.1:1234",
        )
    )
    assert topo.world_size == 4 and topo.first_rank == 0


def test_single_process_refuses_a_process_global_backend() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_topology(
            ParallelConfig(devices="cpu:0,cpu:1", single_process=True, local_collectives="torch")
        )
    assert "process-global" in str(err.value) and "--local-collectives auto" in str(err.value)


def test_duplicate_devices() -> None:
    with pytest.raises(ConfigError, match="names a device twice"):
        resolve_topology(ParallelConfig(devices="cpu:0,cpu:0", single_process=True))


def test_contradictory_selectors() -> None:
    with pytest.raises(ConfigError, match="needs no --master-node-addr"):
        resolve_topology(
            ParallelConfig(devices="cpu:0,cpu:1", single_process=True, master_node_addr="h:1")
        )
    with pytest.raises(ConfigError, match="needs --master-node-addr"):
        resolve_topology(ParallelConfig(devices="cpu:0", single_process=True, nnodes=2))


def test_node_rank_range() -> None:
    with pytest.raises(ConfigError, match="--node-rank must be in"):
        ParallelConfig(nnodes=2, node_rank=2)


def test_modes() -> None:
    multi = resolve_topology(ParallelConfig(devices="cpu:0,cpu:1", master_node_addr="h:1"))
    assert multi.mode is Mode.MULTI_PROCESS and multi.world_size == 2
    node1 = resolve_topology(
        ParallelConfig(
            devices="cpu:0,cpu:1",
            single_process=True,
            master_node_addr="h:1",
            nnodes=2,
            node_rank=1,
        )
    )
    assert node1.first_rank == 2 and node1.world_size == 4


def test_torchrun_needs_single_process() -> None:
    with pytest.raises(ConfigError, match="--nproc-per-node 1"):
        resolve_topology(ParallelConfig(devices="cpu:0", master_node_addr="env://", nnodes=2))
