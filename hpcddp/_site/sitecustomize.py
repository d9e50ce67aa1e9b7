"""Put on PYTHONPATH by ``hpcddp run`` and ``slurm/train.sh``: scripts written for torchrun or for
torch's MPI backend run without ``hpcddp.init()``.

At the start of every Python process it exports torchrun's rank variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK) from the launcher's own
(mpirun's OMPI_COMM_WORLD_*, srun's SLURM_*), without starting MPI: this runs in
DataLoader workers and a rank's subprocesses too. In the rank itself SIGUSR1 and SIGTERM
are held from here on for the script's ``PreemptionHandler``. The rest waits until the
script imports torch; then hpcddp's ``torch_backend.autoinit.enable()`` runs
(``_hpcddp_startup``, the code the installed ``hpcddp-torchrun-env.pth`` runs under a plain
mpirun too). A ``sitecustomize`` further along the path (a site's or a virtual
environment's) still runs.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_the_next_sitecustomize() -> None:
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_hpcddp_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_run_the_next_sitecustomize()
# This folder is on sys.path; the .pth may have loaded the module already (then it is that one).
import _hpcddp_startup  # noqa: E402

_hpcddp_startup.start_under_hpcddp_run()
