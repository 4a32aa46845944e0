"""rlink-tcp between two network namespaces on one machine (as between containers on a bridge,
and with a real network's 1500-byte MTU), against a raw socket on the same veth link.

Needs root and iproute2. Makes two namespaces joined by a veth pair; each round alternates
the raw socket with the system's congestion control, the raw socket on Reno, rlink-tcp with
the defaults (the system's congestion control: the peer is not a loopback address) and
rlink-tcp with RLINK_TCP_CONGESTION=reno. Prints the median GB/s at the receiver and every
round's value.

    sudo python bench/bridge_ab.py --size 64K --rounds 5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

from throughput import SIZES, TOTAL_BYTES, print_medians  # bench/throughput.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRESS = ("10.78.0.1", "10.78.0.2")

# Receivers write their port to a file (port 0), then print GB/s; senders wait for that file.
_RAW_RECV = """
import socket, sys, time
from rlink_ucx.bench.common import recv_exact
size, count, port_file = {size}, {count}, {port_file!r}
srv = socket.create_server(("{host}", 0)); open(port_file, "w").write(str(srv.getsockname()[1]))
conn, _ = srv.accept(); view = memoryview(bytearray(size)); warm = max(1, count // 20)
for i in range(count):
    if i == warm: t0 = time.perf_counter()
    recv_exact(conn, view)
print((count - warm) * size / (time.perf_counter() - t0) / 1e9)
"""
_RAW_SEND = """
import socket, numpy as np
size, count, port = {size}, {count}, {port}
sock = socket.create_connection(("{host}", port)); sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if {congestion!r}: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, {congestion!r}.encode())
view = memoryview(np.random.randint(0, 255, size, dtype=np.uint8))
for _ in range(count): sock.sendall(view)
sock.close()
"""
_RLINK_RECV = """
import time
from rlink_ucx import Learner, RLinkDataset
size, count, port_file = {size}, {count}, {port_file!r}
with Learner("{host}:0", token={token!r}, transport="tcp") as learner:
    open(port_file, "w").write(learner.address.rsplit(":", 1)[1])
    batch = max(1, (4 << 20) // size); dataset = RLinkDataset(learner, batch_size=batch)
    batches = count // batch; warm = max(1, batches // 20)
    for i in range(batches):
        if i == warm: t0 = time.perf_counter()
        dataset.fetch(timeout=120)
    print((batches - warm) * batch * size / (time.perf_counter() - t0) / 1e9)
    deadline = time.monotonic() + 60
    while learner.stats()["connected_actors"] and time.monotonic() < deadline:
        time.sleep(0.05)
"""
_RLINK_SEND = """
import numpy as np
from rlink_ucx import Actor
size, count, port = {size}, {count}, {port}
with Actor("{host}:%d" % port, token={token!r}, transport="tcp") as actor:
    step = {{"x": np.random.randint(0, 255, size, dtype=np.uint8)}}
    for _ in range(count): actor.put(step)
    actor.flush(120)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _python_in(ns: str, code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def one_run(namespaces: tuple[str, str], receiver: str, sender: str, size: int, count: int, env: dict[str, str]) -> float:
    """GB/s of one receiver (first namespace) / sender (second namespace) pair."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = pathlib.Path(tmp, "port")
        fields = {"size": size, "count": count, "host": ADDRESS[0], "token": uuid.uuid4().hex}
        recv = _python_in(namespaces[0], receiver.format(port_file=str(port_file), **fields), env)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if recv.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not start: {recv.communicate()[1][-2000:]}")
            time.sleep(0.05)
        send = _python_in(namespaces[1], sender.format(port=int(port_file.read_text()), **fields), env)
        out, err = recv.communicate(timeout=300)
        send_err = send.communicate(timeout=60)[1]
        if recv.returncode or send.returncode:
            raise RuntimeError(f"run failed: {err[-2000:]} {send_err[-2000:]}")
        return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64K", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    count = TOTAL_BYTES[size] // size
    tag = uuid.uuid4().hex[:6]
    namespaces, links = (f"rlbA{tag}", f"rlbB{tag}"), (f"rbA{tag}", f"rbB{tag}")
    base_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base_env = {k: v for k, v in base_env.items() if not k.startswith("RLINK_")}
    variants = {
        "raw-socket (system default)": (_RAW_RECV, _RAW_SEND.replace("{congestion!r}", "''"), {}),
        "raw-socket reno": (_RAW_RECV, _RAW_SEND.replace("{congestion!r}", "'reno'"), {}),
        "rlink-tcp (defaults)": (_RLINK_RECV, _RLINK_SEND, {}),
        "rlink-tcp RLINK_TCP_CONGESTION=reno": (_RLINK_RECV, _RLINK_SEND, {"RLINK_TCP_CONGESTION": "reno"}),
    }
    try:
        for ns in namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, address in zip(namespaces, links, ADDRESS):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (receiver, sender, extra) in variants.items():
                runs[name].append(one_run(namespaces, receiver, sender, size, count, {**base_env, **extra}))
    finally:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10, check=False)
    print_medians(runs, "raw-socket (system default)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
