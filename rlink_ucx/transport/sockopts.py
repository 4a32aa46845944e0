"""Socket options every rlink TCP connection shares: the congestion control (no pacing where a
connection never leaves this host)."""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger("rlink_ucx")

# Congestion control for a connection that never leaves this host. Reno is built into every
# Linux kernel and any user may choose it; unlike BBR it never paces.
LOOPBACK_CONGESTION = "reno"
_refused: set[str] = set()  # names the kernel refused (warned about once)


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


def congestion_of(sock: socket.socket) -> str:
    """The congestion control ``sock`` uses ("" where the system cannot say)."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return ""
    return sock.getsockopt(socket.IPPROTO_TCP, option, 16).split(b"\0", 1)[0].decode()


def set_congestion(sock: socket.socket, wanted: str = "auto") -> None:
    """Apply ``Config.tcp_congestion`` to a connected socket.

    ``"auto"``: Reno on a connection to this host, else the system's default. Why: the default
    may be BBR, which paces: it holds back bursts above its pacing rate and arms a timer to
    send them later. With no network in between there is nothing to pace for, and on a virtual
    machine each such timer traps to the hypervisor, which costs loopback throughput
    (docs/benchmarks.md). ``"system"``: leave it. Any other name: use it
    (a name the kernel refuses is logged once and the default stays).
    """
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None or wanted == "system":  # (the option is Linux-only)
        return
    if wanted == "auto":
        if not on_loopback(sock):
            return
        name = LOOPBACK_CONGESTION.encode()
    else:
        name = wanted.encode()
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name)
    except OSError as exc:  # a kernel without it, or not in tcp_allowed_congestion_control
        if wanted != "auto" and wanted not in _refused:
            _refused.add(wanted)
            log.warning("tcp_congestion=%r was refused (%s); the system's default stays (see "
                        "/proc/sys/net/ipv4/tcp_allowed_congestion_control)", wanted, exc)  # fmt: skip


def close_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down (which wakes a thread blocked in a read on it, or a pump polling it)
    and close it; errors of a connection already gone are ignored."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
