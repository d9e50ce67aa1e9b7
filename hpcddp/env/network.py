"""Network interfaces and rendezvous addresses that need no DNS.

Node host names are often unknown to the other nodes (containers, private names)
or resolve to the management network instead of the fast one, so hpcddp never
resolves a host name to reach rank 0: rank 0 publishes an IP address of an
interface that every node shares a subnet with (or the one the user names), and
each rank tells gloo and NCCL which of its own interfaces leads there.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SOCKET_IFNAME_VARIABLES",
    "Interface",
    "choose_rendezvous_interface",
    "describe_interfaces",
    "find_interface",
    "interface_towards",
    "list_interfaces",
    "local_interface_for",
    "probe_tcp",
    "socket_ifname_hint",
]

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B
#: the variables gloo and NCCL read to pick their interface, in the order they are consulted
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of a network interface."""

    name: str
    address: str
    netmask: str

    @property
    def network(self) -> ipaddress.IPv4Network:
        """The subnet the address belongs to."""
        return ipaddress.IPv4Network(f"{self.address}/{self.netmask}", strict=False)

    @property
    def is_loopback(self) -> bool:
        return ipaddress.IPv4Address(self.address).is_loopback

    def __str__(self) -> str:
        return f"{self.name} {self.address}/{self.network.prefixlen}"


def _ioctl_address(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:  # no IPv4 address on this interface
        return None
    return socket.inet_ntoa(packed[20:24])


def list_interfaces() -> list[Interface]:
    """Return the IPv4 addresses of this host's interfaces, in the kernel's order."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_address(sock, name, _SIOCGIFADDR)
            netmask = _ioctl_address(sock, name, _SIOCGIFNETMASK)
            if address and netmask:
                found.append(Interface(name, address, netmask))
    return found


def describe_interfaces(interfaces: Sequence[Interface]) -> str:
    """Return ``"eth0 10.0.0.2/24, ib0 10.1.0.2/16"`` for an error message."""
    return ", ".join(str(i) for i in interfaces if not i.is_loopback) or "no interface but loopback"


def find_interface(interfaces: Sequence[Interface], name: str) -> Interface | None:
    """Return the interface called ``name``, or None."""
    return next((i for i in interfaces if i.name == name), None)


def _route_source(address: str) -> str | None:
    """Return the local address the kernel would send from to reach ``address`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return sock.getsockname()[0]
    except OSError:  # no route
        return None


def local_interface_for(address: str, interfaces: Sequence[Interface]) -> Interface | None:
    """Return this host's interface that reaches ``address``: the one holding it or sharing its
    subnet, else the one the routing table sends from; None when there is no route.

    Args:
        address: an IPv4 address (not a host name).
        interfaces: this host's interfaces (``list_interfaces()``).
    """
    target = ipaddress.IPv4Address(address)
    for interface in interfaces:
        if interface.address == address:
            return interface
    for interface in interfaces:
        if not interface.is_loopback and target in interface.network:
            return interface
    source = _route_source(address)
    return next((i for i in interfaces if i.address == source), None)


def interface_towards(address: str, named: str | None, interfaces: Sequence[Interface]) -> Interface | None:
    """Return the interface this rank should use to reach ``address``.

    Args:
        address: the rendezvous address; a host name is resolved only here, when the
            user gave one as MASTER_ADDR.
        named: the interface the user chose (HPCDDP_IFACE, ``init(interface=)``), or None.
        interfaces: this host's interfaces.

    Raises:
        ValueError: the named interface does not exist on this host.
    """
    if named:
        chosen = find_interface(interfaces, named)
        if chosen is None:
            raise ValueError(
                f"interface {named!r} (HPCDDP_IFACE or init(interface=)) does not exist on {socket.gethostname()}: "
                f"choose one of {describe_interfaces(interfaces)}"
            )
        return chosen
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        try:
            address = socket.gethostbyname(address)
        except OSError:
            return None
    return local_interface_for(address, interfaces)


def choose_rendezvous_interface(
    own: Sequence[Interface], other_nodes: Sequence[Sequence[Interface]]
) -> Interface | None:
    """Return rank 0's interface that every other node can reach directly.

    The first non-loopback interface of rank 0 whose subnet holds an address of
    every other node; without one (routed networks), the interface the routing
    table uses towards the first other node; None when nothing fits.

    Args:
        own: rank 0's interfaces.
        other_nodes: the interfaces of one rank on each other node.
    """
    candidates = [i for i in own if not i.is_loopback]
    for interface in candidates:
        network = interface.network
        if all(any(ipaddress.IPv4Address(p.address) in network for p in peer) for peer in other_nodes):
            return interface
    for peer in other_nodes:
        for address in (p.address for p in peer if not p.is_loopback):
            chosen = local_interface_for(address, own)
            if chosen is not None and not chosen.is_loopback:
                return chosen
    return None


def socket_ifname_hint(environ: Mapping[str, str]) -> str | None:
    """Return the single interface name a user gave gloo or NCCL, or None.

    NCCL_SOCKET_IFNAME may be a prefix list (``^docker,lo``, ``=eth0``): only a plain
    single name is a hint hpcddp can follow.
    """
    for variable in SOCKET_IFNAME_VARIABLES:
        value = environ.get(variable, "").strip()
        if value and value.replace("_", "").replace("-", "").replace(".", "").isalnum():
            return value
    return None


def probe_tcp(address: str, port: int, timeout: float) -> str | None:
    """Try to open a TCP connection to ``address:port`` until it works or ``timeout`` passes.

    Returns None on success, else the last error as text.
    """
    deadline = time.monotonic() + timeout
    error = "timed out"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return error
        try:
            with socket.create_connection((address, port), timeout=min(left, 2.0)):
                return None
        except OSError as err:
            error = err.strerror or str(err) or type(err).__name__
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
