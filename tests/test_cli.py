"""The hpcddp command: run (mpirun/srun command lines, exit codes), info, --help everywhere."""

import os
import shlex
import signal
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hpcddp.cli import main
from hpcddp.cli.launch import LaunchConfig, build_launch_command

from .conftest import ROOT

HPCDDP = [sys.executable, "-m", "hpcddp.cli"]


@pytest.mark.unit
@pytest.mark.parametrize("command", [[], ["run"], ["info"], ["bench"], ["bench", "allreduce"], ["bench", "train"]])
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output and "--help" in result.output


def dry_run(*args, env=None):
    result = CliRunner().invoke(main, ["run", "--dry-run", *args], env=env)
    assert result.exit_code == 0, result.output
    return shlex.split(result.stdout.strip())


@pytest.fixture
def train_py(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    return "train.py"


@pytest.mark.unit
def test_dry_run_starts_python_scripts_with_this_python_and_binds_ranks_to_cores(train_py):
    argv = dry_run("-np", "1", train_py, "--epochs", "3")
    assert argv[argv.index("-np") + 1] == "1"
    assert argv[-4:] == [sys.executable, "train.py", "--epochs", "3"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    cpus = len(os.sched_getaffinity(0))
    assert argv[argv.index("--map-by") + 1] == f"slot:PE={cpus}:HWTCPUS" and "hwthread" in argv


@pytest.mark.unit
def test_dry_run_oversubscribes_and_yields_past_the_cores():
    argv = dry_run("-np", str(len(os.sched_getaffinity(0)) + 2), "-x", "FOO=bar", "hpcddp", "info")
    assert "--oversubscribe" in argv and argv[argv.index("--bind-to") + 1] == "none"
    assert "mpi_yield_when_idle" in argv
    assert "FOO=bar" in argv and argv[-2:] == ["hpcddp", "info"]


@pytest.mark.unit
def test_a_variable_forwarded_by_name_keeps_its_value_off_the_command_line(train_py):
    # Any local user reads mpirun's command line in /proc/<pid>/cmdline: a key forwarded with
    # -x NAME must reach the ranks through mpirun's environment, not as NAME=value.
    argv = dry_run("-np", "2", "-x", "API_KEY", "-x", "FOO=bar", train_py, env={"API_KEY": "s3cr3t-value"})
    assert not any("s3cr3t-value" in arg for arg in argv), argv
    assert "API_KEY" in [argv[i + 1] for i, arg in enumerate(argv) if arg == "-x"] and "FOO=bar" in argv


def _rank_value(argv, environ, name):
    """What a rank of Open MPI's mpirun gets for ``name``: the last -x that names it wins."""
    value = None
    for flag, item in zip(argv, argv[1:]):
        key, sep, given = item.partition("=")
        if flag == "-x" and key == name:
            value = given if sep else environ.get(name)
    return value


@pytest.mark.unit
@pytest.mark.parametrize(
    "items, shell, expected",
    [
        (["FOO", "FOO=bar"], "s3cret", "bar"),
        (["FOO=bar", "FOO"], None, "bar"),  # a bare name the shell does not set names nothing
        (["FOO", "FOO=bar"], None, "bar"),
        (["FOO=bar", "FOO"], "s3cret", "s3cret"),
        (["FOO"], "s3cret", "s3cret"),
        (["FOO"], None, None),
    ],
)
@pytest.mark.parametrize("launcher", ["Open MPI", "MPICH", "srun"])
def test_the_last_x_for_a_name_wins_and_the_shells_value_stays_off_the_command_line(
    tmp_path, monkeypatch, items, shell, expected, launcher
):
    environ = {"PATH": os.environ["PATH"]} if shell is None else {"PATH": os.environ["PATH"], "FOO": shell}
    if launcher != "Open MPI":  # MPICH's mpirun and srun pass their environment on, whole
        fake = tmp_path / ("srun" if launcher == "srun" else "mpirun")
        fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "HYDRA build details:"\nexit 0\n')
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
        environ["PATH"] = os.environ["PATH"]
    if launcher == "srun":
        environ["SLURM_JOB_ID"] = "42"
    config = LaunchConfig(num_proc=2, env=items, launcher="srun" if launcher == "srun" else "mpirun")
    argv, launch_environ = build_launch_command(config, ["python", "t.py"], environ)
    assert not any("s3cret" in arg for arg in argv), argv
    assert launch_environ.get("FOO") == expected
    if launcher == "Open MPI":
        assert _rank_value(argv, launch_environ, "FOO") == expected
    elif launcher == "MPICH" and expected == "bar":  # -genv wins over the environment it passes on
        assert ["-genv", "FOO", "bar"] == argv[argv.index("-genv") : argv.index("-genv") + 3]


@pytest.mark.unit
def test_the_last_x_for_a_name_wins_in_a_dry_run(train_py):
    argv = dry_run("-np", "2", "-x", "FOO", "-x", "FOO=bar", train_py, env={"FOO": "s3cret"})
    assert "FOO=bar" in argv and "s3cret" not in " ".join(argv)
    argv = dry_run("-np", "2", "-x", "FOO=bar", "-x", "FOO", train_py, env={"FOO": None})
    assert "FOO=bar" in argv


@pytest.mark.unit
@pytest.mark.parametrize("extra", [2, 0])
def test_oversubscribing_is_said_in_one_line(train_py, extra):
    cpus = len(os.sched_getaffinity(0))
    result = CliRunner().invoke(main, ["run", "--dry-run", "-np", str(cpus + extra), train_py])
    assert result.exit_code == 0, result.output
    note = (
        f"[hpcddp run] {cpus + extra} ranks on {cpus} cores: oversubscribing (each rank yields its core while it waits)"
    )
    assert result.stderr.splitlines() == ([note] if extra else [])


@pytest.mark.unit
def test_n_is_an_alias_of_np_as_in_mpirun(train_py):
    for args in (["-n", "1"], ["-n1"], ["--num-proc", "1"]):
        argv = dry_run(*args, train_py)
        assert argv[argv.index("-np") + 1] == "1" and argv[-2:] == [sys.executable, "train.py"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "option, suggestion",
    [("--num-porc", "'--num-proc'"), ("--num-porc=2", "'--num-proc'"), ("--dryrun", "'--dry-run'")],
)
def test_a_mistyped_option_of_run_suggests_the_close_one(train_py, option, suggestion):
    result = CliRunner().invoke(main, ["run", option, "2", train_py])
    name = option.split("=")[0]
    assert result.exit_code == 2 and f"no such option: {name} Did you mean {suggestion}?" in result.output
    assert "Traceback" not in result.output


@pytest.mark.unit
def test_options_after_the_program_are_the_programs_even_when_they_look_like_runs(train_py):
    argv = dry_run("-np", "1", train_py, "--num-porc", "2", "-n", "3")
    assert argv[-6:] == [sys.executable, "train.py", "--num-porc", "2", "-n", "3"]


@pytest.mark.unit
def test_dry_run_with_hosts_leaves_placement_to_mpirun_and_forwards_variables(train_py):
    argv = dry_run("-np", "8", "-H", "node1:4,node2:4", train_py, env={"HPCDDP_STALL_TIMEOUT": "30"})
    assert argv[argv.index("-H") + 1] == "node1:4,node2:4"
    assert "--map-by" not in argv and "--oversubscribe" not in argv
    assert "HPCDDP_STALL_TIMEOUT" in argv  # forwarded with -x to remote ranks


@pytest.mark.unit
def test_inside_a_slurm_allocation_it_uses_srun(tmp_path, monkeypatch):
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    environ = {"SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "4", "PATH": os.environ["PATH"]}
    argv, env = build_launch_command(LaunchConfig(num_proc=2), ["python", "t.py"], environ)
    assert argv == [
        str(srun),
        "--mpi=pmix",
        "--kill-on-bad-exit=1",
        "--ntasks=2",
        "--cpus-per-task=4",
        "python",
        "t.py",
    ]
    assert env["PMIX_MCA_psec"] == "native"
    argv, _ = build_launch_command(LaunchConfig(num_proc=2, launcher="mpirun"), ["t"], environ)
    assert os.path.basename(argv[0]) == "mpirun"
    argv, _ = build_launch_command(LaunchConfig(launcher="mpirun"), ["t"], {**environ, "SLURM_NTASKS": "6"})
    assert argv[argv.index("-np") + 1] == "6"


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "0", "t.py"], "-np must be >= 1, got 0"),
        (["t.py"], "-np is required outside a Slurm allocation"),
        (["-np", "2", "-H", "a:1", "--hostfile", __file__, "t.py"], "either -H/--hosts or --hostfile"),
        (["-np", "2", "-x", "1BAD", "t.py"], "-x takes NAME or NAME=VALUE, got '1BAD'"),
        (["-np", "2", "--launcher", "pbs", "t.py"], "'pbs' is not one of"),
        (["-np", "2", "--bogus", "t.py"], "no such option: --bogus"),
        (["-np", "2", "--launcher", "srun", "-H", "a:2", "t.py"], "-H applies only to mpirun"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(args, message):
    result = CliRunner().invoke(main, ["run", *args], env={"SLURM_JOB_ID": ""})
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.unit
@pytest.mark.parametrize(
    "program, message",
    [
        ("trian.py", "Invalid value for SCRIPT: trian.py does not exist (in "),
        ("pyhton", "Invalid value for SCRIPT: command 'pyhton' not found on PATH"),
    ],
)
def test_a_missing_script_fails_before_the_launcher_starts(program, message):
    result = subprocess.run([*HPCDDP, "run", "-np", "2", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "prterun" not in result.stderr and "mpirun" not in result.stderr


@pytest.mark.ranks
def test_ctrl_c_stops_the_job_with_130_and_says_so():
    code = "import sys, time; print('running', flush=True); time.sleep(120)"
    proc = subprocess.Popen(
        [*HPCDDP, "run", "-np", "2", "python", "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # no terminal: hpcddp run passes the signal on itself
    )
    try:
        assert proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "[hpcddp run] interrupted (Ctrl-C): the job was stopped" in err


@pytest.mark.ranks
def test_signals_reach_every_rank():
    code = (
        "import signal, sys, time, hpcddp; hpcddp.init(); "
        "signal.signal(signal.SIGUSR1, lambda *a: (print('USR1 at', hpcddp.rank(), flush=True), sys.exit(0))); "
        "print('ready', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [*HPCDDP, "run", "-np", "2", "python", "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and sorted(out.split("\n")[:2]) == ["USR1 at 0", "USR1 at 1"], out


@pytest.mark.unit
def test_ranks_that_never_finish_fail_the_job_even_when_the_launcher_says_0(tmp_path, monkeypatch, capsys):
    from hpcddp.fault.supervise import supervise

    # A launcher as Open MPI 5.0's mpirun after losing a node: both ranks started, rank 1
    # was killed (no finished mark), and it exits 0.
    fake_launcher = (
        "import os; d = os.environ['HPCDDP_RUN_STATUS']; "
        "open(f'{d}/vnode9.ranks', 'a').write('started 0 vnode9\\nstarted 1 vnode9\\nfinished 0\\n')"
    )
    monkeypatch.chdir(tmp_path)
    assert supervise([sys.executable, "-c", fake_launcher], os.environ) == 1
    err = capsys.readouterr().err
    assert "exited 0, but rank(s) 1 on vnode9 never finished: they were killed" in err, err
    assert not list(tmp_path.iterdir())  # the status directory is gone
    finished = "import os; d = os.environ['HPCDDP_RUN_STATUS']; open(f'{d}/vnode9.ranks', 'a').write('started 0 vnode9\\nfinished 0\\n')"
    assert supervise([sys.executable, "-c", finished], os.environ) == 0


@pytest.mark.ranks
def test_run_status_is_one_file_per_node_whatever_its_number_of_ranks():
    # 3 ranks on this node: after every rank has started, the status directory holds this node's file only.
    script = (
        "import os, socket, hpcddp, torch; hpcddp.init(); hpcddp.allreduce(torch.ones(1)); "
        "names = sorted(os.listdir(os.environ['HPCDDP_RUN_STATUS'])); "
        "hpcddp.rank() == 0 and print('status files:', names, names == [socket.gethostname() + '.ranks'])"
    )
    run = subprocess.run(
        [*HPCDDP, "run", "-np", "3", sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "True" in run.stdout, run.stdout


@pytest.mark.ranks
def test_run_returns_the_job_exit_code():
    ok = subprocess.run(
        [*HPCDDP, "run", "-np", "2", "python", "-c", "pass"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    failed = subprocess.run(
        [*HPCDDP, "run", "-np", "2", "python", "-c", "import sys; sys.exit(3)"], capture_output=True, timeout=120
    )
    assert failed.returncode == 3


@pytest.mark.ranks
def test_info_under_two_ranks_prints_the_rank_map_and_a_working_allreduce():
    result = subprocess.run(
        [*HPCDDP, "run", "-np", "2", "hpcddp", "info"], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Job: 2 rank(s), backend mpi" in out, out
    assert "[X] mpi   Open MPI" in out and "allreduce over 2 rank(s) ok" in out, out
    assert out.count("allreduce over 2 rank(s) ok") == 2  # mpi and gloo both tried across the job
    assert "[X] gloo" in out and "nccl" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "cpu" in line]
    assert sorted(row[0] for row in rows) == ["0", "1"], out
    assert "thread level  MULTIPLE" in out


@pytest.mark.unit
def test_info_json_in_one_process():
    result = subprocess.run([*HPCDDP, "info", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(result.stdout)
    assert report["job"]["size"] == 1
    checks = {b["name"]: b for b in report["backends"]}
    assert set(checks) == {"mpi", "gloo", "nccl"}
    assert checks["mpi"]["works"] and checks["gloo"]["works"]
    assert checks["nccl"]["works"] is None or checks["nccl"]["available"]
    assert report["versions"]["hpcddp"]
