"""Which address a node gives its peers, and which network interface gloo must use for it.

A node on another host advertises the address of its route to the coordinator
(:func:`route_address`: the source address the kernel picks for that destination), or the one a
user names (``--advertise``), and points gloo at the interface that holds it
(:func:`interface_of`, passed as ``GLOO_SOCKET_IFNAME``): gloo would otherwise advertise the
address its host name resolves to, which on many machines is a loopback address that no peer can
reach.  A loopback address is refused when the coordinator is not on loopback
(:func:`check_advertised`), and so is one from which the coordinator cannot be reached
(:func:`check_reachable`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915


class AddressError(ValueError):
    """An address a node cannot work with (message: the problem and the fix, one line)."""


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    """``host`` as an IPv4 address (a name is looked up once)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise AddressError(f"cannot resolve {host!r} ({e}); give the coordinator's address as an IP address") from None


def route_address(host: str, port: int) -> str:
    """The local address this host's route to ``host:port`` leaves from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((resolve(host), port))
        except OSError as e:
            raise AddressError(f"no route to the coordinator at {host}:{port} ({e.strerror or e}); check the "
                               "address, or give this host's own with --advertise") from None
        return s.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def interface_of(addr: str) -> str:
    """The name of the interface that holds ``addr``."""
    for name, a in interface_addresses().items():
        if a == addr:
            return name
    raise AddressError(f"no network interface of this host has the address {addr}; give one of "
                       f"{sorted(interface_addresses().values())} with --advertise")


def check_advertised(addr: str, coordinator_host: str) -> None:
    """Refuse a loopback address when the coordinator is reached over the network."""
    if is_loopback(addr) and not is_loopback(resolve(coordinator_host)):
        raise AddressError(f"this node would advertise the loopback address {addr}, which its peers on other hosts "
                           "cannot reach; give this host's network address with --advertise")


def check_reachable(addr: str, host: str, port: int, timeout_s: float = 5.0) -> None:
    """Refuse ``addr`` when a connection from it to the coordinator at ``host:port`` fails: peers
    on the coordinator's network could not reach this host there either."""
    try:
        socket.create_connection((resolve(host), port), timeout=timeout_s, source_address=(addr, 0)).close()
    except ConnectionRefusedError:      # its host answered from there: the address routes (nothing listens
        return                          # this instant: a store that is being replaced)
    except OSError as e:
        raise AddressError(f"the coordinator at {host}:{port} cannot be reached from {addr} ({e.strerror or e}), so "
                           "this node's peers could not reach it there either; give this host's address on the "
                           "coordinator's network with --advertise") from None
