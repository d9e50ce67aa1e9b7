"""Launch-environment detection with patched environments (no MPI started)."""

import subprocess
from dataclasses import astuple

import pytest

from hpcddp.env import (
    SingleProcessEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    detect_environment,
    expand_nodelist,
)
from hpcddp.env.mpi import singleton_under_slurm

pytestmark = pytest.mark.unit


def test_plain_process_is_single():
    env = detect_environment({})
    assert isinstance(env, SingleProcessEnvironment)
    assert env.layout().world_size == 1


def test_torchrun_variables():
    environ = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
    }
    env = detect_environment(environ)
    assert isinstance(env, TorchrunEnvironment)
    assert astuple(env.layout()) == (5, 8, 1, 4, 1, 2)
    rendezvous = env.rendezvous()
    assert (rendezvous.address, rendezvous.port) == ("n1", 1234)


def test_torchrun_inside_srun_is_torchrun():
    environ = {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "job", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
    }  # fmt: skip
    env = detect_environment(environ)
    assert isinstance(env, TorchrunEnvironment)
    assert (env.layout().rank, env.layout().world_size) == (3, 8)


def slurm_step(**extra):
    base = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_ID": "0",
    }
    return {**base, **extra}


def test_srun_singletons_use_slurm_variables(monkeypatch):
    # Slurm's NodeAddr of the first node, not its name: names need DNS.
    monkeypatch.setattr("hpcddp.env.slurm.node_address", {"gpu07": "10.9.0.7"}.get)
    env = detect_environment(slurm_step())
    assert isinstance(env, SlurmEnvironment)
    assert astuple(env.layout()) == (3, 4, 1, 2, 1, 2)
    rendezvous = env.rendezvous()
    assert rendezvous.address == "10.9.0.7" and 15000 <= rendezvous.port < 30000
    assert SlurmEnvironment(slurm_step(SLURM_PROCID="0")).rendezvous() == rendezvous


def test_srun_singletons_take_the_address_the_batch_script_looked_up_without_asking_slurm(monkeypatch):
    asked = []

    def scontrol(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 1, "", "no such node")

    monkeypatch.setattr("hpcddp.env.slurm.subprocess.run", scontrol)
    env = SlurmEnvironment(slurm_step(HPCDDP_SLURM_NODE_ADDR="gpu07=10.9.0.7"))
    assert env.rendezvous().address == "10.9.0.7" and asked == []
    # Looked up for another node (a step on part of the job): this task asks scontrol itself.
    other = SlurmEnvironment(slurm_step(HPCDDP_SLURM_NODE_ADDR="gpu01=10.9.0.1"))
    assert other.rendezvous().address == "gpu07" and asked[0][:3] == ["scontrol", "show", "node"]


def test_batch_script_without_srun_is_a_single_process():
    environ = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert isinstance(detect_environment(environ), SingleProcessEnvironment)


def test_singleton_detection():
    assert singleton_under_slurm(slurm_step(), mpi_size=1)
    assert not singleton_under_slurm(slurm_step(), mpi_size=4)
    assert not singleton_under_slurm({}, mpi_size=1)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("gpu[1,3-4],cpu7", ["gpu1", "gpu3", "gpu4", "cpu7"]),
        ("a[08-10]b", ["a08b", "a09b", "a10b"]),
        ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
        ("r1n[1-2],r[3,5]n[07-08]x", ["r1n1", "r1n2", "r3n07x", "r3n08x", "r5n07x", "r5n08x"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_invalid_integer_names_the_variable():
    with pytest.raises(ValueError, match="environment variable WORLD_SIZE must be an integer, got 'four'"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "four"}).layout()


def test_rank_outside_world_is_refused():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        TorchrunEnvironment({"RANK": "2", "WORLD_SIZE": "2"}).layout()


def test_yield_hint_reads_srun_tasks_per_node(monkeypatch):
    from hpcddp.env.mpi_import import _local_ranks_hint

    assert _local_ranks_hint({"SLURM_STEP_TASKS_PER_NODE": "8(x2),3"}) == 8
    assert _local_ranks_hint({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_STEP_TASKS_PER_NODE": "8"}) == 4
    assert _local_ranks_hint({}) == 1


def test_bad_master_port_names_the_variable():
    env = SlurmEnvironment(slurm_step(MASTER_ADDR="gpu07", MASTER_PORT="29500x"))
    with pytest.raises(ValueError, match="environment variable MASTER_PORT must be an integer, got '29500x'"):
        env.rendezvous()


def test_python_run_directly_in_a_multi_task_batch_script_warns(caplog):
    env = detect_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    assert isinstance(env, SingleProcessEnvironment)
    assert env.layout().world_size == 1
    assert "SLURM_NTASKS=4 but this process runs alone" in caplog.text and "srun --mpi=pmix" in caplog.text


def _launched_as(rank, size, local_rank, local_size):
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }


@pytest.mark.parametrize(
    "environ, expected",
    [
        (_launched_as(0, 1, 0, 1), 0),  # the launcher's local rank (at size 1, 0)
        ({}, 0),  # no launcher: rank order
        ({**_launched_as(0, 1, 0, 1), "OMPI_COMM_WORLD_LOCAL_RANK": "x"}, 0),  # no number: rank order, no error
        (_launched_as(0, 1, 99999999999, 1), 0),  # out of range (a C int overflows in the split): rank order
        (_launched_as(3, 4, 3, 4), 0),  # another rank's numbers (a stale variable): rank order
    ],
)
def test_the_node_split_key_is_the_launchers_local_rank_and_never_raises(environ, expected):
    # The split that uses the key is collective: a key that raised on one rank left the others waiting in it.
    from mpi4py import MPI

    from hpcddp.env.mpi import node_order_key

    assert node_order_key(environ, MPI.COMM_WORLD) == expected
    assert node_order_key(environ, MPI.COMM_WORLD.Dup()) == expected
