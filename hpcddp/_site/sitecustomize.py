"""Put on PYTHONPATH by ``hpcddp run`` and ``slurm/train.sh``: scripts written for torchrun or for
torch's MPI backend run without ``hpcddp.init()``.

At the start of every Python process it exports torchrun's rank variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK) from the launcher's own
(mpirun's OMPI_COMM_WORLD_*, srun's SLURM_*), without starting MPI: this runs in
DataLoader workers and a rank's subprocesses too. The rest waits until the script
imports torch; then hpcddp's ``torch_backend.autoinit.enable()`` runs. A
``sitecustomize`` further along the path (a site's or a virtual environment's) still runs.
"""

import importlib
import importlib.abc
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


def _load_hpcddp_env():
    """hpcddp's env/ folder, loaded alone under a name of its own.

    ``import hpcddp.env`` would run ``hpcddp/__init__.py``, which imports torch (seconds,
    in every Python process); env/ imports nothing else of hpcddp (tests/test_layout.py).
    """
    name = "_hpcddp_site_env"
    if name not in sys.modules:
        folder = os.path.join(os.path.dirname(_HERE), "env")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.torchrun")


def _export_launcher_variables() -> None:
    """Give a rank that mpirun or srun started the variables torchrun would have given it."""
    values = _load_hpcddp_env().launcher_variables(os.environ)
    for name, value in values.items():
        # Set already: the launcher started the rank without them (it drops stale ones), so
        # this process is a rank's child, whose parent gave or changed them on purpose.
        os.environ.setdefault(name, value)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when torch is imported, runs ``enable()`` right after torch's own import."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the search below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_enable(module):
            exec_module(module)
            try:
                from hpcddp.fault.abort import mark_configuration_error
                from hpcddp.runtime.lifecycle import init
                from hpcddp.torch_backend.autoinit import enable

                enable(init, mark_configuration_error)
            except Exception as err:  # noqa: BLE001 - the script must still run as it would without hpcddp
                print(f"hpcddp: init_process_group('mpi') not routed to hpcddp: {err}", file=sys.stderr)

        spec.loader.exec_module = exec_then_enable
        return spec


_run_the_next_sitecustomize()
try:
    _export_launcher_variables()
except Exception as err:  # noqa: BLE001 - the script must still start
    print(f"hpcddp: torchrun's variables not exported: {err}", file=sys.stderr)
if "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorchImport())
