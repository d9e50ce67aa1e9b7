#!/usr/bin/env bash
# Horovod's own examples/pytorch/pytorch_synthetic_benchmark.py, unchanged but for its import
# line (`import horovod.torch as hvd` -> `import hpcddp.horovod as hvd`), against the same file
# run by real Horovod in jobs of its own, alternated: hpcddp, Horovod, hpcddp, Horovod, ...
# Prints each run's total images/s, the load average around each pair, the medians and their ratio.
#
#   HOROVOD_SRC=/path/to/horovod HOROVOD_PYTHON=/path/to/venv/bin/python bash docs/horovod_synthetic.sh
#
# Both pythons need torchvision built for their torch (a +cpu torch needs torchvision from the same
# CPU index: see docs/troubleshooting.md). The benchmark is copied from HOROVOD_SRC at run time;
# nothing of Horovod's is kept in this repository.
set -euo pipefail

HOROVOD_SRC=${HOROVOD_SRC:?set HOROVOD_SRC to a Horovod source tree (the benchmark is read from it)}
# Python with real Horovod; empty runs hpcddp alone (no pairs, no ratio).
HOROVOD_PYTHON=${HOROVOD_PYTHON:-}
# mpirun of Horovod's own MPI (the one it was built against); by default the one beside HOROVOD_PYTHON.
HOROVOD_MPIRUN=${HOROVOD_MPIRUN:-}
# Python with hpcddp and torchvision; this checkout goes first on its PYTHONPATH.
PYTHON=${PYTHON:-python}
# mpirun for hpcddp's ranks.
MPIRUN=${MPIRUN:-mpirun}
# Extra mpirun flags for both tools, e.g. --oversubscribe beyond one rank per core;
# --allow-run-as-root only because CI and these VMs run as root.
MPI_FLAGS=${MPI_FLAGS:---allow-run-as-root}
MODEL=${MODEL:-squeezenet1_1}       # a torchvision.models name
BATCH=${BATCH:-8}                   # images per rank per step
NP=${NP:-2}                         # ranks (mpirun -np)
PAIRS=${PAIRS:-3}                   # hpcddp/Horovod alternations
WARMUP=${WARMUP:-5}                 # --num-warmup-batches
BATCHES_PER_ITER=${BATCHES_PER_ITER:-5}   # --num-batches-per-iter
ITERS=${ITERS:-5}                   # --num-iters
# torch threads per rank, for both tools: Horovod leaves torch's default (every core for each
# rank), hpcddp divides the cores among a node's ranks; OMP_NUM_THREADS makes them equal.
THREADS=${THREADS:-1}
EXTRA_ARGS=${EXTRA_ARGS:-}          # more benchmark flags for both tools, e.g. --fp16-allreduce
RUN_TIMEOUT=${RUN_TIMEOUT:-900}     # seconds before one launch is killed
WORKDIR=${WORKDIR:-$(mktemp -d)}    # the two copies of the benchmark and every run's log

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source_file=$HOROVOD_SRC/examples/pytorch/pytorch_synthetic_benchmark.py
[ -f "$source_file" ] || { echo "HOROVOD_SRC=$HOROVOD_SRC has no examples/pytorch/pytorch_synthetic_benchmark.py: point it at a Horovod source tree" >&2; exit 1; }
if [ -n "$HOROVOD_PYTHON" ] && [ -z "$HOROVOD_MPIRUN" ]; then
    HOROVOD_MPIRUN=$(dirname "$HOROVOD_PYTHON")/mpirun
    [ -x "$HOROVOD_MPIRUN" ] || HOROVOD_MPIRUN=mpirun
fi

