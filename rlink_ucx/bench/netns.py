"""Hosts on one machine: network namespaces joined by a switch, each link shaped with ``tc tbf``.

Host 0 is the learner's; hosts 1..N the actors'. Every process started on a host also gets a
UTS namespace with the host's name (``unshare --uts``), so rlink sees N+1 hosts; they all share
the machine's PID namespace and user, as processes of one host would (so the actors of a host can
read each other's sealed memfds). Needs root, ``ip``, ``tc`` and ``unshare``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any, Self

__all__ = ["Hosts", "available"]

_SUBNET = "10.89"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    probe = f"rlprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()[:200]}"
    return None


class Hosts:
    """``count`` actor hosts and the learner's host, each behind a link of ``mbit`` Mbit/s
    each way (None: not shaped). Use as a context manager: everything is removed on exit."""

    def __init__(self, count: int, mbit: float | None = None):
        if not 1 <= count <= 200:
            raise ValueError("between 1 and 200 hosts")
        self.count, self.mbit = count, mbit
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"rlbr{self.tag}"
        self.switch = f"rl{self.tag}sw"
        self.names = [f"rl{self.tag}h{i}" for i in range(count + 1)]  # namespace = host name
        self._made: list[str] = []

    def address(self, host: int) -> str:
        return f"{_SUBNET}.{host // 250}.{host % 250 + 1}"

    def device(self, host: int) -> str:
        return f"v{self.tag}{host}"

    def __enter__(self) -> Self:
        # The bridge lives in a namespace of its own: the machine's firewall (Docker's FORWARD
        # policy, with bridge netfilter on) never sees the hosts' traffic.
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "name", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
            for host, ns in enumerate(self.names):
                self._join(host, ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _join(self, host: int, ns: str) -> None:
        inside, outside = self.device(host), f"w{self.tag}{host}"
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outside, "master", self.bridge)
        _ip("-n", self.switch, "link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/16", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.mbit is not None:  # both directions: the host's sends, and the switch's to it
            for space, dev in ((ns, inside), (self.switch, outside)):
                subprocess.run(["ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                f"{self.mbit}mbit", "burst", "256kb", "latency", "400ms"],
                               check=True, capture_output=True, timeout=30)  # fmt: skip

    def start(self, host: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Run ``argv`` on ``host`` (in its namespace, under its host name)."""
        ns = self.names[host]
        proc: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                                        'hostname "$0" && exec "$@"', ns, *argv], **popen)  # fmt: skip
        return proc

    def sent_bytes(self, host: int) -> int:
        """Bytes ``host`` has sent on its link so far."""
        out = subprocess.run(["ip", "netns", "exec", self.names[host], "cat",
                              f"/sys/class/net/{self.device(host)}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True, timeout=30)  # fmt: skip
        return int(out.stdout)

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._made):  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._made = []
