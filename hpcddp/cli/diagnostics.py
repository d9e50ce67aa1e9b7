"""What ``hpcddp info`` reports: versions, MPI and GPU facts, which backends work, the rank map."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "BackendCheck",
    "check_backends",
    "describe_rank",
    "gpu_facts",
    "mpi_facts",
    "software_versions",
    "torch_backend_facts",
    "try_backends",
]

_THREAD_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}


@dataclass(kw_only=True)
class BackendCheck:
    """Whether one communication backend can be used here, and whether it worked."""

    name: str
    """"mpi", "gloo" or "nccl"."""
    available: bool
    """The library is there (mpi4py imports; torch has gloo; torch has NCCL and sees a GPU)."""
    detail: str
    """The library, or why it is missing."""
    works: bool | None = None
    """An allreduce of ones across the job gave the world size; None when not tried."""
    test: str = ""
    """What the allreduce gave and how long it took, or the error."""

    def as_dict(self) -> dict[str, Any]:
        """Return the check as a plain dict (for JSON)."""
        return asdict(self)


def software_versions() -> dict[str, str]:
    """Return the versions of hpcddp, Python, torch, mpi4py and numpy (or why one is missing)."""
    import torch

    from .. import __version__

    versions = {"hpcddp": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for module in ("mpi4py", "numpy"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = "not installed"
    return versions


def _cuda_aware_open_mpi() -> str:
    ompi_info = shutil.which("ompi_info")
    if ompi_info is None:
        return "unknown (no ompi_info)"
    try:
        out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (ompi_info failed)"
    match = re.search(r"mpi_built_with_cuda_support:value:(\w+)", out)
    return {"true": "yes", "false": "no"}.get(match.group(1), match.group(1)) if match else "unknown"


def mpi_facts() -> dict[str, str]:
    """Return the MPI library, its standard version, thread level and CUDA awareness.

    Initialises MPI through mpi4py; returns ``{"library": "not available: ..."}``
    when mpi4py cannot be imported.
    """
    try:
        from ..env.mpi_import import import_mpi

        MPI = import_mpi()
    except ImportError as err:
        return {"library": f"not available: {err}"}
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    major, minor = MPI.Get_version()
    facts = {
        "library": library,
        "standard": f"MPI {major}.{minor}",
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
    }
    facts["cuda_aware"] = _cuda_aware_open_mpi() if "Open MPI" in library else "unknown (not Open MPI)"
    return facts


def torch_backend_facts(mpi: dict[str, str]) -> dict[str, str]:
    """Return what torch.distributed's ``hpcddp`` backend offers here: its names and how CUDA tensors travel.

    Args:
        mpi: ``mpi_facts()``.
    """
    from ..torch_backend import mpi_routed

    if mpi["library"].startswith("not available"):
        return {"backend": "hpcddp: not available (needs mpi4py)"}
    return {
        "backend": 'init_process_group("hpcddp")',
        "mpi_name": 'init_process_group("mpi") reaches hpcddp (torch has no MPI of its own)'
        if mpi_routed()
        else "torch's own MPI backend",
        "cuda_tensors": f"staged through host memory (MPI CUDA-aware: {mpi.get('cuda_aware', 'unknown')})",
    }


def gpu_facts() -> dict[str, Any]:
    """Return the GPUs torch sees and the NCCL version it was built with."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": "not available", "gpus": []}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    facts: dict[str, Any] = {"cuda": torch.version.cuda or "yes", "gpus": gpus}
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        facts["nccl"] = "not built"
    return facts


def check_backends(mpi: dict[str, str] | None = None) -> list[BackendCheck]:
    """Return which of hpcddp's backends this process has, with the reason where one is missing.

    Args:
        mpi: ``mpi_facts()``, if already collected.
    """
    import torch
    import torch.distributed as dist

    mpi = mpi_facts() if mpi is None else mpi
    mpi_ok = not mpi["library"].startswith("not available")
    mpi_detail = f"{mpi['library']}, thread level {mpi.get('thread_level')}" if mpi_ok else mpi["library"]
    checks = [BackendCheck(name="mpi", available=mpi_ok, detail=mpi_detail)]
    gloo_ok = dist.is_available() and dist.is_gloo_available()
    checks.append(
        BackendCheck(
            name="gloo", available=gloo_ok, detail="torch.distributed" if gloo_ok else "torch built without gloo"
        )
    )
    if not (dist.is_available() and dist.is_nccl_available()):
        checks.append(BackendCheck(name="nccl", available=False, detail="torch built without NCCL (a CPU build)"))
    elif not torch.cuda.is_available():
        checks.append(BackendCheck(name="nccl", available=False, detail="torch has NCCL but sees no GPU"))
    else:
        checks.append(BackendCheck(name="nccl", available=True, detail=f"NCCL {gpu_facts().get('nccl')}"))
    return checks


def try_backends(checks: list[BackendCheck]) -> None:
    """Allreduce ones across the job on every available backend, filling ``works`` and ``test``; collective.

    The active backend is tried through hpcddp; mpi otherwise through mpi4py on
    COMM_WORLD, gloo and nccl through a torch.distributed group made for the test
    (at the MASTER_ADDR/MASTER_PORT that ``hpcddp.init()`` exported).
    """
    from ..runtime import state

    for check in checks:
        if not check.available:
            continue
        start = time.perf_counter()
        try:
            value = _allreduce_ones(check.name, state.backend() == check.name)
        except Exception as err:  # noqa: BLE001 - reported, not raised: this is a diagnosis
            check.works, check.test = False, f"failed: {type(err).__name__}: {err}"
            continue
        elapsed = (time.perf_counter() - start) * 1e6
        check.works = value == state.size()
        verdict = "ok" if check.works else f"WRONG: got {value:g}, expected {state.size()}"
        check.test = f"allreduce over {state.size()} rank(s) {verdict} ({elapsed:.0f} us)"


def _allreduce_ones(backend: str, active: bool) -> float:
    import torch

    from ..collectives import tensors as collectives
    from ..runtime import state

    if active:
        return collectives.allreduce(torch.ones(4, device=state.device()), op="sum")[0].item()
    if backend == "mpi":
        from ..env.mpi_import import import_mpi

        return float(import_mpi().COMM_WORLD.allreduce(1.0))
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    group = dist.new_group(backend=backend) if dist.is_initialized() else None
    created = group is None
    if created:
        from ..comm.rendezvous import join_process_group

        join_process_group(backend, state.rank(), state.size(), device=device, mpi_comm=state.launcher_comm())
    try:
        ones = torch.ones(4, device=device)
        dist.all_reduce(ones, group=group)
        return ones[0].item()
    finally:
        if created:
            dist.destroy_process_group()


def describe_rank() -> dict[str, Any]:
    """Return where this initialised rank runs: rank, host, local rank, node, device, threads, CPUs."""
    import torch

    from ..runtime import state

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = []
    return {
        "rank": state.rank(),
        "host": socket.gethostname(),
        "local_rank": state.local_rank(),
        "node_rank": state.node_rank(),
        "device": str(state.device()),
        "backend": state.backend(),
        "threads": torch.get_num_threads(),
        "cpus": _ranges(cpus),
    }


def _ranges(values: list[int]) -> str:
    """Format [0, 1, 2, 5] as "0-2,5"."""
    parts, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)
