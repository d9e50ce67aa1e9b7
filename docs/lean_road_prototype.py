"""Throwaway prototypes of a lean gradient road, timed beside hpcddp's and the raw floor.

Each road reduces the same model (N small layers, one bucket each, as in
docs/bucket_road_cost.py) and they take turns step by step; the medians of the slowest rank
are compared with ``raw`` (backward, then one blocking in-place ``MPI_Allreduce`` per gradient
from the training thread: no overlap, no bookkeeping). The roads:

- ``hpcddp``: ``hpcddp.DistributedOptimizer`` as it is;
- ``hook``: every gradient is a view of one flat buffer (no copy in or out); a
  post-accumulate-grad hook counts its bucket and, once full, starts ``MPI_Iallreduce`` on
  the bucket's slice from the hook itself (MPI's own non-blocking progress, no thread); the
  step waits for them all (``Waitall``), probes the whole buffer for inf/NaN once and divides
  it once;
- ``thread``: the same views and hooks, but a full bucket is handed to one communication
  thread (a ``SimpleQueue``) that runs the blocking ``MPI_Allreduce``; the step waits for the
  thread's count.

A prototype, not hpcddp: no agreement on the step, no control numbers, no timeline. What it
measures is the host cost the road's shape sets. Run at 2 ranks:
    mpirun -np 2 python docs/lean_road_prototype.py 64
"""

import os
import queue
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bucket_road_cost import LAYER_WIDTH, hpcddp_and_raw_steps, layers, time_in_turns  # noqa: E402

import hpcddp  # noqa: E402


class FlatGrads:
    """Gradients as views of one flat buffer, one bucket per parameter, counted by hooks."""

    def __init__(self, params, start_bucket) -> None:
        self.params = list(params)
        self.flat = torch.zeros(sum(p.numel() for p in self.params))
        self.views, offset = [], 0
        for param in self.params:
            view = self.flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            param.grad = view
            self.views.append(view)
        self.start_bucket = start_bucket
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(lambda _p, index=index: self.start_bucket(index))

    def zero_grad(self) -> None:
        self.flat.zero_()  # the views stay: backward accumulates into them


def main(num_layers: int = 64, steps: int = 400) -> None:
    hpcddp.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    thread_comm = MPI.COMM_WORLD.Dup()
    size = comm.Get_size()
    torch.set_num_threads(1)
    x = torch.randn(4, LAYER_WIDTH)
    hpcddp_step, raw_step = hpcddp_and_raw_steps(num_layers, comm, x)
    reference = raw_step.model

    # -- hook: Iallreduce from the hook ------------------------------------------------------
    hook_model = layers(num_layers)
    hook_sgd = torch.optim.SGD(hook_model.parameters(), lr=0.0)
    requests: list = []

    def start_in_hook(index: int) -> None:
        requests.append(comm.Iallreduce(MPI.IN_PLACE, hook_grads.views[index].numpy(), op=MPI.SUM))

    hook_grads = FlatGrads(hook_model.parameters(), start_in_hook)

    def hook_step() -> None:
        hook_grads.zero_grad()
        requests.clear()
        hook_model(x).sum().backward()
        MPI.Request.Waitall(requests)
        if not bool(torch.isfinite(hook_grads.flat).all()):
            raise FloatingPointError("non-finite gradient")
        hook_grads.flat.div_(size)
        hook_sgd.step()

    # -- thread: one communication thread ------------------------------------------------------
    thread_model = layers(num_layers)
    thread_sgd = torch.optim.SGD(thread_model.parameters(), lr=0.0)
    work: queue.SimpleQueue = queue.SimpleQueue()
    done = threading.Semaphore(0)

    def serve() -> None:
        while True:
            index = work.get()
            if index is None:
                return
            thread_comm.Allreduce(MPI.IN_PLACE, thread_grads.views[index].numpy(), op=MPI.SUM)
            done.release()

    thread_grads = FlatGrads(thread_model.parameters(), work.put)
    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def thread_step() -> None:
        thread_grads.zero_grad()
        thread_model(x).sum().backward()
        for _ in range(num_layers):
            done.acquire()
        if not bool(torch.isfinite(thread_grads.flat).all()):
            raise FloatingPointError("non-finite gradient")
        thread_grads.flat.div_(size)
        thread_sgd.step()

    # The lean roads must give the raw road's gradients.
    for run in (raw_step, hook_step, thread_step):
        run()
    for mine, theirs in ((hook_model, reference), (thread_model, reference)):
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(a.grad, b.grad)

    roads = [("hpcddp", hpcddp_step), ("raw", raw_step), ("hook", hook_step), ("thread", thread_step)]
    slowest = time_in_turns(roads, steps, comm)
    work.put(None)
    server.join(timeout=10)
    if comm.rank == 0:
        raw = slowest["raw"]
        print(f"{num_layers} buckets, {size} ranks, medians of {steps - steps // 8} steps, slowest rank:")
        for name, micros in slowest.items():
            print(
                f"  {name:7s} step {micros:7.0f} us   extra per bucket over raw {(micros - raw) / num_layers:6.1f} us"
            )
    hpcddp.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
