"""Scripts written for torchrun: hpcddp.init() under torchrun, and unchanged torchrun scripts under hpcddp run.

torchrun's agent serves the rendezvous store itself and the script makes the default group;
``hpcddp run`` (and slurm/train.sh, in test_slurm.py) gives each rank torchrun's variables
before the script starts. Results are checked against plain arithmetic and plain torch.
"""

import os
import re
import sys
import textwrap

import pytest
import torch

from hpcddp.env.torchrun import launcher_variables
from hpcddp.testing import run_command

from .conftest import ROOT

LIMIT_S = 180
SITE = os.path.join(ROOT, "hpcddp", "_site")
# --standalone: the agent's store on a free port (the default, static rendezvous takes 29500).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
HPCDDP_RUN = [sys.executable, "-m", "hpcddp.cli", "run", "-np", "2"]
# What a launcher around this test (mpirun, srun, torchrun) would pass on to the jobs started here.
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "TORCHELASTIC_")
TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR")


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """Write a script and run it under a launcher command with a time limit, as from a fresh shell."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in (*TORCHRUN_NAMES, "MASTER_PORT", "GROUP_WORLD_SIZE"):
            monkeypatch.delenv(name)

    def run(command, source, **env):
        script = tmp_path / "job.py"
        script.write_text(textwrap.dedent(source))
        result = run_command([*command, str(script)], LIMIT_S, env=env, cwd=ROOT)
        assert not result.timed_out, result.stdout[-5000:]
        return result

    return run


def assert_every_error_is(output: str, message: str) -> None:
    """The first rank to fail prints *message*; torchrun then SIGTERMs the others, which may die unprinted."""
    errors = [line for line in output.splitlines() if line.startswith("[hpcddp rank ") and "error:" in line]
    assert errors, output[-5000:]
    for line in errors:
        assert line.split("] ", 1)[1] == message, output[-5000:]


def results(output: str) -> dict[int, list[str]]:
    """The ``RESULT rank ...`` line of each rank, split into words."""
    found = {}
    for line in output.splitlines():
        if line.startswith("RESULT "):
            words = line.split()[1:]
            found[int(words[0])] = words[1:]
    return found


# torchrun starts its workers unbuffered (python -u), where print writes word by word and the
# two workers' words mix in their shared pipe: a result line is one write.
SAY = """
import sys

def say(*words):
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
"""

# The README's one-line change: hpcddp.init() before the script's own init_process_group.
ONE_LINE_CHANGE = (
    SAY
    + """
import torch, torch.distributed as dist
import hpcddp
hpcddp.init()
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.arange(4, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
# hpcddp's own collectives run on the script's group
h = hpcddp.allreduce(torch.full((3,), float(rank + 1), dtype=torch.float64), op="sum")
say("RESULT", rank, size, hpcddp.backend(), dist.get_backend(), *t.tolist(), *h.tolist())
dist.destroy_process_group()
"""
)


@pytest.mark.ranks
def test_one_line_change_runs_under_torchrun(launch):
    result = launch(TORCHRUN, ONE_LINE_CHANGE)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "Address already in use" not in result.stdout and "twice" not in result.stdout
    expected = [str(float(i * (1 + 2))) for i in range(4)] + ["3.0"] * 3  # sum over ranks of (rank + 1)
    assert results(result.stdout) == {r: ["2", "gloo", "gloo", *expected] for r in (0, 1)}, result.stdout[-5000:]


SCRIPT_GROUP_OUTLIVES_SHUTDOWN = (
    SAY
    + """
import torch, torch.distributed as dist
import hpcddp
dist.init_process_group("gloo")
hpcddp.init()
rank = dist.get_rank()
h = hpcddp.allreduce(torch.tensor([1.0 + rank], dtype=torch.float64), op="sum")
hpcddp.shutdown()  # leaves the script's group to the script
t = torch.tensor([10.0 * (rank + 1)], dtype=torch.float64)
dist.all_reduce(t)
dist.destroy_process_group()
say("RESULT", rank, *h.tolist(), *t.tolist())
"""
)


@pytest.mark.ranks
def test_hpcddp_shutdown_leaves_the_scripts_group_to_the_script(launch):
    result = launch(TORCHRUN, SCRIPT_GROUP_OUTLIVES_SHUTDOWN)
    assert result.returncode == 0, result.stdout[-5000:]
    assert results(result.stdout) == {r: ["3.0", "30.0"] for r in (0, 1)}, result.stdout[-5000:]


OPTIMIZER_ONLY = (
    SAY
    + """
import torch, torch.distributed as dist
import hpcddp
hpcddp.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2).double()
if hpcddp.rank() == 1:
    with torch.no_grad():
        model.weight.add_(1.0)  # broadcast_parameters must undo this
optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.arange(6, dtype=torch.float64).reshape(2, 3) * (hpcddp.rank() + 1)
model(x).pow(2).sum().backward()
optimizer.step()
say("RESULT", hpcddp.rank(), dist.get_backend(), *[repr(v) for v in model.weight.flatten().tolist()])
"""
)


@pytest.mark.ranks
def test_distributed_optimizer_alone_under_torchrun(launch):
    """No init_process_group in the script: hpcddp makes the group at its first collective, through torchrun's store."""
    result = launch(TORCHRUN, OPTIMIZER_ONLY)
    assert result.returncode == 0, result.stdout[-5000:]
    found = results(result.stdout)
    assert sorted(found) == [0, 1] and found[0] == found[1], result.stdout[-5000:]
    assert found[0][0] == "gloo"
    # One process, plain torch: the mean of the two ranks' gradients, one SGD step.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    grads = []
    for rank in (0, 1):
        model.zero_grad()
        x = torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1)
        model(x).pow(2).sum().backward()
        grads.append(model.weight.grad.clone())
    expected = model.weight.detach() - 0.1 * (grads[0] + grads[1]) / 2
    got = torch.tensor([float(v) for v in found[0][1:]], dtype=torch.float64).reshape(2, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.ranks
def test_init_process_group_after_hpcddp_made_the_group_names_the_fix(launch):
    source = """
    import torch, torch.distributed as dist, hpcddp
    hpcddp.init()
    hpcddp.allreduce(torch.ones(2))  # hpcddp needs the group first: it makes it
    dist.init_process_group("gloo")
    """
    result = launch(TORCHRUN, source)
    assert result.returncode != 0
    message = (
        "error: init_process_group('gloo'): hpcddp already made torch.distributed's default group (gloo) for its "
        "own collectives: call init_process_group before hpcddp.init() (hpcddp then uses the script's group), or "
        "drop this call (torch.distributed uses hpcddp's group)"
    )
    assert_every_error_is(result.stdout, message)


@pytest.mark.ranks
def test_init_process_group_mpi_under_torchrun_is_one_line(launch):
    result = launch(TORCHRUN, 'import torch.distributed as dist, hpcddp\ndist.init_process_group("mpi")\n')
    assert result.returncode != 0
    message = (
        "error: init_process_group('mpi') needs ranks started by an MPI launcher, but torchrun started these "
        "without an MPI world: use 'gloo' or 'nccl' under torchrun, or launch with mpirun, srun --mpi=pmix or "
        "hpcddp run"
    )
    assert_every_error_is(result.stdout, message)
    assert "Address already in use" not in result.stdout
    assert "hpcddp/" not in result.stdout  # no traceback from inside hpcddp


# Written for torchrun, nothing of hpcddp: the variables are read before torch is imported.
UNCHANGED_SCRIPT = """
import os
local_rank = int(os.environ["LOCAL_RANK"])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.arange(4, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
print("RESULT", rank, size, local_rank, os.environ["GROUP_RANK"], dist.get_rank(), dist.get_world_size(),
      address, *t.tolist(), flush=True)
dist.destroy_process_group()
"""

UNCHANGED_EXPECTED = {r: ["2", str(r), "0", str(r), "2", "127.0.0.1", "0.0", "3.0", "6.0", "9.0"] for r in (0, 1)}


@pytest.mark.ranks
def test_unchanged_torchrun_script_under_hpcddp_run(launch):
    result = launch(HPCDDP_RUN, UNCHANGED_SCRIPT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert results(result.stdout) == UNCHANGED_EXPECTED, result.stdout[-5000:]


@pytest.mark.ranks
def test_init_process_group_after_import_hpcddp_under_plain_mpirun(tmp_path):
    """No sitecustomize: init_process_group itself fills in what env:// reads, from MPI."""
    from hpcddp.testing import run_script

    source = """
    import os, torch, torch.distributed as dist, hpcddp
    dist.init_process_group("gloo")
    t = torch.ones(2, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("RESULT", dist.get_rank(), os.environ["LOCAL_RANK"], *t.tolist(), flush=True)
    dist.destroy_process_group()
    """
    result = run_script(2, source, tmp_path, timeout=LIMIT_S)
    assert result.returncode == 0, result.stdout[-5000:]
    assert results(result.stdout) == {r: [str(r), "3.0", "3.0"] for r in (0, 1)}, result.stdout[-5000:]


@pytest.mark.unit
def test_env_init_without_a_launcher_names_the_fix(monkeypatch):
    import torch.distributed as dist

    import hpcddp  # noqa: F401 - wraps init_process_group

    for name in (*TORCHRUN_NAMES, "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    with pytest.raises(ValueError) as info:
        dist.init_process_group("gloo")
    assert str(info.value) == (
        "init_process_group('gloo') reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment "
        "(env://), but no launcher set them: launch with hpcddp run -np N (or torchrun), or call hpcddp.init() "
        "first, which exports them"
    )
    assert not dist.is_initialized()


OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ, expected",
    [
        # across hosts mpirun does not say which node: left to MPI
        (OPEN_MPI, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}),
        (
            {**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "0"},
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
            | {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "NODE_RANK": "0"},
        ),
        (
            {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"},
            {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}
            | {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "NODE_RANK": "0"},
        ),
        (
            {
                "PMIX_RANK": "3",
                "SLURM_PROCID": "3",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "1",
                "SLURM_STEP_NUM_TASKS": "4",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            },
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
            | {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "NODE_RANK": "1"},
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, {}),  # the batch script's own python
        ({**OPEN_MPI, "TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, {}),  # torchrun's workers keep torchrun's
        ({}, {}),
    ],
    ids=["mpirun-hosts", "mpirun-one-host", "hydra", "srun", "sbatch-step", "torchrun-inside", "none"],
)
def test_launcher_variables(environ, expected):
    assert launcher_variables(environ) == expected


@pytest.mark.unit
def test_sitecustomize_exports_the_ranks_before_the_script_without_mpi():
    """Every Python process under hpcddp run reads its ranks from mpirun's variables; none starts MPI there."""
    import subprocess

    code = "import os, sys; print(os.environ['RANK'], os.environ['LOCAL_WORLD_SIZE'], 'mpi4py' in sys.modules)"
    env = {**os.environ, **OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "PYTHONPATH": f"{SITE}:{ROOT}"}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5", "8", "False"]
    # A rank's child that its parent gave its own RANK (a one-process helper job) keeps it, as under torchrun.
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**env, "RANK": "0"}, timeout=60
    )
    assert result.stdout.split() == ["0", "8", "False"], result.stderr


@pytest.mark.ranks
def test_hpcddp_run_starts_ranks_without_the_shells_rank_variables():
    from hpcddp.cli.launch import LaunchConfig, build_launch_command

    stale = {"RANK": "3", "WORLD_SIZE": "9", "LOCAL_RANK": "3", "NODE_RANK": "1"}
    _, environ = build_launch_command(LaunchConfig(num_proc=2), ["t.py"], {"PATH": os.environ["PATH"], **stale})
    assert not set(stale) & set(environ)


@pytest.mark.ranks
def test_hpcddp_run_gives_one_host_a_rendezvous():
    from hpcddp.cli.launch import LaunchConfig, build_launch_command

    environ = {"PATH": os.environ["PATH"]}
    argv, _ = build_launch_command(LaunchConfig(num_proc=2), ["python", "t.py"], environ)
    port = next(re.fullmatch(r"MASTER_PORT=(\d+)", a) for a in argv if a.startswith("MASTER_PORT="))
    assert "MASTER_ADDR=127.0.0.1" in argv and 1024 <= int(port.group(1)) < 65536
    argv, _ = build_launch_command(LaunchConfig(num_proc=2), ["t.py"], {**environ, "MASTER_PORT": "4242"})
    assert "MASTER_ADDR=127.0.0.1" in argv and not any(a.startswith("MASTER_PORT=") for a in argv)
    argv, _ = build_launch_command(LaunchConfig(num_proc=4, hosts="n1:2,n2:2"), ["t.py"], environ)
    assert not any(a.startswith("MASTER_") for a in argv)  # found at init_process_group, through MPI
    # One set here reaches every host: a rank without it would start the (collective) rendezvous alone.
    argv, _ = build_launch_command(
        LaunchConfig(num_proc=4, hosts="n1:2,n2:2"), ["t.py"], {**environ, "MASTER_ADDR": "n1"}
    )
    assert argv[argv.index("MASTER_ADDR") - 1] == "-x"


# ---- plain mpirun: the hpcddp-torchrun-env.pth that pip installs -----------------------------

PTH = os.path.join(ROOT, "hpcddp", "_site", "hpcddp-torchrun-env.pth")

# nanoGPT's test: distributed only when RANK is set, else one process training alone.
CHECKS_RANK_ITSELF = """
import os, sys
ddp = int(os.environ.get("RANK", -1)) != -1
import torch
if not ddp:
    print("RESULT alone", flush=True)
    sys.exit(0)
import torch.distributed as dist
backend = sys.argv[1]
if backend == "mpi":  # rank and size passed as torchrun scripts often do: torch would warn they are ignored
    dist.init_process_group("mpi", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
else:
    dist.init_process_group(backend)
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)
dist.all_reduce(t)
print("RESULT", rank, size, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], *t.tolist(),
      flush=True)
dist.destroy_process_group()
"""


def installed_pth() -> str:
    import site

    for directory in site.getsitepackages():
        path = os.path.join(directory, os.path.basename(PTH))
        if os.path.exists(path):
            return path
    pytest.fail(f"{os.path.basename(PTH)} is not in site-packages: reinstall hpcddp (pip install -e .)")


@pytest.mark.unit
def test_pip_installed_the_pth_next_to_the_editable_hook():
    path = installed_pth()
    with open(path) as installed, open(PTH) as source:
        assert installed.read() == source.read(), f"{path} is stale: reinstall hpcddp (pip install -e .)"
    # read after setuptools' __editable__.*.pth, which makes hpcddp importable in an editable install
    assert os.path.basename(path) > "__editable__"


def run_checks_rank_itself(tmp_path, monkeypatch, backend, **env):
    from hpcddp.testing import run_mpi

    # As from a fresh shell: no rank variables, no hpcddp run (no sitecustomize on PYTHONPATH).
    for name in (*TORCHRUN_NAMES, "MASTER_PORT", "GROUP_WORLD_SIZE", "PYTHONPATH"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(CHECKS_RANK_ITSELF))
    result = run_mpi(2, [sys.executable, str(script), backend], timeout=LIMIT_S, env=env, cwd=ROOT)
    assert not result.timed_out, result.stdout[-5000:]
    return result


@pytest.mark.ranks
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_script_that_checks_rank_itself_runs_as_one_job_under_plain_mpirun(tmp_path, monkeypatch, backend):
    installed_pth()
    result = run_checks_rank_itself(tmp_path, monkeypatch, backend)
    assert result.returncode == 0, result.stdout[-5000:]
    # ranks 0 and 1 of 2, and the sum over ranks of (rank + 1, 10 (rank + 1)): 1 + 2 = 3, 10 + 20 = 30
    assert results(result.stdout) == {r: ["2", str(r), "2", str(r), "3.0", "30.0"] for r in (0, 1)}, result.stdout
    assert "alone" not in result.stdout
    # hpcddp's rank and size are MPI's: torch's warning that they are ignored says nothing here
    assert "are ignored" not in result.stdout, result.stdout[-5000:]


@pytest.mark.ranks
def test_with_the_switch_off_each_rank_runs_alone_as_before(tmp_path, monkeypatch):
    result = run_checks_rank_itself(tmp_path, monkeypatch, "gloo", HPCDDP_TORCHRUN_ENV="0")
    assert result.returncode == 0, result.stdout[-5000:]
    assert result.stdout.count("RESULT alone") == 2, result.stdout[-5000:]


def exec_pth_line(environ):
    """Run the .pth's import line as site.py does, in ``environ``; return the modules it loaded."""
    import subprocess

    code = (
        "import os, sys; before = set(sys.modules); "
        f"exec([l for l in open({PTH!r}) if l.startswith('import ')][0]); "
        "print(sorted(set(sys.modules) - before)); print(os.environ.get('RANK', '-'))"
    )
    # -S: no site-packages (the installed .pth is not run first), then the line by hand
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, env=environ, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    modules, rank = result.stdout.splitlines()
    return eval(modules), rank, result.stderr  # noqa: S307 - our own print of a list of names


def plain_environ(**extra):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in TORCHRUN_NAMES}
    return {**environ, "PYTHONPATH": ROOT, **extra}


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {**OPEN_MPI, "RANK": "5"},  # a rank's child: its parent gave it RANK
        {
            **OPEN_MPI,
            "OMPI_COMM_WORLD_SIZE": "1",
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        },  # mpirun -np 1: no copies to tell apart
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},  # a shell inside srun --pty
    ],
    ids=["no-launcher", "rank-set", "one-process", "one-srun-task"],
)
def test_the_pth_line_loads_nothing_outside_a_launch_of_several(extra):
    modules, rank, stderr = exec_pth_line(plain_environ(**extra))
    assert modules == [] and stderr == ""
    assert rank == extra.get("RANK", "-")


