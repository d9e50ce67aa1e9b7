"""What a rank tells code that uses torch.distributed directly: torchrun's variables and the rendezvous.

``hpcddp.init()`` exports them; so does a script's ``init_process_group`` (env://) under
an MPI launcher or srun when they are missing (``hpcddp.torch_backend.autoinit``).
"""

from __future__ import annotations

import logging
import os

from ..env import ClusterEnvironment, RankLayout, Rendezvous
from ..env.network import SOCKET_IFNAME_VARIABLES, socket_ifname_hint
from ..env.torchrun import torchrun_variables

__all__ = ["export_for_torch", "export_layout", "export_rendezvous", "forget_chosen_port"]

log = logging.getLogger("hpcddp")

_chosen_port: str | None = None  # the MASTER_PORT hpcddp chose and exported (not the user's or a launcher's)
_earlier_ports: set[int] = set()  # every port it chose in this process


def export_for_torch(environment: ClusterEnvironment, interface: str | None = None) -> None:
    """Export torchrun's variables and the rendezvous that ``environment`` finds (collective under MPI).

    Args:
        environment: how this process was launched.
        interface: the interface the user chose (HPCDDP_IFACE); None lets the environment pick.
    """
    export_layout(environment, environment.layout())
    export_rendezvous(environment.rendezvous(interface))


def export_layout(environment: ClusterEnvironment, layout: RankLayout) -> None:
    """Export torchrun's rank variables (RANK, LOCAL_RANK, ...) for ``layout``, warning where one differed.

    Args:
        environment: where the layout came from (named in the warning).
        layout: this process's place in the job.
    """
    for name, value in torchrun_variables(layout).items():
        current = os.environ.get(name)
        if current is not None and current != value:
            log.warning("hpcddp: overriding %s=%s with %s from %s", name, current, value, environment.name)
        os.environ[name] = value


def export_rendezvous(rendezvous: Rendezvous) -> None:
    """Export torch.distributed's MASTER_ADDR/MASTER_PORT and gloo's and NCCL's interface.

    The environment decided (under MPI: rank 0's choice, broadcast to all). A rank
    whose own differing MASTER_* value is replaced is warned; GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME set by the user are kept, with a warning when they name
    another interface than the one that reaches rank 0.

    Args:
        rendezvous: rank 0's address and port, and this rank's interface towards it.
    """
    global _chosen_port
    for name, value in (("MASTER_ADDR", rendezvous.address), ("MASTER_PORT", str(rendezvous.port))):
        current = os.environ.get(name)
        if current and current != value:
            log.warning("hpcddp: overriding %s=%s with %s", name, current, value)
        if name == "MASTER_PORT" and current != value:
            _chosen_port = value
            _earlier_ports.add(rendezvous.port)
        os.environ[name] = value
    if rendezvous.interface is None:
        return
    source = "HPCDDP_IFACE" if rendezvous.interface_named else f"the interface that reaches {rendezvous.address}"
    for name in SOCKET_IFNAME_VARIABLES:
        current = os.environ.get(name, "").strip()
        if not current:
            os.environ[name] = rendezvous.interface
        elif current != rendezvous.interface and socket_ifname_hint({name: current}) == current:
            log.warning(
                "hpcddp: %s=%s differs from %s (%s): keeping %s; unset it to use %s",
                name,
                current,
                rendezvous.interface,
                source,
                name,
                rendezvous.interface,
            )


def forget_chosen_port() -> set[int]:
    """Unset MASTER_PORT where an earlier ``init()`` chose it, so that this one chooses again.

    The old groups' stores may still hold their ports after ``shutdown()`` (a handle never
    synchronized keeps its group alive), and serving one again failed "Address already in use".
    Returns every port hpcddp chose in this process.
    """
    global _chosen_port
    if _chosen_port is not None and os.environ.get("MASTER_PORT") == _chosen_port:
        del os.environ["MASTER_PORT"]
    _chosen_port = None
    return set(_earlier_ports)
