"""``python -m hpcddp.testing N TIMEOUT cmd...``: run ``cmd`` on N ranks, killed after TIMEOUT seconds."""

import sys

from . import run_mpi

if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python -m hpcddp.testing NUM_RANKS TIMEOUT_S COMMAND [ARGS...]")
    result = run_mpi(int(sys.argv[1]), sys.argv[3:], float(sys.argv[2]))
    print(result.stdout)
    sys.exit(result.returncode)
