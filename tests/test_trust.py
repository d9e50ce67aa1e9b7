"""Issue 17's rows, launched as a user runs them: no false abort, no hang, the right exit and message.

Each job has a time limit (``launch``); the values are checked against plain arithmetic.
"""

import re
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import ROOT
from .test_failures import LIMIT_S, launch

pytestmark = pytest.mark.ranks

ABORTED = "[hpcddp stall inspector] aborting"
DEADLOCK = "every rank waits in an operation that can never complete"


def clean_output(result) -> str:
    """The job's output, once it is known to have ended with 0 and without a stall abort."""
    out = result.stdout
    assert result.returncode == 0, out
    assert ABORTED not in out, out
    return out


def test_a_rank_slow_now_and_then_is_never_aborted(tmp_path):
    result, _ = launch(
        tmp_path,
        """
        import time, torch, hpcddp
        hpcddp.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        for step in range(30):
            if hpcddp.rank() == 1 and step in (5, 20):
                time.sleep(2.5)  # 2.5 x stall_timeout, once and then again
            opt.zero_grad()
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
        total = hpcddp.allreduce(torch.ones(1), op="sum")
        print(f"DONE {hpcddp.rank()} {total.item():.0f}", flush=True)
        """,
        env={"HPCDDP_STALL_TIMEOUT": "1"},
    )
    out = clean_output(result)
    assert out.count("DONE") == 2 and "DONE 0 2" in out and "DONE 1 2" in out, out


def test_a_world_collective_longer_than_stall_timeout_after_a_subgroup_is_right(tmp_path):
    result, _ = launch(
        tmp_path,
        """
        import time, torch, torch.distributed as dist, hpcddp
        dist.init_process_group("mpi")
        rank = dist.get_rank()
        pair = dist.new_group([1, 2])  # every rank calls it; rank 0 is not a member
        if rank in (1, 2):
            t = torch.full((3,), float(rank))
            dist.all_reduce(t, group=pair)
            assert t.tolist() == [3.0] * 3, t
        if rank == 0:
            time.sleep(3)  # the world all_reduce waits 3 x stall_timeout for it
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)
        print(f"RESULT {rank} {t.tolist()}", flush=True)
        dist.destroy_process_group()
        """,
        env={"HPCDDP_STALL_TIMEOUT": "1"},
        ranks=3,
    )
    out = clean_output(result)
    assert sorted(re.findall(r"RESULT (\d) \[6\.0, 6\.0, 6\.0, 6\.0, 6\.0\]", out)) == ["0", "1", "2"], out


@pytest.mark.parametrize("check", ["1", "0"])  # "0": the allreduce waits in MPI, which busy-polls
def test_a_point_to_point_deadlock_ends_the_job_at_once_naming_both_ranks(tmp_path, check):
    result, took = launch(
        tmp_path,
        """
        import torch, torch.distributed as dist
        import hpcddp
        dist.init_process_group("mpi")
        t = torch.ones(2)
        if dist.get_rank() == 0:
            dist.all_reduce(t)  # rank 1 never joins it: it waits for a message rank 0 never sends
        else:
            dist.recv(t, 0)
        print("UNREACHABLE", flush=True)
        """,
        env={"HPCDDP_STALL_TIMEOUT": "2", "HPCDDP_CHECK_COLLECTIVES": check},
    )
    out = result.stdout
    assert result.returncode != 0 and "UNREACHABLE" not in out, out
    assert DEADLOCK in out, out
    assert "rank 0 submitted allreduce #1" in out and "it waits in recv from rank 0" in out, out
    assert took < 60, f"a certain deadlock took {took:.0f} s to end the job"


def test_a_rank_whose_other_thread_computes_before_it_sends_is_not_a_deadlock(tmp_path):
    result, _ = launch(
        tmp_path,
        """
        import threading, time, torch, torch.distributed as dist
        import hpcddp
        dist.init_process_group("mpi")
        rank = dist.get_rank()
        got = torch.zeros(3)
        if rank == 0:
            dist.recv(got, 1)  # sent by rank 1's worker thread after 4 s of computing
            dist.send(torch.full((3,), 2.0), 1)
        else:
            def compute_then_send():
                x, until = torch.randn(64, 64), time.monotonic() + 4  # 4 x stall_timeout
                while time.monotonic() < until:
                    x = torch.tanh(x @ x)
                dist.send(torch.full((3,), 1.0), 0)
            worker = threading.Thread(target=compute_then_send)
            worker.start()
            dist.recv(got, 0)  # the main thread waits meanwhile: every rank "waits"
            worker.join()
        print(f"RESULT {rank} {got.tolist()}", flush=True)
        dist.destroy_process_group()
        """,
        env={"HPCDDP_STALL_TIMEOUT": "1"},
    )
    out = clean_output(result)
    assert "RESULT 0 [1.0, 1.0, 1.0]" in out and "RESULT 1 [2.0, 2.0, 2.0]" in out, out


