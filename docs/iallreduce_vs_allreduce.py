"""Open MPI's non-blocking allreduce against its blocking one, at the sizes of gradient buckets.

Before moving a bucket's reduction from a communication thread (a blocking ``MPI_Allreduce``)
to its gradient hook (``MPI_Iallreduce``, completed later), the two must move data equally
fast. For each size, in turns, ten times: the blocking in-place ``Allreduce``, the in-place
``Iallreduce`` waited at once, and the same tested in a loop (its progress happens only inside
MPI calls). Medians in ms, rank 0. Run at 2 ranks, then with libnbc's algorithm chosen:
    mpirun -np 2 python docs/iallreduce_vs_allreduce.py
    mpirun -np 2 --mca coll_libnbc_iallreduce_algorithm 1 python docs/iallreduce_vs_allreduce.py
"""

import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD.Dup()
    for mib in (1, 4, 16, 25, 64):
        data = np.ones(mib * 2**18, np.float32)
        times: dict[str, list[float]] = {"Allreduce": [], "Iallreduce+Wait": [], "Iallreduce+Test loop": []}
        for _ in range(10):
            for kind, samples in times.items():
                comm.Barrier()
                start = time.perf_counter()
                if kind == "Allreduce":
                    comm.Allreduce(MPI.IN_PLACE, data)
                elif kind == "Iallreduce+Wait":
                    comm.Iallreduce(MPI.IN_PLACE, data).Wait()
                else:
                    request = comm.Iallreduce(MPI.IN_PLACE, data)
                    while not request.Test():
                        pass
                samples.append(time.perf_counter() - start)
        if comm.rank == 0:
            medians = ", ".join(f"{kind} {np.median(s) * 1e3:.2f}" for kind, s in times.items())
            print(f"{mib:3d} MiB, {comm.size} ranks: {medians} ms", flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