mkdir -p "$WORKDIR"
horovod_bench=$WORKDIR/horovod_synthetic_benchmark.py
hpcddp_bench=$WORKDIR/hpcddp_synthetic_benchmark.py
cp "$source_file" "$horovod_bench"
sed 's/^import horovod\.torch as hvd$/import hpcddp.horovod as hvd/' "$source_file" >"$hpcddp_bench"
# Exactly one line may differ, and it must be the import: anything else is no longer Horovod's benchmark.
changed=$(diff "$horovod_bench" "$hpcddp_bench" | grep -c '^[<>]' || true)
if [ "$changed" -ne 2 ] || ! grep -qx 'import hpcddp.horovod as hvd' "$hpcddp_bench"; then
    echo "expected exactly one changed line (the import) in $source_file, got:" >&2
    diff "$horovod_bench" "$hpcddp_bench" >&2 || true
    exit 1
fi

# shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags, split on purpose
bench_args=(--model "$MODEL" --batch-size "$BATCH" --num-warmup-batches "$WARMUP"
    --num-batches-per-iter "$BATCHES_PER_ITER" --num-iters "$ITERS" $EXTRA_ARGS)
# shellcheck disable=SC2206
mpi_flags=($MPI_FLAGS)

# Run one launch and print its total images/s (the benchmark's last line on rank 0).
run_one() {
    local tool=$1 log=$2
    if [ "$tool" = hpcddp ]; then
        PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=$THREADS timeout "$RUN_TIMEOUT" \
            "$MPIRUN" "${mpi_flags[@]}" -np "$NP" -x PYTHONPATH -x OMP_NUM_THREADS \
            "$PYTHON" "$hpcddp_bench" "${bench_args[@]}" >"$log" 2>&1
    else
        OMP_NUM_THREADS=$THREADS timeout "$RUN_TIMEOUT" \
            "$HOROVOD_MPIRUN" "${mpi_flags[@]}" -np "$NP" -x OMP_NUM_THREADS ${PYTHONPATH:+-x PYTHONPATH} \
            "$HOROVOD_PYTHON" "$horovod_bench" "${bench_args[@]}" >"$log" 2>&1
    fi || { echo "$tool run failed; its log, $log, ends:" >&2; tail -n 30 "$log" >&2; return 1; }
    sed -n 's/^Total img\/sec on [0-9]* [A-Z]*(s): \([0-9.]*\) .*/\1/p' "$log" | tail -n 1
}

load() { cut -d' ' -f1 /proc/loadavg; }

echo "model $MODEL, batch $BATCH/rank, $NP ranks, $THREADS thread(s)/rank, warm-up $WARMUP, $ITERS x $BATCHES_PER_ITER batches${EXTRA_ARGS:+, $EXTRA_ARGS}"
echo "logs in $WORKDIR"
printf '%-5s %-8s %12s %10s\n' pair tool "images/s" "load 1min"
hpcddp_rates=() horovod_rates=()
tools=(hpcddp)
[ -z "$HOROVOD_PYTHON" ] || tools+=(horovod)
for pair in $(seq 1 "$PAIRS"); do
    for tool in "${tools[@]}"; do
        before=$(load)
        rate=$(run_one "$tool" "$WORKDIR/${tool}_$pair.log")
        printf '%-5s %-8s %12s %10s\n' "$pair" "$tool" "$rate" "$before -> $(load)"
        if [ "$tool" = hpcddp ]; then hpcddp_rates+=("$rate"); else horovod_rates+=("$rate"); fi
    done
done

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
hpcddp_median=$(median "${hpcddp_rates[@]}")
echo
printf '| tool | images/s (%s ranks, median of %s) | runs |\n|---|---|---|\n' "$NP" "$PAIRS"
printf '| hpcddp.horovod | %s | %s |\n' "$hpcddp_median" "${hpcddp_rates[*]}"
if [ -n "$HOROVOD_PYTHON" ]; then
    horovod_median=$(median "${horovod_rates[@]}")
    printf '| Horovod | %s | %s |\n' "$horovod_median" "${horovod_rates[*]}"
    awk -v a="$hpcddp_median" -v b="$horovod_median" 'BEGIN {printf "\nratio hpcddp / Horovod: %.2f\n", a / b}'
fi
