"""Count what one gradient bucket costs in Python: hpcddp's calls, the modules they are in, the threads alive.

The model of docs/bucket_road_cost.py (N one-layer buckets) trains with hpcddp.DistributedOptimizer
while a profile function, installed on every thread before ``hpcddp.init()`` starts any, counts each
call of a function defined in the hpcddp package, by thread and module. The same steps with one bucket
give what a step costs whatever its buckets; the difference, divided by N - 1, is one bucket's road.
Printed on rank 0: calls per bucket by thread, the modules a bucket's road enters, and the threads
alive while training (Python's, and the process's, which includes MPI's and torch's). Run at 2 ranks:
    mpirun -np 2 python docs/road_counts.py 64
"""

import collections
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bucket_road_cost import LAYER_WIDTH, hpcddp_and_raw_steps  # noqa: E402

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hpcddp") + os.sep

counting = False
calls: collections.Counter = collections.Counter()  # (thread name, module) -> calls


def count(frame, event, arg):
    if counting and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        module = frame.f_code.co_filename[len(PACKAGE) :].removesuffix(".py").replace(os.sep, ".")
        calls[(threading.current_thread().name, module)] += 1


def counted(num_layers: int, comm, warmup: int, steps: int) -> collections.Counter:
    """The calls of ``steps`` steps of the ``num_layers``-bucket model, after ``warmup`` uncounted ones."""
    global counting
    hpcddp_step, _ = hpcddp_and_raw_steps(num_layers, comm, torch.randn(4, LAYER_WIDTH))
    for _ in range(warmup):
        hpcddp_step()
    comm.Barrier()
    calls.clear()
    counting = True
    for _ in range(steps):
        hpcddp_step()
    counting = False
    comm.Barrier()
    return collections.Counter(calls)


def main(num_layers: int = 64, warmup: int = 10, steps: int = 20) -> None:
    sys.setprofile(count)
    threading.setprofile(count)  # every thread started from here on, hpcddp's own included
    import hpcddp

    hpcddp.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    torch.set_num_threads(1)
    many = counted(num_layers, comm, warmup, steps)
    python_threads, process_threads = threading.active_count(), len(os.listdir("/proc/self/task"))
    one = counted(1, comm, warmup, steps)
    sys.setprofile(None)
    threading.setprofile(None)
    per_bucket = {key: (many[key] - one[key]) / (steps * (num_layers - 1)) for key in many | one}
    by_thread: collections.Counter = collections.Counter()
    for (thread, _), n in per_bucket.items():
        by_thread[thread] += n
    by_module: collections.Counter = collections.Counter()
    for (_, module), n in per_bucket.items():
        by_module[module] += n
    # A module whose calls grow by half a call a bucket or more is on the road (polling loops grow with time only).
    modules = [f"{module} {n:.1f}" for module, n in by_module.most_common() if n >= 0.5]
    per_step = sum(one.values()) / steps
    if comm.rank == 0:
        print(f"{num_layers} one-layer buckets against 1, {comm.size} ranks, {steps} steps counted:")
        print(f"  hpcddp Python calls per bucket, all threads: {sum(by_thread.values()):.1f}")
        for thread, n in by_thread.most_common():
            print(f"    {thread:24s} {n:6.1f}")
        print(f"  modules a bucket's road enters (calls per bucket): {len(modules)}: {', '.join(modules)}")
        print(f"  a step of one bucket, all of it: {per_step:.0f} calls")
        print(f"  threads alive while training: {python_threads} Python, {process_threads} in the process")
    hpcddp.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
