"""What UCX can do on this machine, asked of ``ucx_info`` (no ucxx import, no UCX init)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess

# Transports that beat a plain socket: RDMA verbs and CUDA (device-to-device) paths.
RDMA = {"rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc", "dc", "ud"}
CUDA = {"cuda_ipc", "cuda_copy", "gdr_copy"}
SHARED_MEMORY = {"posix", "sysv", "cma", "xpmem", "knem"}
TCP = {"tcp"}  # UCX's own TCP transport (reaches other hosts)


def _ucx_info() -> tuple[str, dict[str, str]] | None:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    exe = os.path.join(root, "bin", "ucx_info")
    if not os.path.exists(exe):
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.join(root, "lib") + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    return exe, env


@functools.lru_cache(maxsize=1)
def version() -> str | None:
    found = _ucx_info()
    if found is None:
        return None
    try:
        out = subprocess.run([found[0], "-v"], env=found[1], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"Library version:\s*(\S+)", out)
    return match.group(1) if match else None


@functools.lru_cache(maxsize=1)
def transports() -> dict[str, list[str]]:
    """``{transport: [devices]}`` as UCX reports them, or ``{}`` if UCX is not installed."""
    found = _ucx_info()
    if found is None:
        return {}
    try:
        out = subprocess.run([found[0], "-d"], env=found[1], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    result: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if m := re.match(r"#\s+Transport:\s*(\S+)", line):
            current = m.group(1)
            result.setdefault(current, [])
        elif (m := re.match(r"#\s+Device:\s*(\S+)", line)) and current:
            result[current].append(m.group(1))
    return result


def fast_transports() -> set[str]:
    """UCX transports here that can beat the tcp plane (RDMA or CUDA)."""
    return set(transports()) & (RDMA | CUDA)


def net_devices(host: str) -> list[str] | None:
    """The network devices UCX should use for a control channel on ``host``: the interfaces
    that carry that address, plus every RDMA device (whose ports are not TCP listeners and
    are the reason to use UCX). None: no restriction (a wildcard address, or none found)."""
    from .. import interfaces

    found = interfaces.holding(host)
    if found is None:
        return None
    rdma = {d for name, devices in transports().items() if name in RDMA for d in devices}
    return found + sorted(rdma - set(found))
