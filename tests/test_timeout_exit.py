"""Ends that must come at once: a timed-out collective holds up neither shutdown nor exit, a group that cannot meet is refused."""

import pytest

from hpcddp.testing import run_script

from .conftest import ROOT

pytestmark = pytest.mark.ranks

LIMIT_S = 180

SCRIPT = """
    import time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import hpcddp

    hpcddp.init()
    dist.init_process_group("mpi")
    group = dist.new_group(timeout=timedelta(seconds=1))
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(4), group=group)  # the other rank never joins: left in flight for good
        except RuntimeError as err:
            print("timed out:", err, flush=True)
    checkpoint = torch.ones(1)
    dist.all_reduce(checkpoint)
    print("default group", dist.get_rank(), int(checkpoint), flush=True)
    started = time.monotonic()
    hpcddp.shutdown()
    print("shutdown", dist.get_rank(), round(time.monotonic() - started, 1), flush=True)
"""


def test_a_timed_out_collective_does_not_hold_up_shutdown_or_exit(tmp_path):
    result = run_script(2, SCRIPT, tmp_path, timeout=LIMIT_S, cwd=ROOT, env={"HPCDDP_GROUP_TIMEOUTS": "1"})
    assert result.returncode == 0, result.stdout[-5000:]
    assert "allreduce on process group '1' (global ranks [0, 1]): Timed out after 1 s" in result.stdout
    assert "default group 0 2" in result.stdout and "default group 1 2" in result.stdout
    assert "shutdown 0" in result.stdout and "shutdown 1" in result.stdout


DESTROYED_DEFAULT_GROUP = """
    import time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import hpcddp

    hpcddp.init()
    dist.init_process_group("mpi", timeout=timedelta(seconds=0.5))
    dist.destroy_process_group()
    rank = hpcddp.rank()
    if rank == 0:
        time.sleep(1.5)  # later than the destroyed group's timeout
    total = torch.ones(2)
    hpcddp.allreduce_(total, op="sum")  # hpcddp's own collective: the group's timeout went with it
    print("sum", rank, total.tolist(), flush=True)
"""


def test_the_default_groups_timeout_ends_with_the_group(tmp_path):
    result = run_script(
        2, DESTROYED_DEFAULT_GROUP, tmp_path, timeout=LIMIT_S, cwd=ROOT, env={"HPCDDP_GROUP_TIMEOUTS": "1"}
    )
    assert result.returncode == 0, result.stdout[-5000:]
    assert "sum 0 [2.0, 2.0]" in result.stdout and "sum 1 [2.0, 2.0]" in result.stdout


GLOO_BESIDE = """
    import torch, torch.distributed as dist
    import hpcddp

    hpcddp.init()
    dist.init_process_group("{backend}")
    try:
        dist.new_group(backend="gloo")
    except ValueError as err:
        print("refused", hpcddp.rank(), err, flush=True)
    if "{backend}" == "hpcddp":  # a group of one rank meets nobody: the process-local store serves it
        single, _ = dist.new_subgroups(group_size=1, backend="gloo")
        total = torch.ones(2) * (hpcddp.rank() + 1)
        dist.all_reduce(total, group=single)
        print("single", hpcddp.rank(), total.tolist(), flush=True)
"""


@pytest.mark.parametrize("backend", ["mpi", "hpcddp"])
def test_a_gloo_group_beside_a_default_group_without_a_store_is_refused_at_once(tmp_path, backend):
    result = run_script(2, GLOO_BESIDE.format(backend=backend), tmp_path, timeout=LIMIT_S, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    for rank in (0, 1):
        assert (
            f"refused {rank} new_group(backend='gloo'): the default group ({backend!r}) has no store the other ranks "
            "reach" in result.stdout
        ), result.stdout[-5000:]
    assert "init_process_group('hpcddp', init_method='env://')" in result.stdout
    if backend == "hpcddp":
        assert "single 0 [1.0, 1.0]" in result.stdout and "single 1 [2.0, 2.0]" in result.stdout
