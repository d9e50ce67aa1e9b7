"""Every command the docs show runs here and does what they say, or is in ALLOWED with the reason.

The commands are those tests/doc_commands.py finds (README, Getting started, the Slurm and
across-nodes pages, slurm/README.md, the examples' docstrings, slurm/train.sh's header).
Each distinct one runs once, with a time limit, in a directory laid out like a checkout
(the repository's folders linked in, plus the files the docs take for granted: see
``checkout``), the way a user on this machine would run it:

- as root, mpirun gets --allow-run-as-root (the README says so); nothing else is added, so
  more ranks than cores must carry --oversubscribe or go through `hpcddp run`;
- pip install lines are not run (CI runs the ci:test one): their extras must exist, and a
  +cpu torch must come with PyTorch's CPU index;
- sbatch runs with --wait on the one-node test cluster (HPCDDP_SLURM_TESTS=1, or CI), every
  job submitted at once, and the job's log is read;
- `hpcddp run` onto other hosts (-H, --hostfile) runs with --dry-run: the flags parse and
  the script and the hostfile exist. The virtual cluster is not started here although it
  starts in seconds: test_multinode.py starts and removes it, in one state directory.

The output must then show what the docs claim: the examples' ranks and >= 95 % test
accuracy, the README script's last epoch on N ranks.
"""

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from .cluster_jobs import ONE_NODE_CONF
from .conftest import ROOT
from .doc_commands import SOURCES, documented_commands
from .test_slurm import slurm_cluster  # noqa: F401  (the one-node cluster, stopped as test_slurm does)

# Commands that cannot run here, and why. Add one only with a reason a reader can check.
ALLOWED = {
    "HPCDDP_SLURM_TESTS=1 python -m pytest": "the whole suite, this file included; CI runs it (.ci/run)",
    "python -m mkdocs serve": "a server that runs until stopped; test_docs.py builds the same site strictly",
    "sbatch --nodes=2 --ntasks-per-node=4 --partition=gpu slurm/train.sh": "2 nodes and a gpu partition",
    "sbatch --nodes=4 --ntasks-per-node=8 slurm/train.sh my_train.py --epochs 50": "4 nodes",
    "sbatch --nodes=2 --ntasks-per-node=4 slurm/train.sh": "2 nodes",
    "sbatch -N 2 slurm/train.sh": "the virtual cluster's 2 nodes; test_multinode.py runs sbatch -N 2 there",
    "slurm/testing/virtual_cluster.sh up --nodes 2 --slurm": "test_multinode.py starts the virtual cluster",
    "source /run/hpcddp-vcluster/env": "written while the virtual cluster runs; test_multinode.py reads it",
    "slurm/testing/virtual_cluster.sh down": "test_multinode.py removes the virtual cluster",
}

# Shorter through a documented flag where the line's claim ("one process") is still checked.
SHORTER = {"python examples/train.py": "--epochs 2"}

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SBATCH_TASKS = 2  # slurm/train.sh's #SBATCH lines: 1 node x 2 tasks
TIMEOUT_S = {"run": 240, "dry-run": 60, "sbatch": 300}
# Open MPI 5's launcher sometimes fails before any rank starts; hpcddp.testing.run_mpi launches
# again on this message, and so does this test.
LAUNCHER_START_FAILURE = "The PMIx server's listener thread failed to start"


def plan(command: str) -> tuple[str, str]:
    """Return (kind, the command as it runs here) for a documented command."""
    words = shlex.split(command, posix=True)
    if words[:2] == ["pip", "install"]:
        return "pip", command
    if words[0] == "sbatch":
        return "sbatch", command.replace("sbatch", "sbatch --wait", 1)
    if re.search(r"\bhpcddp run\b.*\s(-H|--hosts|--hostfile)\s", command):
        return "dry-run", command.replace("hpcddp run", "hpcddp run --dry-run", 1)
    if os.geteuid() == 0 and re.match(r"mpirun\s", command) and "--allow-run-as-root" not in command:
        command = command.replace("mpirun", "mpirun --allow-run-as-root", 1)
    if command in SHORTER:
        command = f"{command} {SHORTER[command]}"
    return "run", command


def planned() -> dict[tuple[str, str], list[str]]:
    """Every documented command not in ALLOWED, by (kind, command as run), with where it appears."""
    plans: dict[tuple[str, str], list[str]] = {}
    for command, places in documented_commands().items():
        if command not in ALLOWED:
            plans.setdefault(plan(command), []).extend(places)
    return plans


