"""hpcddp run's status directory: one file per node, written by each rank of the node (no MPI)."""

import os
import socket
import subprocess
import sys

import pytest

from hpcddp.fault.run_status import aborted_ranks, started_ranks, unfinished_ranks

from .conftest import ROOT


def rank_process(directory, rank, end):
    """A rank's process: marks its start, then exits normally, or dies without running exit handlers."""
    script = (
        "import os, sys; from hpcddp.fault.run_status import mark_started, mark_aborted\n"
        f"mark_started({str(directory)!r}, {rank})\n"
        f"if {end!r} == 'abort': mark_aborted({str(directory)!r}, {rank}, 7)\n"
        f"if {end!r} != 'exit': os._exit(9)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script], env=env)


@pytest.mark.ranks
def test_four_ranks_of_a_node_share_one_file_and_the_killed_ones_are_named(tmp_path):
    ends = {0: "exit", 1: "killed", 2: "exit", 3: "abort"}
    processes = [rank_process(tmp_path, rank, end) for rank, end in ends.items()]
    for process in processes:
        assert process.wait(timeout=120) in (0, 9)
    host = socket.gethostname()
    assert sorted(os.listdir(tmp_path)) == [f"{host}.aborted", f"{host}.ranks"]
    assert started_ranks(str(tmp_path)) == 4
    assert unfinished_ranks(str(tmp_path)) == {1: host, 3: host}
    assert aborted_ranks(str(tmp_path)) == {3: 7}


@pytest.mark.unit
def test_a_record_cut_short_is_ignored(tmp_path):
    (tmp_path / "n1.ranks").write_text("started 0 n1\nstarted 1 n1\nfinished 0\nfinish")
    (tmp_path / "n2.ranks").write_text("started 2 n2\n")
    (tmp_path / "n1.aborted").write_text("1 7\n2 ")
    assert unfinished_ranks(str(tmp_path)) == {1: "n1", 2: "n2"}
    assert started_ranks(str(tmp_path)) == 3
    assert aborted_ranks(str(tmp_path)) == {1: 7}
