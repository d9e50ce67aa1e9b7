#!/usr/bin/env bash
# Elastic recovery on the virtual cluster: crash a node mid-training, let it return; per run the
# seconds from the crash to the first step at 2 ranks, the steps run again, and the seconds from the
# node's return to the first step at 4 ranks (docs/BENCHMARKS.md, "Elastic recovery").
set -euo pipefail

# Runs to take the medians of.
RUNS=${RUNS:-3}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((i = 1; i <= RUNS; i++)); do
    HPCDDP_SLURM_TESTS=1 python -m pytest -q -s -p no:cacheprovider tests/test_elastic_cluster.py |
        grep -E '^\{"sizes"' | tee -a "$results"
done
python - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
for key in ("recovery_s", "steps_lost", "grow_back_s"):
    print(f"{key}: median {statistics.median(r[key] for r in runs)} of {[r[key] for r in runs]}")
PY