def cases(*kinds):
    return [pytest.param(command, places, id=command) for (kind, command), places in planned().items() if kind in kinds]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A directory like the repository's root, with the stand-ins the docs take for granted."""
    where = tmp_path_factory.mktemp("checkout")
    for name in ("examples", "slurm", "hpcddp", "setup.cfg", "pyproject.toml"):
        (where / name).symlink_to(Path(ROOT) / name)
    # "train.py" is the README's script, "my_train.py" a script that takes arguments.
    readme = (Path(ROOT) / "README.md").read_text().split("## A training script", 1)[1]
    (where / "train.py").write_text(re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1))
    shutil.copy(Path(ROOT) / "examples" / "train.py", where / "my_train.py")
    (where / "hosts.txt").write_text("node1 slots=4\nnode2 slots=4\n")
    (where / "vcluster-hostfile").write_text("vnode1 slots=2\nvnode2 slots=2\n")
    return where


def run_shell(command: str, cwd: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``command`` with bash in ``cwd`` and environment ``env`` (default: this one); kill it after ``timeout`` s."""
    for _ in range(3):
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=os.environ if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # mpirun then ends its ranks
            try:
                output = proc.communicate(timeout=10)[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output = proc.communicate()[0]
            return 124, f"{output}\n[test_commands] killed after {timeout} s: {command}"
        if proc.returncode == 0 or LAUNCHER_START_FAILURE not in output:
            break
    return proc.returncode, output


def num_ranks(command: str) -> int:
    found = re.search(r"-np (\d+)", command)
    return int(found.group(1)) if found else SBATCH_TASKS if command.startswith("sbatch") else 1


def check_claims(command: str, output: str) -> None:
    """The output shows what the docs claim for the script ``command`` runs."""
    scripts = [word for word in command.split() if word.endswith(".py")]
    script = scripts[0] if scripts else "examples/train.py"  # slurm/train.sh's default
    ranks = num_ranks(command)
    epochs = re.search(r"--epochs (\d+)", command)
    done = re.search(r"^done: test accuracy ([\d.]+)%", output, re.MULTILINE)
    if script in ("examples/train.py", "my_train.py"):
        assert f"training on {ranks} rank(s)" in output, output[-5000:]
        assert re.search(rf"^rank {ranks - 1}/{ranks} on ", output, re.MULTILINE), output[-5000:]
        assert done, output[-5000:]
        if epochs:
            assert re.search(rf"^epoch {int(epochs.group(1)) - 1:2d}  train loss", output, re.MULTILINE), output[-5000:]
        else:
            assert float(done.group(1)) >= 95, output[-5000:]
    elif script == "train.py":  # the README's script
        assert re.search(rf"^epoch 4: loss [\d.]+ on {ranks} ranks$", output, re.MULTILINE), output[-5000:]
    elif script == "examples/train_horovod.py":
        last = re.search(r"^epoch 11  last-batch loss \S+  test accuracy ([\d.]+)%", output, re.MULTILINE)
        assert last and float(last.group(1)) >= 95, output[-5000:]
    elif script == "examples/post_local_sgd.py":
        assert done and float(done.group(1)) >= 95, output[-5000:]
    elif script == "examples/async_train.py":
        assert done and float(done.group(1)) >= 95, output[-5000:]
        steps = json.loads(re.search(r"^steps per rank (\[[\d, ]+\])", output, re.MULTILINE).group(1))
        assert len(steps) == ranks, output[-5000:]
        if "--slow-ms" in command:  # the others never wait for the slow last rank
            assert min(steps[:-1]) > steps[-1], output[-5000:]
    else:
        pytest.fail(f"no claim to check for {command}: add one to check_claims")


@pytest.mark.unit
@pytest.mark.parametrize("command, places", cases("pip"))
def test_pip_install_line_names_what_exists(command, places):
    config = configparser.ConfigParser()
    config.read(Path(ROOT) / "setup.cfg")
    extras = set(config["options.extras_require"])
    torch_range = next(
        Requirement(line).specifier
        for line in config["options"]["install_requires"].split("\n")
        if line.strip().startswith("torch")
    )
    words = shlex.split(command)
    for word in words:
        if named := re.fullmatch(r"(?:\.|hpcddp)\[([\w,-]+)\]", word):
            missing = set(named.group(1).split(",")) - extras
            assert not missing, f"{places}: {command}: no extra {missing} in setup.cfg (there are {sorted(extras)})"
        if pin := re.fullmatch(r"torch==(\S+)", word):
            assert Version(pin.group(1)) in torch_range, f"{places}: torch {pin.group(1)} is not {torch_range}"
    if "-e" in words:
        target = words[words.index("-e") + 1].split("[")[0]
        assert (Path(ROOT) / target).is_dir(), f"{places}: {command}: -e {target} is not a directory"
    if any(word.startswith("torch==") and "+cpu" in word for word in words) or "torchvision" in words:
        assert any(word.startswith("torch==") and word.endswith("+cpu") for word in words), f"{places}: {command}"
        index = [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("--extra-index-url", "--index-url")]
        assert index == [CPU_INDEX], f"{places}: a +cpu torch is on {CPU_INDEX} only: {command}"


@pytest.mark.ranks
@pytest.mark.parametrize("command, places", cases("run"))
def test_command_runs_as_documented(command, places, checkout):
    code, output = run_shell(command, checkout, TIMEOUT_S["run"])
    assert code == 0, f"{command} (from {', '.join(places)}) exited {code}:\n{output[-5000:]}"
    check_claims(command, output)


@pytest.mark.unit
@pytest.mark.parametrize("command, places", cases("dry-run"))
def test_command_onto_other_hosts_parses(command, places, checkout):
    hostfile = str(checkout / "vcluster-hostfile")
    code, output = run_shell(command, checkout, TIMEOUT_S["dry-run"], {**os.environ, "VCLUSTER_HOSTFILE": hostfile})
    assert code == 0, f"{command} (from {', '.join(places)}) exited {code}:\n{output[-5000:]}"
    launcher = shlex.split(output.strip().splitlines()[-1])
    assert Path(launcher[0]).name == "mpirun" and launcher[launcher.index("-np") + 1] == str(num_ranks(command))
    flag, value = re.search(r"(-H|--hostfile) (\S+)", command).groups()
    assert launcher[launcher.index(flag) + 1] == value.replace("$VCLUSTER_HOSTFILE", hostfile), output


@pytest.fixture(scope="module")
def sbatch_jobs(checkout, request):
    """Submit every sbatch command at once (the cluster runs them side by side); cancel what is left at the end."""
    request.getfixturevalue("slurm_cluster")  # skips unless the cluster tests may run here
    env = {**os.environ, "SLURM_CONF": ONE_NODE_CONF}  # the one-node cluster's, not a site's Slurm on this host
    jobs = {
        command: subprocess.Popen(
            ["bash", "-c", command], cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for (kind, command) in planned()
        if kind == "sbatch"
    }
    deadline = time.monotonic() + TIMEOUT_S["sbatch"]
    yield jobs, deadline
    for proc in jobs.values():
        if proc.poll() is None:
            proc.kill()
            job = re.search(r"Submitted batch job (\d+)", proc.communicate()[0])
            if job:
                subprocess.run(["scancel", job.group(1)], timeout=30, env=env)


@pytest.mark.system
@pytest.mark.parametrize("command, places", cases("sbatch"))
def test_sbatch_command_runs_on_the_test_cluster(command, places, checkout, sbatch_jobs):
    jobs, deadline = sbatch_jobs
    try:
        output = jobs[command].communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} (from {', '.join(places)}) did not end in {TIMEOUT_S['sbatch']} s (cancelled)")
    job = re.search(r"Submitted batch job (\d+)", output)
    assert job, f"{command}: sbatch printed {output[-3000:]}"
    log_path = checkout / f"hpcddp-{job.group(1)}.out"
    log = log_path.read_text() if log_path.exists() else "(no log)"
    code = jobs[command].returncode
    assert code == 0, f"{command} (from {', '.join(places)}): job {job.group(1)} exited {code}:\n{log[-5000:]}"
    check_claims(command, log)


@pytest.mark.unit
def test_every_source_has_commands_and_allowed_only_documented_ones():
    found = documented_commands()
    places = {place.split(":")[0] for where in found.values() for place in where}
    assert places == set(SOURCES), f"no commands found in {set(SOURCES) - places}: has the format changed?"
    stale = set(ALLOWED) - set(found)
    assert not stale, f"ALLOWED holds commands no doc shows any more: {stale}"
    ci = re.findall(r"<!-- ci:(\w+) -->\n```bash\n(.*?)\n```\n<!-- /ci:\1 -->", (Path(ROOT) / "README.md").read_text())
    assert [name for name, _ in ci] == ["main", "test"], ci
