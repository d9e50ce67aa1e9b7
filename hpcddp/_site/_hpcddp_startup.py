"""What hpcddp does when a rank's Python starts, before its script: torchrun's variables, the torch hook.

Two ways in, one code:

- ``hpcddp-torchrun-env.pth``, which pip installs into site-packages: under a plain
  ``mpirun``/``mpiexec`` or ``srun`` of two or more processes, in a process started without
  ``RANK``, it loads this file alone and calls ``start_in_launch()`` (its one line reads a few
  variables of ``os.environ`` and imports nothing anywhere else: ~µs in every Python);
- ``sitecustomize``, which ``hpcddp run`` and ``slurm/train.sh`` put first on
  ``PYTHONPATH``, calls ``start_under_hpcddp_run()``.

Both give the rank torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
GROUP_RANK, NODE_RANK, GROUP_WORLD_SIZE where the launcher names the node) from the
launcher's own, without starting MPI, so that a script that checks ``RANK`` itself (nanoGPT:
``ddp = int(os.environ.get('RANK', -1)) != -1``) runs as one job, not as N separate copies.
When the script imports torch, ``hpcddp.torch_backend.autoinit.enable()`` runs: its
``init_process_group`` (env://) then gets MASTER_ADDR/MASTER_PORT through hpcddp's rendezvous
over MPI, and ``init_process_group("mpi")`` reaches hpcddp. Under ``hpcddp run`` stop signals
are held from here on for the script's ``PreemptionHandler`` (``hpcddp.fault.stop_signals``).

Loaded by file, not imported as part of hpcddp: ``import hpcddp`` imports torch (seconds, in
every Python process, DataLoader workers too). env/ and ``fault/stop_signals.py`` import
nothing else of hpcddp (tests/test_layout.py, tests/test_torchrun.py), so they are loaded
alone the same way.
"""

import importlib
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
# Captured before anything here exports it: a process started without RANK is one the
# launcher started (it starts ranks without stale rank variables); one with RANK is a rank's child.
_STARTED_WITHOUT_RANK = not os.environ.get("RANK")
_hooked: list[bool] = []


def _load_alone(name: str, path: str):
    """Load the module at ``path`` under ``name``, without its parent packages."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _env(submodule: str):
    """One module of hpcddp's env/ folder, loaded alone: the folder as a package of its own name.

    Its ``__init__`` is not run: it imports every launch environment, and a start needs two modules.
    """
    name = "_hpcddp_site_env"
    if name not in sys.modules:
        folder = os.path.join(_PACKAGE, "env")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{name}.{submodule}")


def _export(values: dict[str, str]) -> None:
    """Give a rank that mpirun or srun started the variables torchrun would have given it."""
    for name, value in values.items():
        # Set already: the launcher started the rank without them (it drops stale ones), so
        # this process is a rank's child, whose parent gave or changed them on purpose.
        if not os.environ.get(name):
            os.environ[name] = value


class _AfterTorchImport:
    """Finds nothing itself; when torch is imported, runs ``enable()`` right after torch's own import.

    A meta path finder by protocol, not by importlib.abc's class: that module costs a start 0.4 ms.
    """

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
                print(f"hpcddp: init_process_group not routed to hpcddp: {err}", file=sys.stderr)

        spec.loader.exec_module = exec_then_enable
        return spec


def _hook_torch_import() -> None:
    if "torch" not in sys.modules and not _hooked:
        sys.meta_path.insert(0, _AfterTorchImport())
        _hooked.append(True)


def _warn(what: str, err: BaseException) -> None:
    print(f"hpcddp: {what}: {err}", file=sys.stderr)


def start_in_launch() -> None:
    """From the installed .pth: give a rank that a plain mpirun or srun started torchrun's variables.

    Only for a rank the launcher started itself (RANK unset), in a job of two or more
    processes, unless HPCDDP_TORCHRUN_ENV=0.
    """
    try:
        settings = _env("settings")
        if not (_STARTED_WITHOUT_RANK and settings.read_torchrun_env_switch(os.environ)):
            return
        values = _env("launcher").launcher_variables(os.environ)
        if int(values.get("WORLD_SIZE", "1")) < 2:
            return
        _export(values)
    except Exception as err:  # noqa: BLE001 - the script must still start
        _warn("torchrun's variables not exported", err)
        return
    _hook_torch_import()


def start_under_hpcddp_run() -> None:
    """From ``hpcddp run``'s sitecustomize: torchrun's variables, held stop signals, the torch hook."""
    try:
        _export(_env("launcher").launcher_variables(os.environ))
    except Exception as err:  # noqa: BLE001 - the script must still start
        _warn("torchrun's variables not exported", err)
    if _STARTED_WITHOUT_RANK:
        try:
            wait_s = _env("settings").read_stop_wait(os.environ)
            stop_signals = _load_alone("_hpcddp_site_stop_signals", os.path.join(_PACKAGE, "fault", "stop_signals.py"))
            stop_signals.hold_stop_signals(wait_s)
        except Exception as err:  # noqa: BLE001 - the script must still start; init() holds them again
            _warn("stop signals not held before hpcddp.init()", err)
    _hook_torch_import()
