"""The listening TCP sockets of a process, read from /proc: what the hostile-load runs churn and
what the tests check a learner or an actor opened (or closed again)."""

from __future__ import annotations

import os
import socket
import sys

_LISTEN = "0A"  # the kernel's TCP_LISTEN in the tables' "st" column


def _socket_inodes(pid: int | str) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(field: str) -> tuple[str, int]:
    """``ADDR:PORT`` as the kernel prints it: the address in 32-bit words of host byte order."""
    addr_hex, port_hex = field.split(":")
    raw = bytes.fromhex(addr_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port_hex, 16)


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """The TCP sockets process ``pid`` listens on, as ``(address, port)``: its socket inodes
    matched against its network namespace's ``/proc/<pid>/net/tcp`` and ``tcp6``."""
    inodes = _socket_inodes(pid)
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == _LISTEN and parts[9] in inodes:
                    out.add(_address(parts[1]))
    return out


def listening_ports(pid: int | str = "self") -> list[int]:
    """The TCP ports process ``pid`` listens on, sorted."""
    return sorted({port for _, port in listening_sockets(pid)})