def test_a_deadlock_in_a_subgroup_is_reported_with_the_jobs_rank_numbers(tmp_path):
    result, _ = launch(
        tmp_path,
        """
        import torch, torch.distributed as dist
        import hpcddp
        dist.init_process_group("mpi")
        pair = dist.new_group([1, 2])
        t = torch.ones(2)
        rank = dist.get_rank()
        if rank == 0:
            dist.barrier()
        elif rank == 1:
            dist.all_reduce(t, group=pair)
        else:
            dist.recv(t, 0)
        print("UNREACHABLE", flush=True)
        """,
        env={"HPCDDP_STALL_TIMEOUT": "2"},
        ranks=3,
    )
    out = result.stdout
    assert result.returncode != 0 and "UNREACHABLE" not in out, out
    assert DEADLOCK in out, out
    # Within the pair, ranks 1 and 2 are its ranks 0 and 1: the report must use the job's numbers,
    # whether the pair's stall is reported first or the default group's (which names the pair).
    assert "on the group of ranks 1, 2" in out, out
    assert re.search(r"rank 1 (submitted|did not submit barrier #1: .* waits in) allreduce #1", out), out
    assert "rank 2 did not submit allreduce #1" in out, out


@pytest.mark.parametrize(("ranks", "backend"), [(2, "mpi"), (3, "mpi"), (2, "gloo")])
def test_sys_exit_on_one_rank_ends_the_job_promptly_with_its_exit_code(tmp_path, ranks, backend):
    # On gloo the other rank waits in the agreement before the allreduce: the stall
    # inspector must see that wait too (it hung until gloo's 30-minute timeout).
    result, _ = launch(
        tmp_path,
        f"""
        import sys, time, torch, hpcddp
        hpcddp.init(backend={backend!r})
        for _ in range(5):
            hpcddp.allreduce(torch.ones(3))
        if hpcddp.rank() == 1:
            print(f"EXIT_AT {{time.time()}}", flush=True)
            sys.exit(3)
        hpcddp.allreduce(torch.ones(3))
        print("UNREACHABLE", flush=True)
        """,
        ranks=ranks,
    )
    ended = time.time()
    out = result.stdout
    # Open MPI's prterun has crashed (SIGSEGV, -11) once while carrying out the MPI_Abort
    # with code 3 that hpcddp asked for: then the abort's own report must show the code.
    launcher_crashed = result.returncode < 0 and "Errorcode: 3" in out
    assert result.returncode == 3 or launcher_crashed, out
    assert "rank 1 exited with exit code 3" in out and "UNREACHABLE" not in out, out
    exited = float(re.search(r"EXIT_AT (\S+)", out).group(1))
    assert ended - exited < 30, f"the job took {ended - exited:.0f} s to end after sys.exit(3)"


@pytest.mark.parametrize("mixed", [False, True], ids=["mpi", "hpcddp-mpi-and-gloo"])
def test_an_exception_after_init_process_group_prints_its_traceback_once(tmp_path, mixed):
    start = 'hpcddp.init(backend="mpi")\ndist.init_process_group("gloo")' if mixed else 'dist.init_process_group("mpi")'
    result, _ = launch(
        tmp_path,
        f"""
import torch, torch.distributed as dist, hpcddp
{start}
for _ in range(3):
    dist.all_reduce(torch.ones(2))
if dist.get_rank() == 1:
    raise ValueError("boom on purpose")
dist.all_reduce(torch.ones(2))
""",
    )
    out = result.stdout
    assert result.returncode != 0, out
    assert out.count("ValueError: boom on purpose") == 1, out
    assert "[hpcddp rank 1] uncaught exception:" in out, out


