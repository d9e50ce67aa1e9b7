"""The torch versions hpcddp runs on: the oldest one its tests run on, checked when hpcddp is imported."""

from __future__ import annotations

import re

import torch

__all__ = ["OLDEST_TORCH", "check_torch_version"]

#: the oldest torch the test suite runs on (setup.cfg's install_requires says the same)
OLDEST_TORCH = (2, 13)


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError naming the fix when torch is older than ``OLDEST_TORCH``.

    Args:
        version: a torch version string; the installed torch's when None.
    """
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) >= OLDEST_TORCH:
        return
    oldest = ".".join(map(str, OLDEST_TORCH))
    raise ImportError(
        f"hpcddp needs torch >= {oldest} (the oldest version its tests run on), found torch {version}: "
        f"pip install 'torch>={oldest}'" + (_CPU_INDEX if "+cpu" in version else "")
    )


#: a CPU build stays one: without PyTorch's CPU index pip would fetch the CUDA build (several GB)
_CPU_INDEX = " --index-url https://download.pytorch.org/whl/cpu"


check_torch_version()
