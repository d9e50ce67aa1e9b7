"""Put on PYTHONPATH by ``hpcddp run``: ``init_process_group("mpi")`` works without ``hpcddp.init()``.

Nothing is imported until the script imports torch; then hpcddp's
``torch_backend.autoinit.enable()`` runs. A ``sitecustomize`` further along the
path (a site's or a virtual environment's) still runs.
"""

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
                from hpcddp.runtime.lifecycle import init
                from hpcddp.torch_backend.autoinit import enable

                enable(init)
            except Exception as err:  # noqa: BLE001 - the script must still run as it would without hpcddp
                print(f"hpcddp: init_process_group('mpi') not routed to hpcddp: {err}", file=sys.stderr)

        spec.loader.exec_module = exec_then_enable
        return spec


_run_the_next_sitecustomize()
if "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorchImport())
