"""The pid behind a connection comes from the kernel: who holds the other end of the socket,
and a pidfd that notices when that process is gone (its pid then names nobody we trust)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from rlink_ucx.transport.shm import cma, peer

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not cma.available(), reason="Linux only")]  # fmt: skip

HOLDER = "import socket, sys, time; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); time.sleep(30)"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_process_holding_the_other_end_is_found_and_no_other(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        try:
            server.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} here")
        server.listen()
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, host, str(server.getsockname()[1])])
        try:
            conn, _ = server.accept()
            with conn:
                assert peer.holds_peer_socket(conn, holder.pid)
                assert not peer.holds_peer_socket(conn, os.getpid())  # we hold our end, not theirs
                assert not peer.holds_peer_socket(conn, 1)
                assert not peer.holds_peer_socket(conn, 2**22 + 12345)  # no such process
                assert not peer.holds_peer_socket(conn, -1)
        finally:
            holder.kill()
            holder.wait()


def test_a_connection_within_one_process_is_held_by_it_and_v4_mapped_peers_are_found():
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as server:
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        conn, addr = server.accept()
        with client, conn:
            assert addr[0] == "::ffff:127.0.0.1"
            assert peer.holds_peer_socket(conn, os.getpid())


def test_a_unix_socket_has_no_tcp_peer():
    a, b = socket.socketpair()  # a unix socket: not in the TCP tables at all
    with a, b:
        assert peer.peer_socket_inode(a) is None
        assert not peer.holds_peer_socket(a, os.getpid())


def test_reads_from_a_process_that_exited_are_void_even_where_its_pid_now_names_another():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    process = cma.Process(child.pid)
    try:
        assert not process.exited()
        child.kill()
        child.wait()
        assert process.exited()
        # Its pid reused by a process we may read (ourselves): the read succeeds, and is void.
        process.pid = os.getpid()
        src, dst = np.arange(64, dtype=np.uint8), bytearray(64)
        with pytest.raises(OSError) as caught:
            process.read([(src.ctypes.data, 64)], [memoryview(dst)])
        assert caught.value.errno == errno.ESRCH
    finally:
        process.close()
    assert process.exited()  # closed: never read again


def test_a_live_process_is_read():
    process = cma.Process(os.getpid())
    try:
        src, dst = np.arange(64, dtype=np.uint8), bytearray(64)
        process.read([(src.ctypes.data, 64)], [memoryview(dst)])
        assert bytes(dst) == src.tobytes()
    finally:
        process.close()


def test_sock_diag_and_the_proc_tables_find_the_same_peer_socket(monkeypatch):
    """sock_diag asks the kernel for one socket (microseconds); the /proc tables list every
    socket of the host (milliseconds per thousand). Both must name the peer's own socket."""
    from rlink_ucx.transport.shm import peer
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        want = os.fstat(client.fileno()).st_ino
        here, there = server.getsockname(), server.getpeername()
        assert peer._diag_inode(socket.AF_INET, there, here) == want
        assert peer._diag_inode(socket.AF_INET, there, (here[0], 1)) is None  # no such connection
        assert peer.peer_socket_inode(server) == want
        monkeypatch.setattr(peer, "_diag_inode", lambda *a: peer._UNKNOWN)
        assert peer.peer_socket_inode(server) == want
    finally:
        for s in (client, server, listener):
            s.close()


def test_one_scan_answers_for_a_process_s_other_sockets_and_never_for_another_process(monkeypatch):
    reads: list[int] = []
    real = peer._socket_links

    def counting(pid: int):
        reads.append(pid)
        return real(pid)

    monkeypatch.setattr(peer, "_socket_links", counting)
    monkeypatch.setattr(peer, "_scans", {})
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        conns = [server.accept()[0] for _ in clients]
        try:
            assert all(peer.holds_peer_socket(c, os.getpid()) for c in conns)
            assert reads == [os.getpid()]  # the first scan saw all three sockets: one read of the descriptors
            late = socket.create_connection(("127.0.0.1", port))  # opened after the scan: read again
            late_conn = server.accept()[0]
            with late, late_conn:
                assert peer.holds_peer_socket(late_conn, os.getpid())
                assert reads == [os.getpid()] * 2
            # a scan cached under our pid, but another start time (a process that reused the pid): ignored
            start, when, links = peer._scans[os.getpid()]
            peer._scans[os.getpid()] = ("1", when, links)
            assert peer.holds_peer_socket(conns[0], os.getpid()) and len(reads) == 3
            assert peer._scans[os.getpid()][0] == start
            # a stale scan is read again
            peer._scans[os.getpid()] = (start, when - peer.SCAN_TTL, links)
            assert peer.holds_peer_socket(conns[1], os.getpid()) and len(reads) == 4
        finally:
            for s in clients + conns:
                s.close()