@pytest.mark.unit
def test_the_pth_line_in_a_launch_exports_the_ranks_without_torch_mpi_or_the_package():
    modules, rank, stderr = exec_pth_line(plain_environ(**OPEN_MPI))
    assert rank == "5" and stderr == ""
    assert not {"torch", "mpi4py", "hpcddp"} & {m.split(".")[0] for m in modules}, modules
    modules, rank, stderr = exec_pth_line(plain_environ(**OPEN_MPI, HPCDDP_TORCHRUN_ENV="0"))
    assert rank == "-" and stderr == ""
    modules, rank, stderr = exec_pth_line(plain_environ(**OPEN_MPI, HPCDDP_TORCHRUN_ENV="maybe"))
    assert rank == "-"
    assert stderr.strip() == (
        "hpcddp: torchrun's variables not exported: environment variable HPCDDP_TORCHRUN_ENV must be 0 or 1, "
        "got 'maybe'"
    )


@pytest.mark.unit
def test_the_mpi_warning_stays_where_rank_or_size_is_not_mpis():
    import warnings
    from types import SimpleNamespace

    from hpcddp.torch_backend._stores import supply_store

    def init_process_group(backend=None, init_method=None, **kwargs):  # torch's check, as in distributed_c10d
        warnings.warn(
            f"For MPI backend, world_size ({kwargs.get('world_size', -1)}) and rank ({kwargs.get('rank', -1)}) "
            "are ignored since they are assigned by the MPI runtime.",
            stacklevel=2,
        )

    def world(name):
        return SimpleNamespace(rank=1, size=2)

    wrapped = supply_store(init_process_group, world, lambda: True)
    for kwargs, warned in (
        ({"rank": 1, "world_size": 2}, False),
        ({"rank": 0, "world_size": 2}, True),
        ({"world_size": 3}, True),
        ({"rank": 1}, False),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped("mpi", **kwargs)
        assert bool(caught) == warned, kwargs
    with warnings.catch_warnings(record=True) as caught:  # where torch has an MPI of its own, torch's as it is
        warnings.simplefilter("always")
        supply_store(init_process_group, world, lambda: False)("mpi", rank=1, world_size=2)
    assert caught


LOCAL_RANKS = """
import os
import hpcddp

announced = os.environ["LOCAL_RANK"]  # what the script saw before hpcddp.init(), from the launcher
hpcddp.init()
print("LOCAL", hpcddp.rank(), announced, os.environ["OMPI_COMM_WORLD_LOCAL_RANK"], hpcddp.local_rank(), flush=True)
hpcddp.shutdown()
"""


@pytest.mark.ranks
def test_the_local_rank_a_script_saw_before_init_is_hpcddps_under_an_oversubscribed_mpirun(tmp_path, monkeypatch):
    # Open MPI 5 numbers a node's ranks out of rank order when it oversubscribes (4 ranks on
    # 2 cores: ranks 1 and 2 get local ranks 2 and 1); a script that chose its GPU from
    # LOCAL_RANK must find the same local rank in hpcddp, and no warning that it changed.
    for name in (*TORCHRUN_NAMES, "MASTER_PORT", "GROUP_WORLD_SIZE", "PYTHONPATH"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "job.py"
    script.write_text(LOCAL_RANKS)
    # mpirun as a user types it (binding to cores, which is what reorders), not hpcddp's own command
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, str(script)]
    result = run_command(command, LIMIT_S, env={"OMPI_MCA_mpi_yield_when_idle": "1"}, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    rows = sorted(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("LOCAL "))
    assert len(rows) == 4, result.stdout[-5000:]
    for rank, before, launcher, after in rows:
        assert before == launcher == after, (rank, before, launcher, after)
    assert sorted(int(row[3]) for row in rows) == [0, 1, 2, 3]
    assert "overriding LOCAL_RANK" not in result.stdout, result.stdout[-3000:]
