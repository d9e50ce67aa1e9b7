"""Bytes every rank reads to load one checkpoint, summed over the ranks (docs/BENCHMARKS.md).

    mpirun --allow-run-as-root --oversubscribe -np 4 python tests/tools/checkpoint_read_bytes.py --mb 100

Linux's ``rchar`` (/proc/self/io: bytes passed through read() and its kin, page cache hits
included) before and after ``hpcddp.load_checkpoint``, on every rank; a first load beforehand
takes what that load imports. Prints one line per repeat and the median ratio to the file.
"""

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

import hpcddp


def read_so_far() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="checkpoint size in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hpcddp.init()
    directory = Path(hpcddp.broadcast_object(tempfile.mkdtemp(prefix="ckpt-read-") if hpcddp.rank() == 0 else None))
    try:
        hpcddp.save_checkpoint(directory, {"step": 1, "w": torch.zeros(4)})
        hpcddp.load_checkpoint(directory)
        weights = torch.arange(int(args.mb * 1e6 / 4), dtype=torch.float32)
        hpcddp.save_checkpoint(directory, {"step": 2, "w": weights}, keep_last=1)
        size = (directory / "checkpoint-000002.pt").stat().st_size
        ratios = []
        for repeat in range(args.repeats):
            hpcddp.barrier()
            before = read_so_far()
            state = hpcddp.load_checkpoint(directory)
            read = hpcddp.allgather_object(read_so_far() - before)
            assert torch.equal(state["w"], weights)
            del state
            ratios.append(sum(read) / size)
            if hpcddp.rank() == 0:
                per_rank = ", ".join(f"{r / 1e6:.1f}" for r in read)
                print(f"repeat {repeat}: {size / 1e6:.1f} MB file, read per rank [{per_rank}] MB, "
                      f"sum {sum(read) / 1e6:.1f} MB = {ratios[-1]:.2f}x")  # fmt: skip
        if hpcddp.rank() == 0:
            print(f"{hpcddp.size()} ranks: median {statistics.median(ratios):.2f}x the file's size read")
    finally:
        hpcddp.barrier()
        if hpcddp.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
