"""Which network interfaces carry an address (``getifaddrs``), to confine UCX to them.

UCX's TCP transport listens on every interface it may use, whatever address the control
channel is bound to; ``UCX_NET_DEVICES`` is how it is told otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from functools import lru_cache


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.c_void_p),
                     ("ifa_netmask", ctypes.c_void_p), ("ifa_ifu", ctypes.c_void_p),
                     ("ifa_data", ctypes.c_void_p)]  # fmt: skip


def _address_of(sockaddr: int) -> str | None:
    """The IP address in a ``struct sockaddr`` (Linux layout), or None for other families."""
    family = ctypes.c_ushort.from_address(sockaddr).value
    if family == socket.AF_INET:  # sin_family, sin_port, then the address
        return socket.inet_ntop(socket.AF_INET, ctypes.string_at(sockaddr + 4, 4))
    if family == socket.AF_INET6:  # sin6_family, sin6_port, sin6_flowinfo, then the address
        return socket.inet_ntop(socket.AF_INET6, ctypes.string_at(sockaddr + 8, 16))
    return None


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.getifaddrs.argtypes = [ctypes.POINTER(ctypes.POINTER(_IfAddrs))]
        libc.freeifaddrs.argtypes = [ctypes.POINTER(_IfAddrs)]
        return libc
    except (OSError, AttributeError):  # pragma: no cover - a libc without getifaddrs
        return None


def addresses() -> list[tuple[str, str]]:
    """Every ``(interface, address)`` pair of this host's network namespace."""
    libc = _libc()
    head = ctypes.POINTER(_IfAddrs)()
    if libc is None or libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    out = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr and entry.ifa_name:
                addr = _address_of(entry.ifa_addr)
                if addr is not None:
                    out.append((entry.ifa_name.decode(), addr))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def holding(host: str) -> list[str] | None:
    """The interfaces that carry ``host`` (a name is resolved), sorted; None for a wildcard
    address (every interface) or where none is found."""
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        wanted = {ipaddress.ip_address(a.split("%", 1)[0]) for a in resolved}
    except (OSError, ValueError):
        return None
    wanted = {a.ipv4_mapped or a if isinstance(a, ipaddress.IPv6Address) else a for a in wanted}
    if not wanted or any(a.is_unspecified for a in wanted):
        return None
    names = set()
    for name, addr in addresses():
        if ipaddress.ip_address(addr.split("%", 1)[0]) in wanted:
            names.add(name)
    return sorted(names) or None
