"""Socket options every rlink TCP connection shares: no pacing where it never leaves this host."""

from __future__ import annotations

import ipaddress
import socket

# Congestion control for a connection that never leaves this host. Reno is built into every
# Linux kernel and any user may choose it; unlike BBR it never paces.
LOOPBACK_CONGESTION = b"reno"


def on_loopback(sock: socket.socket) -> bool:
    """Does ``sock`` connect this host to itself?"""
    try:
        return same_host(sock.getpeername()[0], sock.getsockname()[0])
    except (OSError, IndexError, TypeError):  # not connected, or not an IP socket
        return False


def same_host(peer: str, local: str) -> bool:
    """Is ``peer`` a loopback address or ``local`` itself (both IP address strings)?"""
    try:
        a, b = (ipaddress.ip_address(x.split("%")[0]) for x in (peer, local))
    except ValueError:
        return False
    a, b = (x.ipv4_mapped or x if isinstance(x, ipaddress.IPv6Address) else x for x in (a, b))
    return a.is_loopback or a == b


def no_pacing_on_loopback(sock: socket.socket) -> None:
    """On a connection to this host, use a congestion control that does not pace.

    Why: the system's default may be BBR, which paces: it holds back bursts above its pacing
    rate and arms a timer to send them later. With no network in between there is nothing to
    pace for, and on a virtual machine each such timer traps to the hypervisor. Measured on
    loopback at 64 KiB steps: 2.6 -> 3.5 GB/s (docs/benchmarks.md). Other hosts keep the default.
    """
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None or not on_loopback(sock):  # (the option is Linux-only)
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, LOOPBACK_CONGESTION)
    except OSError:  # e.g. a kernel without it: the default stays
        pass
