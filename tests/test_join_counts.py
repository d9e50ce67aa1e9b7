"""hpcddp.join at more ranks than bf16 counts exactly (issue 18): 300 simulated ranks, bf16 buckets.

Each simulated rank is a Reducer on its own copy of a small model, on a communicator
whose allreduce sums the 300 ranks' buckets in bfloat16, pairwise as MPI's recursive
doubling does, rounding at every step. 291 ranks have data (an odd count above 256,
not a bf16 number); 9 have joined and send zeros. Reference: plain arithmetic.
"""

import threading

import pytest
import torch

from hpcddp.comm.base import Handle, ReduceOp
from hpcddp.comm.local import LocalCommunicator
from hpcddp.ddp.reducer import Reducer

pytestmark = pytest.mark.unit

SIZE, ACTIVE = 300, 291


def _tree_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum pairwise in the tensors' dtype, rounded at every step, as MPI's recursive doubling does."""
    while len(tensors) > 1:
        tensors = [a + b for a, b in zip(tensors[::2], tensors[1::2])] + ([tensors[-1]] if len(tensors) % 2 else [])
    return tensors[0].clone()


class SimulatedWorld:
    """Every simulated rank's payload of one collective; the last to arrive sums them in bf16."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[int, list] = {}

    def allreduce(self, rank: int, seq: int, tensor: torch.Tensor) -> Handle:
        handle = Handle("allreduce")
        with self.lock:
            entries = self.calls.setdefault(seq, [])
            entries.append((rank, tensor, handle))
            if len(entries) == SIZE:
                total = _tree_sum([payload for _, payload, _ in sorted(entries, key=lambda e: e[0])])
                for _, payload, waiting in entries:
                    payload.copy_(total)
                    waiting.set_result(payload)
        return handle


class SimulatedRank(LocalCommunicator):
    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        super().__init__()
        self.rank, self.size = rank, SIZE
        self._world, self._seq = world, 0

    def allreduce_async_(self, tensor, op, *, check=None, label="", step=None):
        assert op is ReduceOp.SUM
        self._seq += 1
        return self._world.allreduce(self.rank, self._seq, tensor)


def test_joined_ranks_are_counted_exactly_beyond_256_ranks_in_bf16_buckets():
    world = SimulatedWorld()
    results = [None] * SIZE

    def run(rank: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        reducer = Reducer(
            list(model.named_parameters()),
            SimulatedRank(world, rank),
            op=ReduceOp.AVERAGE,
            bucket_cap_bytes=1 << 20,
            first_bucket_bytes=1 << 20,
            wire_dtype=torch.bfloat16,
            predivide=1.0,
        )
        reducer.divide_by_active = True
        if rank < ACTIVE:
            model(torch.ones(1, 3)).sum().backward()  # gradient: ones
            reducer.synchronize()
        else:  # joined: shadows the others with zeros, as hpcddp.join does
            reducer.has_data = False
            reducer.synchronize(force=True)
        results[rank] = (reducer.active_ranks, model.weight.grad.clone())

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(r is not None for r in results), "a simulated rank did not finish"
    assert {active for active, _ in results} == {ACTIVE}  # one bf16 count would read 292
    for _, grad in results:
        # the average over the ranks with data of their gradients (ones), to bf16's rounding of the sum
        torch.testing.assert_close(grad, torch.ones(1, 3), rtol=1e-2, atol=0)
