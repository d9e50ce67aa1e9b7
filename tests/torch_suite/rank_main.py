"""One rank of torch's distributed suite: ``mpirun -np N python -m tests.torch_suite.rank_main``.

As upstream ran it for MPI (``test_distributed_fork.py``): every process is one rank,
the default group is made once, and each rank runs the same tests in the same order.
Each rank appends one JSON line per test start and per outcome to
``$SUITE_OUT/rank<r>.jsonl``; the driver reads them.

Environment: ``BACKEND`` (``mpi`` through hpcddp, or ``gloo``), ``TEMP_DIR``,
``SUITE_OUT``, ``SUITE_TESTS`` (a file naming the tests to run, one per line),
``MASTER_ADDR``/``MASTER_PORT`` for gloo.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import sys
import time
import traceback
import unittest

BACKEND = os.environ.get("BACKEND", "mpi")

# The suite gates tests by backend name at import time. hpcddp's "mpi" claims DDP,
# subgroups and the CPU collectives the suite runs on gloo, so it is measured with
# those gates lifted: sets of backends gain "mpi", and these decorators (text of the
# suite's source, each must be found) let "mpi" through.
LIFTED_FEATURES = ("ddp", "subgroup", "gpu")
LIFTED_DECORATORS = (
    'require_backend_is_available({"gloo"})',  # coalesced all_reduce, monitored_barrier, scatter_object_list
    'BACKEND != "gloo", "Only gloo backend supports timeouts"',
    'BACKEND != "gloo", "GLOO Batch Send Recv CPU"',
    'BACKEND != "nccl" and BACKEND != "gloo",\n            "Only Nccl & Gloo backend support DistributedDataParallel"',
)
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"


def _launcher_rank() -> tuple[int, int]:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    return rank, size


def _lifted(source: str) -> str:
    for decorator in LIFTED_DECORATORS:
        if decorator not in source:
            raise RuntimeError(f"torch's suite changed: {decorator!r} not found; update LIFTED_DECORATORS")
        opened = decorator.replace('{"gloo"}', '{"gloo", "mpi"}').replace(
            "BACKEND !=", '(BACKEND != "mpi") and BACKEND !='
        )
        source = source.replace(decorator, opened)
    return source


def import_suite():
    """Import the suite (with the gates lifted for ``"mpi"``); return ``_DistTestBase``."""
    import importlib.util

    from torch.testing._internal import common_distributed

    if BACKEND == "mpi" and SUITE_MODULE not in sys.modules:
        for feature in LIFTED_FEATURES:
            common_distributed.DistTestCases.backend_feature[feature].add("mpi")
        common_distributed.DistTestCases.skip_collective["allgather_coalesced"].discard("mpi")
        spec = importlib.util.find_spec(SUITE_MODULE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[SUITE_MODULE] = module
        code = compile(_lifted(spec.loader.get_source(SUITE_MODULE)), spec.origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - torch's own test module, gates lifted
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    base = DistributedTest._DistTestBase
    make_group = base._init_group_test

    def group_of_ranks_1_and_2(self, **kwargs):
        # The suite's skip_if_small_worldsize exempts "mpi" because upstream ran MPI at 3 ranks.
        if int(os.environ["WORLD_SIZE"]) < 3:
            raise unittest.SkipTest("the suite's group [1, 2] needs 3 ranks")
        return make_group(self, **kwargs)

    base._init_group_test = group_of_ranks_1_and_2
    base.test_monitored_barrier_failure_order = _needs_three_ranks(
        base.test_monitored_barrier_failure_order, "the suite's test expects rank 2 to be the one that fails"
    )
    return base


def _needs_three_ranks(test, reason: str):
    """Skip ``test`` below 3 ranks (the suite's skip_if_small_worldsize exempts "mpi", which upstream ran at 3)."""

    @functools.wraps(test)
    def wrapper(self, *args, **kwargs):
        if int(os.environ["WORLD_SIZE"]) < 3:
            raise unittest.SkipTest(f"{reason}: it needs 3 ranks")
        return test(self, *args, **kwargs)

    return wrapper


def suite_class():
    import torch.distributed as dist
    from torch.testing._internal.common_utils import TestCase

    base = import_suite()
    # What the suite's MultiProcessTestCase gives each test: its rank and the world size.
    ranks = {"rank": property(lambda self: dist.get_rank()), "world_size": property(lambda self: dist.get_world_size())}
    return type("TorchDistributedSuite", (TestCase, base), ranks)


def test_names() -> list[str]:
    """Every test of the suite, in the order each rank runs them."""
    return sorted(unittest.TestLoader().getTestCaseNames(suite_class()))


def _make_default_group(rank: int, size: int):
    import torch.distributed as dist

    if BACKEND == "mpi":
        import hpcddp

        hpcddp.init()
        if not dist.is_initialized():
            dist.init_process_group("mpi")
    else:
        dist.init_process_group(BACKEND, init_method="env://", rank=rank, world_size=size)


class _Recorder(unittest.TestResult):
    """Appends each outcome of this rank as a JSON line the driver reads while the job runs."""

    def __init__(self, stream):
        super().__init__()
        self._stream = stream
        self._started = 0.0

    def _write(self, **fields):
        self._stream.write(json.dumps(fields) + "\n")
        self._stream.flush()

    def startTest(self, test):
        super().startTest(test)
        self._started = time.monotonic()
        self._write(test=test._testMethodName, event="start")

    def _outcome(self, test, outcome, detail=""):
        elapsed = round(time.monotonic() - self._started, 3)
        self._write(test=test._testMethodName, event="end", outcome=outcome, seconds=elapsed, detail=detail[-4000:])

    def addSuccess(self, test):
        self._outcome(test, "pass")

    def addFailure(self, test, err):
        self._outcome(test, "fail", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        skip = _skip_reason(err[1])
        if skip is not None:
            self._outcome(test, "skip", skip)
        else:
            self._outcome(test, "error", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        self._outcome(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        self._outcome(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        self._outcome(test, "fail", "unexpected success")


def _skip_reason(error: BaseException) -> str | None:
    """The suite skips a test by exiting with a code of ``TEST_SKIPS`` (its spawn path reads it)."""
    if not isinstance(error, SystemExit):
        return None
    from torch.testing._internal.common_distributed import TEST_SKIPS

    for skip in TEST_SKIPS.values():
        if skip.exit_code == error.code:
            return skip.message
    return None


def _realign(comm, barrier_class) -> None:
    """Put the ranks back in step after a test: a rank that failed early skipped barriers."""
    from mpi4py import MPI

    barrier_class.barrier_id = comm.allreduce(barrier_class.barrier_id, op=MPI.MAX)


def main() -> int:
    # The suite's barrier_timeout tests need group timeouts, which hpcddp enforces only on request.
    os.environ.setdefault("HPCDDP_GROUP_TIMEOUTS", "1")
    rank, size = _launcher_rank()
    os.environ.setdefault("WORLD_SIZE", str(size))
    os.environ["RANK"] = str(rank)
    with open(os.environ["SUITE_TESTS"]) as listing:
        wanted = [line.strip() for line in listing if line.strip()]
    _make_default_group(rank, size)  # first: hpcddp's "mpi" is available once hpcddp.init() ran
    cls = suite_class()
    from mpi4py import MPI
    from torch.testing._internal.distributed.distributed_test import Barrier

    # The driver's own communicator: the suite's traffic never shares one with it.
    control = MPI.COMM_WORLD.Dup()
    out_path = os.path.join(os.environ["SUITE_OUT"], f"rank{rank}.jsonl")
    with open(out_path, "a") as stream:
        # The driver signals a stuck job before ending it: every thread's stack goes to its log.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        stream.write(json.dumps({"event": "pid", "pid": os.getpid()}) + "\n")
        stream.flush()
        recorder = _Recorder(stream)
        for name in wanted:
            cls(name).run(recorder)
            _realign(control, Barrier)
            control.Barrier()
    control.Free()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
