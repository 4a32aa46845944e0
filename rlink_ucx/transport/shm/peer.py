"""Which local process is at the other end of a TCP connection, asked of the kernel.

A peer's Hello names its pid, but a peer can name any pid. Before the learner reads another
process's memory it checks, in the kernel's own tables, that the named process holds the
peer's end of this very connection: ``/proc/self/net/tcp{,6}`` gives that socket's inode, and
``/proc/<pid>/fd`` must hold it. Only a process the peer already controls can hold that
socket (it made it, inherited it, or was handed it), so the check ties the pid to the peer.
A peer in another network namespace or on another host is never found: the answer is no.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import sys
import time
from typing import Any, cast

_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_V4_MAPPED = bytes(10) + b"\xff\xff"


def _packed(address: str) -> bytes:
    """An address as bytes, IPv4-mapped IPv6 as plain IPv4."""
    if ":" not in address:
        return socket.inet_pton(socket.AF_INET, address)
    raw = socket.inet_pton(socket.AF_INET6, address.split("%", 1)[0])
    return raw[12:] if raw.startswith(_V4_MAPPED) else raw


def _from_table(field: str) -> tuple[bytes, int]:
    """``ADDR:PORT`` as the kernel prints it: the address in 32-bit words of host byte order."""
    addr_hex, port_hex = field.split(":")
    raw = bytes.fromhex(addr_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 16 and raw.startswith(_V4_MAPPED):
        raw = raw[12:]
    return raw, int(port_hex, 16)


_UNKNOWN = object()  # sock_diag could not answer: read the /proc tables instead
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NOCOOKIE = 0xFFFFFFFF


def _diag_inode(family: int, local: tuple[Any, ...], remote: tuple[Any, ...]) -> Any:
    """The inode of the TCP socket with exactly this ``local`` and ``remote`` end, asked of the
    kernel by ``sock_diag`` (netlink): one lookup, where the /proc tables list every socket of
    the host (about 20 ms with 3,000 of them, at each of a thousand actors' attach). None when
    there is no such socket here; ``_UNKNOWN`` when netlink cannot tell."""
    if not hasattr(socket, "AF_NETLINK"):
        return _UNKNOWN
    try:
        def raw(address: str) -> bytes:
            packed = socket.inet_pton(family, address.split("%", 1)[0])
            return packed + bytes(16 - len(packed))

        sockid = (struct.pack("!HH", local[1], remote[1]) + raw(local[0]) + raw(remote[0])
                  + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))  # fmt: skip
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(header + request)
            reply = nl.recv(65536)
        _, kind = struct.unpack_from("=IH", reply)
        if kind == _NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", reply, 16)
            return None if -errno == 2 else _UNKNOWN  # ENOENT: no such socket in this namespace
        # inet_diag_msg: family, state, timer, retrans; the 48-byte socket id; expires, rqueue,
        # wqueue, uid; inode.
        (inode,) = struct.unpack_from("=I", reply, 16 + 4 + 48 + 16)
        return inode or None
    except (OSError, ValueError, struct.error):
        return _UNKNOWN


def peer_socket_inode(sock: socket.socket) -> int | None:
    """The inode of the socket at the other end of ``sock``, where that socket lives in this
    host's network namespace; None where it does not (another host, another namespace)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        here, there = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    found = _diag_inode(sock.family, there, here)
    if found is not _UNKNOWN:
        return cast("int | None", found)
    try:
        # The peer's socket is listed with the two ends swapped.
        want_local, want_remote = (_packed(there[0]), there[1]), (_packed(here[0]), here[1])
    except (OSError, ValueError):
        return None
    # Only the rows whose two ports match are parsed: a learner with a thousand actors has
    # thousands of rows, and this runs once per actor that attaches.
    row = re.compile(rf"^\s*\d+: ([0-9A-F]+):{want_local[1]:04X} ([0-9A-F]+):{want_remote[1]:04X}(?:\s+\S+){{6}}\s+(\d+)", re.MULTILINE)
    for table in _TABLES:
        try:
            with open(table) as f:
                text = f.read()
        except OSError:
            continue
        for m in row.finditer(text):
            local, remote = _from_table(f"{m[1]}:{want_local[1]:04X}"), _from_table(f"{m[2]}:{want_remote[1]:04X}")
            if local == want_local and remote == want_remote:
                return int(m[3]) or None  # 0: the socket is going away (TIME_WAIT)
    return None


SCAN_TTL = 5.0  # seconds a scan of a process's sockets answers for it (a storm of its actors attaching)
_MAX_SCANS = 4096
# pid -> (its start time, when scanned, the socket links it held): one scan of an actor process's
# descriptors answers for the other actors of that process that attach in the next seconds (a
# process of 64 actors holds hundreds of descriptors; read for each attach, that was O(N^2)).
_scans: dict[int, tuple[str, float, frozenset[str]]] = {}


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat``, field 22): with the pid, it
    names one process, never a later one that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def _socket_links(pid: int) -> frozenset[str] | None:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    links = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            links.add(link)
    return frozenset(links)


def holds_peer_socket(sock: socket.socket, pid: int) -> bool:
    """Whether process ``pid`` holds the socket at the other end of the connection ``sock``
    (``False`` when that cannot be found out: no permission, no such process, no socket).
    A scan of that process from the last ``SCAN_TTL`` seconds that saw the socket answers yes
    (the same process: same pid and start time); else its descriptors are read again."""
    inode = peer_socket_inode(sock)
    if inode is None or pid <= 0:
        return False
    target = f"socket:[{inode}]"
    start = _start_time(pid)
    if start is None:
        return False
    now = time.monotonic()
    cached = _scans.get(pid)
    if cached is not None and cached[0] == start and now - cached[1] < SCAN_TTL and target in cached[2]:
        return True
    links = _socket_links(pid)
    if links is None or _start_time(pid) != start:  # gone, or replaced by another process meanwhile
        return False
    if len(_scans) >= _MAX_SCANS:
        for old in [p for p, (_, when, _) in _scans.items() if now - when >= SCAN_TTL] or list(_scans):
            del _scans[old]
    _scans[pid] = (start, now, links)
    return target in links
