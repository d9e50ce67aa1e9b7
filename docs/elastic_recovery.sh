#!/usr/bin/env bash
# Elastic recovery on the virtual cluster: crash a node mid-training, let it return; per run the
# seconds from the crash to the first step at 2 ranks, the steps run again, and the seconds from the
# node's return to the first step at 4 ranks (docs/BENCHMARKS.md, "Elastic recovery").
set -euo pipefail

# Runs to take the medians of.
RUNS=${RUNS:-3}
# Which ways to start the job: mpirun (hpcddp run with a discovery script), sbatch (slurm/train.sh), or both.
HOW=${HOW:-mpirun or sbatch}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((i = 1; i <= RUNS; i++)); do
    HPCDDP_SLURM_TESTS=1 python -m pytest -q -s -p no:cacheprovider tests/test_elastic_cluster.py -k "$HOW" |
        grep -E '^\{"how"' | tee -a "$results"
done
python - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
for how in sorted({r["how"] for r in runs}):
    mine = [r for r in runs if r["how"] == how]
    for key in ("recovery_s", "steps_lost", "grow_back_s"):
        print(f"{how} {key}: median {statistics.median(r[key] for r in mine)} of {[r[key] for r in mine]}")
PY