NO_HPCDDP = """
import torch, torch.distributed as dist
dist.init_process_group("mpi")
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("RESULT", dist.get_rank(), dist.get_world_size(), t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_init_process_group_mpi_without_hpcddp_init_under_hpcddp_run(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(NO_HPCDDP)  # never imports hpcddp: hpcddp run's sitecustomize routes "mpi"
    result = subprocess.run(
        [sys.executable, "-m", "hpcddp.cli", "run", "-np", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        cwd=ROOT,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "RESULT 0 2 [3.0, 3.0, 3.0]" in out and "RESULT 1 2 [3.0, 3.0, 3.0]" in out, out


def test_init_process_group_mpi_after_import_hpcddp_needs_no_init(tmp_path):
    result, _ = launch(tmp_path, "import hpcddp" + NO_HPCDDP)
    out = result.stdout
    assert result.returncode == 0, out
    assert "RESULT 0 2 [3.0, 3.0, 3.0]" in out and "RESULT 1 2 [3.0, 3.0, 3.0]" in out, out


def test_random_delays_and_subgroups_at_a_one_second_stall_timeout_never_abort(tmp_path):
    """The inspector's stress test: 3 ranks, 200 steps, pauses of up to 1.6 x stall_timeout."""
    result, _ = launch(
        tmp_path,
        textwrap.dedent(
            """
            import random, time, torch, torch.distributed as dist, hpcddp
            dist.init_process_group("mpi")
            rank, size = dist.get_rank(), dist.get_world_size()
            rng = random.Random(rank)
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 4)
            opt = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
            pairs = [dist.new_group([0, 1]), dist.new_group([1, 2])]
            for step in range(200):
                if rng.random() < 0.03:
                    time.sleep(rng.uniform(0.2, 1.6))
                elif rng.random() < 0.2:
                    time.sleep(rng.uniform(0.0, 0.05))
                opt.zero_grad()
                model(torch.ones(2, 16)).sum().backward()
                opt.step()
                members = [0, 1] if step % 2 == 0 else [1, 2]
                if rank in members:
                    t = torch.full((4,), float(step + rank))
                    dist.all_reduce(t, group=pairs[step % 2])
                    want = float(2 * step + sum(members))
                    assert t.tolist() == [want] * 4, (step, t)
                if step % 10 == 0:
                    t = torch.tensor([float(rank)])
                    hpcddp.allreduce_(t, op="sum")
                    assert t.item() == size * (size - 1) / 2
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            gathered = [torch.empty_like(weights) for _ in range(size)]
            dist.all_gather(gathered, weights)
            assert all(torch.equal(g, weights) for g in gathered), "replicas diverged"
            print(f"DONE {rank}", flush=True)
            dist.destroy_process_group()
            """
        ),
        env={"HPCDDP_STALL_TIMEOUT": "1"},
        ranks=3,
    )
    out = clean_output(result)
    assert out.count("DONE") == 3, out


def test_a_joined_rank_beside_long_allreduces_is_not_a_deadlock(tmp_path):
    result, _ = launch(
        tmp_path,
        """
        import time, torch, hpcddp.horovod as hvd
        hvd.init()
        if hvd.rank() == 1:
            time.sleep(2.5)  # rank 0 has joined and waits 2.5 x stall_timeout
            for _ in range(3):
                t = torch.ones(20_000_000)
                hvd.allreduce_(t, op=hvd.Sum)
                assert t[0].item() == 1.0 and t[-1].item() == 1.0  # rank 0 joined: it adds nothing
        hvd.join()
        print(f"DONE {hvd.rank()}", flush=True)
        """,
        env={"HPCDDP_STALL_TIMEOUT": "1"},
    )
    out = clean_output(result)
    assert out.count("DONE") == 2, out


def test_allreduce_beyond_mpis_32_bit_counts_is_right_at_bounded_memory(tmp_path):
    # Issue 18: 2^31 + 16 int8 elements failed with MPI_ERR_ARG; 2 GiB of fp16 was OOM-killed at 11.8 GB.
    result, _ = launch(
        tmp_path,
        """
        import resource, torch, hpcddp
        hpcddp.init()
        rank = hpcddp.rank()
        x = torch.full((2**31 + 16,), rank + 1, dtype=torch.int8)
        x[-1] = 5 * (rank + 1)  # the last element lies past the first 2^31
        hpcddp.allreduce_(x, op="sum")
        int8 = bool((x[:-1] == 3).all()) and x[-1].item() == 15
        del x
        y = torch.full((2**30 + 8,), 0.5 * (rank + 1), dtype=torch.float16)  # 2 GiB + 16 bytes
        y[-1] = 2.0 * (rank + 1)
        hpcddp.allreduce_(y, op="sum")
        fp16 = bool((y[:-1] == 1.5).all()) and y[-1].item() == 6.0
        del y
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"RESULT {rank} {int8} {fp16} {peak:.2f}", flush=True)
        """,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    results = re.findall(r"RESULT (\d) (\w+) (\w+) ([\d.]+)", out)
    assert sorted(r[:3] for r in results) == [("0", "True", "True"), ("1", "True", "True")], out[-3000:]
    assert max(float(r[3]) for r in results) < 6.0, f"peak resident GiB per rank: {results}"  # 2 GiB tensor + one copy
