"""Rank 0's peak memory with and without HPCDDP_TIMELINE (docs/BENCHMARKS.md, "Timeline memory").

    mpirun -np 4 python docs/timeline_memory.py --steps 3000                           # without
    HPCDDP_TIMELINE=/tmp/t.json mpirun -np 4 python docs/timeline_memory.py --steps 3000
    python docs/timeline_memory.py --simulate-ranks 1024 --events 3000                 # rank 0's merge alone

Rank 0 prints its peak resident memory (ru_maxrss) after hpcddp.shutdown(), which writes the
trace. --simulate-ranks writes that many ranks' event files in one process, then measures the
merge rank 0 runs at the end: its time and the most memory Python allocated meanwhile.
"""

import argparse
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--simulate-ranks", type=int, default=0)
parser.add_argument("--events", type=int, default=3000, help="events per simulated rank")
args = parser.parse_args()


def simulate_merge(num_ranks: int, num_events: int) -> None:
    from hpcddp.observe.merge import merge_rank_files
    from hpcddp.observe.timeline import Timeline, bucket_track

    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        for rank in range(num_ranks):
            recorder = Timeline(trace, rank)
            for i in range(num_events):
                recorder.span("allreduce", i * 1e-3, i * 1e-3 + 5e-4, bucket_track(i % 4), step=i)
            recorder.close()
        tracemalloc.start()
        started = time.perf_counter()
        result = merge_rank_files(trace, num_ranks, remove=True)
        seconds = time.perf_counter() - started
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
        size_mib = trace.stat().st_size / 2**20
    print(
        f"ranks {num_ranks} events {num_ranks * num_events} merged {len(result.merged)} merge_s {seconds:.1f} "
        f"merge_peak_mib {peak_mib:.1f} trace_mib {size_mib:.0f}"
    )


if args.simulate_ranks:
    simulate_merge(args.simulate_ranks, args.events)
    raise SystemExit(0)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hpcddp  # noqa: E402

hpcddp.init(backend="mpi")
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
optimizer = hpcddp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), bucket_cap_mb=0.02, first_bucket_mb=0.02
)
data = torch.randn(8, 64)
for _ in range(args.steps):
    optimizer.zero_grad()
    F.mse_loss(model(data), torch.zeros(8, 64)).backward()
    optimizer.step()
num_buckets = len(optimizer.buckets)
rank = hpcddp.rank()
hpcddp.shutdown()
if rank == 0:
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"steps {args.steps} buckets {num_buckets} rank0_max_rss_mib {peak_mib:.1f}")
