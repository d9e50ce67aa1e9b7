"""Host cost per step of a bucket's used flags: writing them before the reduction, reading them after.

Before: each bucket's flags were copied in from a host list and read back with one test of
all(); on a GPU each is a host sync (2 per bucket). Now: fills of runs of ones per bucket,
and one read of every bucket's counters per step (1 sync per step). Run on the CPU:
    PYTHONPATH=. python docs/bucket_flags_cost.py
"""

import statistics
import time

import torch

from hpcddp.ddp.buckets import build_buckets, drop_unused_grads, write_used_flags


def old_drop(bucket):
    if bool((bucket.used != 0).all()):
        return
    for param, used in zip(bucket.params, bucket.used.tolist()):
        if used == 0:
            param.grad = None


def old(buckets, flags):
    for bucket in buckets:
        bucket.used.copy_(torch.tensor(flags, dtype=bucket.used.dtype))
    for bucket in buckets:
        old_drop(bucket)


def new(buckets, flags):
    for bucket in buckets:
        write_used_flags(bucket.used, flags)
    drop_unused_grads(buckets)


def main():
    for num_buckets in (4, 64, 512):
        params = [torch.nn.Parameter(torch.zeros(16)) for _ in range(num_buckets * 4)]
        buckets = build_buckets(params, 4 * 16 * 4, 4 * 16 * 4)
        assert len(buckets) == num_buckets
        flags = [True] * 4

        medians = {}
        for name, run in (("old", old), ("new", new)):
            times = []
            for _ in range(50):
                start = time.perf_counter()
                run(buckets, flags)
                times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times) * 1e6
        print(
            f"{num_buckets} buckets: before {medians['old']:.0f} us/step, now {medians['new']:.0f} us/step, "
            f"ratio {medians['old'] / medians['new']:.2f}; GPU host syncs per step before {2 * num_buckets}, now 1"
        )


if __name__ == "__main__":
    main()
