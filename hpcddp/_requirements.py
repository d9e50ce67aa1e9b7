"""The torch releases hpcddp's tests run on, checked when hpcddp is imported.

Older than ``OLDEST_TORCH``: ImportError naming the fix. Newer than ``NEWEST_TESTED_TORCH``:
one warning line naming the tested range, and the import goes on (a new release usually
works; the warning says where to look when it does not). docs/torch_matrix.sh runs the
multi-rank suites on each release (docs/development.md#torch-versions has the table).
"""

from __future__ import annotations

import logging
import re

import torch

__all__ = ["NEWEST_TESTED_TORCH", "OLDEST_TORCH", "check_torch_version"]

#: the oldest torch the test suite runs on (setup.cfg's install_requires says the same)
OLDEST_TORCH = (2, 9)
#: the newest torch release (major, minor) the test suite ran on
NEWEST_TESTED_TORCH = (2, 15)


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError naming the fix when torch is older than ``OLDEST_TORCH``; warn when newer than tested.

    Args:
        version: a torch version string; the installed torch's when None.
    """
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return
    release = (int(found.group(1)), int(found.group(2)))
    oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TORCH, NEWEST_TESTED_TORCH))
    if release < OLDEST_TORCH:
        raise ImportError(
            f"hpcddp needs torch >= {oldest} (the oldest version its tests run on), found torch {version}: "
            f"pip install 'torch>={oldest}'" + (_CPU_INDEX if "+cpu" in version else "")
        )
    if release > NEWEST_TESTED_TORCH:
        # A logging record, not warnings.warn: one line, without the source line of the import.
        logging.getLogger("hpcddp").warning(
            "hpcddp: torch %s is newer than the releases its tests ran on (torch %s to %s): if torch.distributed "
            "misbehaves, try pip install 'torch<%d.%d' and report it",
            version,
            oldest,
            newest,
            NEWEST_TESTED_TORCH[0],
            NEWEST_TESTED_TORCH[1] + 1,
        )


#: a CPU build stays one: without PyTorch's CPU index pip would fetch the CUDA build (several GB)
_CPU_INDEX = " --index-url https://download.pytorch.org/whl/cpu"


check_torch_version()
