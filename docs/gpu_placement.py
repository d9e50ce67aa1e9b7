"""Start-up cost of placing the ranks of one node on its GPUs (hpcddp.runtime.device.place_rank), simulated in one process."""

import statistics
import time

from hpcddp.runtime.device import GPU, NodePeer, place_rank

for local in (4, 8, 64, 256):
    gpus = tuple(GPU(f"GPU-{i}", f"0000:{i:02x}:00.0") for i in range(8))
    peers = [NodePeer(gpus, frozenset(range(64)))] * local
    times = []
    for _ in range(5):
        t = time.perf_counter()
        placed = [place_rank(r, r, peers) for r in range(local)]  # every local rank's work, in one process
        times.append((time.perf_counter() - t) / local)
    print(f"local ranks {local}: place_rank per rank median {statistics.median(times) * 1e3:.3f} ms")
