"""``rlink doctor``: what this machine offers rlink, and what limits it, one row per check.

Each check returns a :class:`Check` with a status (``ok``, ``warn``, ``fail``, or ``skip`` where
it does not apply), a one-line summary, one line of advice, and the numbers behind it. The
checks read the system (limits, sysctls, ``/dev/shm``, ``/sys/class/infiniband``, the token
sources) and may import ucxx and torch, which ``import rlink_ucx`` never does. The check of a
running learner (a real handshake) is in :mod:`.doctor_learner`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import resource
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..session import tokens
from ..session.learner.admission import FDS_PER_ACTOR, FDS_SPARE, listen_backlog
from ..session.tokens import resolve_token
from ..transport import UCX_INSTALL
from ..transport.ucx import probe as ucx_probe
from ..transport.ucx.setup import UcxUnavailable, load_ucxx, make_worker

MiB = 1 << 20
SMALL_SHM = 256 * MiB  # Docker's default /dev/shm is 64 MiB: NCCL and UCX's posix transport outgrow it
STATUSES = ("skip", "ok", "warn", "fail")  # in rising severity: a skipped row leaves the verdict "ok"


@dataclasses.dataclass
class Check:
    """One row of the report: ``name``, ``status``, ``summary``, ``advice`` and its numbers."""

    name: str
    status: str
    summary: str
    advice: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "summary": self.summary, "advice": self.advice, **self.data}


def system_checks(config: Config, *, actors: int) -> list[Check]:
    """Every check of this machine, for a learner expecting ``actors`` actors."""
    return [check_ucxx(config), check_ucx_transports(), check_rdma(), check_cuda(), check_nccl(),
            check_shm(config, actors), check_nofile(config, actors), check_somaxconn(config),
            check_token(config)]  # fmt: skip


def check_ucxx(config: Config) -> Check:
    if importlib.util.find_spec("ucxx") is None:
        # Without RDMA or a GPU, UCX would only add TCP, which the tcp plane does faster.
        fast_hardware = bool(_rdma_devices()) or any(Path("/dev").glob("nvidia[0-9]*"))
        return Check("ucxx", "warn" if fast_hardware else "ok",
                     "ucxx is not installed: the tcp and shm planes work, the ucx plane does not",
                     f"for RDMA, NVLink or cuda_ipc: {UCX_INSTALL}",
                     {"installed": False, "importable": False})  # fmt: skip
    try:
        load_ucxx()  # as the planes import it (quiet about the variables ucxx sets itself)
        ucxx = importlib.import_module("ucxx")
    except Exception as exc:  # noqa: BLE001 - any failure of a broken install is the finding
        cause = exc.__cause__ or exc  # load_ucxx's own ImportError says only "pip install"
        return Check("ucxx", "fail", f"ucxx is installed but does not import: {type(cause).__name__}: {cause}",
                     f"reinstall ucxx with the extra for this machine: {UCX_INSTALL}",
                     {"installed": True, "importable": False, "error": str(cause)})  # fmt: skip
    version = getattr(ucxx, "__version__", None)
    ucx = ucx_probe.version()
    data = {"installed": True, "importable": True, "ucxx_version": version, "ucx_version": ucx}
    try:  # with rlink's settings and the UCX_* variables of this environment, as a learner would
        with _stdout_to_stderr():  # UCX prints its complaints on stdout, where our --json goes
            make_worker(config, loopback=True)
    except UcxUnavailable as exc:
        return Check("ucxx", "fail", f"ucxx imports but {exc}",
                     "fix or unset the UCX_* variable UCX's message names (on stderr with --json)",
                     {**data, "starts": False, "error": str(exc)})  # fmt: skip
    return Check("ucxx", "ok", f"ucxx {version or '?'} imports and starts a worker; UCX library "
                 f"{ucx or 'version unknown'}", "", {**data, "starts": True})  # fmt: skip


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 goes to 2 meanwhile (for a C library's prints; the CLI is one thread)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout: nothing to keep apart
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no stderr: UCX's lines go where stdout went
            os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def check_ucx_transports() -> Check:
    if importlib.util.find_spec("ucxx") is None:
        return Check("ucx_transports", "skip", "no UCX: nothing to list", "", {"transports": {}})
    found = ucx_probe.transports()
    names = set(found)
    groups = {"shared_memory": sorted(names & ucx_probe.SHARED_MEMORY), "cuda": sorted(names & ucx_probe.CUDA),
              "rdma": sorted(names & ucx_probe.RDMA)}  # fmt: skip
    data = {"transports": {k: found[k] for k in sorted(found)}, "tcp": bool(names & ucx_probe.TCP), **groups}
    if not found:
        return Check("ucx_transports", "warn", "ucx_info (from the libucx wheel) listed no transports",
                     "check that the libucx wheel is installed beside ucxx; `rlink info` shows the same list", data)  # fmt: skip
    parts = [f"tcp ({', '.join(found['tcp'])})" if data["tcp"] else "no tcp"]
    parts += [f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in groups.items() if v]
    summary = "; ".join(parts)
    if not data["tcp"]:
        return Check("ucx_transports", "warn", summary, "UCX cannot reach other hosts over TCP: check UCX_TLS", data)
    if groups["rdma"] or groups["cuda"]:
        return Check("ucx_transports", "ok", summary, "auto picks ucx across hosts (RDMA/CUDA beat the tcp plane)", data)
    if _rdma_devices():
        return Check("ucx_transports", "warn", summary + "; no RDMA transport although RDMA devices exist",
                     "the PyPI UCX wheels are built without verbs: use a system UCX built with them "
                     "(docs/transports.md)", data)  # fmt: skip
    return Check("ucx_transports", "ok", summary, "no RDMA or CUDA transport: auto uses the faster tcp plane across "
                 "hosts and shm on one host", data)  # fmt: skip


def _rdma_devices(root: str = "/sys/class/infiniband") -> dict[str, list[dict[str, str]]]:
    """``{device: [{port, state, link_layer}]}`` from sysfs (empty without RDMA hardware)."""
    base = Path(root)
    if not base.is_dir():
        return {}
    devices: dict[str, list[dict[str, str]]] = {}
    for dev in sorted(base.iterdir()):
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            ports.append({"port": port.name, "state": _read(port / "state"), "link_layer": _read(port / "link_layer")})
        devices[dev.name] = ports
    return devices


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def check_rdma(root: str = "/sys/class/infiniband", dev: str = "/dev/infiniband") -> Check:
    devices = _rdma_devices(root)
    if not devices:
        return Check("rdma", "ok", "no RDMA devices (/sys/class/infiniband is empty or absent)",
                     "fine without InfiniBand/RoCE: actors on other hosts use tcp", {"devices": {}})  # fmt: skip
    active = sorted(d for d, ports in devices.items() if any("ACTIVE" in p["state"] for p in ports))
    verbs = sorted(p.name for p in Path(dev).glob("uverbs*"))
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    data = {"devices": devices, "active": active, "uverbs": verbs, "memlock_soft": memlock}
    summary = f"{len(devices)} device(s) ({', '.join(devices)}), {len(active)} with an active port"
    if not active:
        return Check("rdma", "warn", summary, "no port is ACTIVE: check the cable/subnet manager (ibstat)", data)
    if not verbs:
        return Check("rdma", "warn", summary + "; /dev/infiniband/uverbs* missing",
                     "in a container pass --device /dev/infiniband (Kubernetes: an RDMA device plugin)", data)  # fmt: skip
    if memlock != resource.RLIM_INFINITY and memlock < 64 * MiB:
        return Check("rdma", "warn", summary + f"; locked-memory limit {memlock // 1024} KiB",
                     "RDMA registers memory: ulimit -l unlimited (docker: --ulimit memlock=-1)", data)  # fmt: skip
    return Check("rdma", "ok", summary, "", data)


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def check_cuda() -> Check:
    torch = _torch()
    gpu_nodes = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    if torch is None:
        return Check("cuda", "warn", "torch is not installed", "RLinkDataset and weights need it: "
                     "pip install 'rlink-ucx[torch]'", {"torch": None, "available": False, "devices": []})  # fmt: skip
    available = bool(torch.cuda.is_available())
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    data = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "available": available, "devices": names,
            "device_nodes": gpu_nodes}  # fmt: skip
    if available:
        return Check("cuda", "ok", f"torch {torch.__version__} (CUDA {torch.version.cuda}): {len(names)} device(s): "
                     f"{', '.join(names)}", "", data)  # fmt: skip
    if gpu_nodes:
        why = "a CPU build of torch" if torch.version.cuda is None else "CUDA_VISIBLE_DEVICES or the driver"
        return Check("cuda", "warn", f"{len(gpu_nodes)} NVIDIA device node(s) but torch sees no CUDA device ({why})",
                     "install a CUDA build of torch, or check CUDA_VISIBLE_DEVICES and nvidia-smi", data)  # fmt: skip
    return Check("cuda", "ok", f"torch {torch.__version__}: no CUDA device (batches and weights stay on the CPU)",
                 "", data)  # fmt: skip


def check_nccl() -> Check:
    torch = _torch()
    if torch is None:
        return Check("nccl", "skip", "torch is not installed", "", {"nccl": False, "gloo": False})
    dist = torch.distributed
    ok = dist.is_available()
    nccl = bool(ok and dist.is_nccl_available())
    gloo = bool(ok and dist.is_gloo_available())
    version = None
    if nccl and torch.cuda.is_available():
        try:
            version = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a version is nice to have
            version = None
    data = {"nccl": nccl, "gloo": gloo, "nccl_version": version}
    found = [name for name, there in ((f"NCCL {version or ''}".strip(), nccl), ("gloo", gloo)) if there]
    # Informational, for the user's own training job: rlink's weights reach each actor on its
    # authenticated weights stream or through sealed shared memory, never through a
    # torch.distributed group (whose listeners would take anyone's connections).
    return Check("nccl", "ok", f"torch.distributed backends: {', '.join(found) or 'none'} (for your own "
                 "training; rlink's weights use neither: authenticated weights streams and shared memory)",
                 "", data)  # fmt: skip


def check_shm(config: Config, actors: int, path: str = "/dev/shm") -> Check:
    need = config.shm_ring_bytes * actors
    data: dict[str, Any] = {"path": path, "actors": actors, "ring_bytes": config.shm_ring_bytes, "need_bytes": need}
    try:
        st = os.statvfs(path)
    except OSError as exc:
        data.update(size_bytes=0, free_bytes=0)
        return Check("shm", "warn", f"{path}: {exc.strerror or exc}", "NCCL and UCX's posix transport need a "
                     "/dev/shm (docker --shm-size, Kubernetes an emptyDir of medium Memory)", data)  # fmt: skip
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    data.update(size_bytes=size, free_bytes=free)
    summary = (f"{path} {size / MiB:,.0f} MiB, {free / MiB:,.0f} MiB free; {actors} same-host actor(s) x "
               f"{config.shm_ring_bytes / MiB:g} MiB ring = {need / MiB:,.0f} MiB")  # fmt: skip
    advice = "raise it: docker --shm-size 1g (or --ipc host), Kubernetes an emptyDir of medium Memory on /dev/shm"
    if free < need:
        return Check("shm", "warn", summary, f"less free than the rings of {actors} actors need; " + advice, data)
    if size < SMALL_SHM:
        return Check("shm", "warn", summary, f"under {SMALL_SHM // MiB} MiB: NCCL and UCX's posix transport run out; "
                     + advice, data)  # fmt: skip
    return Check("shm", "ok", summary, "", data)


def check_nofile(config: Config, actors: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_PER_ACTOR * config.max_connections + FDS_SPARE
    # The learner raises its soft limit up to the hard one at start (learner_admission.py).
    usable = soft if soft >= need else (need if hard == resource.RLIM_INFINITY else min(need, hard))
    capacity = max(0, (usable - FDS_SPARE) // FDS_PER_ACTOR)
    data = {"soft": soft, "hard": hard, "need": need, "max_connections": config.max_connections,
            "actors": actors, "actor_capacity": capacity}  # fmt: skip
    def text(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else str(n)

    summary = f"open files: soft {text(soft)}, hard {text(hard)}; max_connections={config.max_connections} needs {need}"
    fix = f"ulimit -n {need} (docker --ulimit nofile={need}:{need}; systemd LimitNOFILE={need})"
    if capacity < actors:
        return Check("nofile", "fail", summary + f": room for {capacity} actors, fewer than the {actors} expected",
                     fix, data)  # fmt: skip
    if capacity < config.max_connections:
        return Check("nofile", "warn", summary + f": room for {capacity} actors",
                     f"{fix}, or lower Config.max_connections (RLINK_MAX_CONNECTIONS) to {capacity}", data)  # fmt: skip
    if soft < need:
        summary += f" (the learner raises its soft limit to {need} at start)"
    return Check("nofile", "ok", summary, "", data)


def check_somaxconn(config: Config, path: str = "/proc/sys/net/core/somaxconn") -> Check:
    backlog = listen_backlog(config)
    try:
        value = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        return Check("somaxconn", "warn", f"cannot read net.core.somaxconn: {exc}", "", {"somaxconn": None,
                     "backlog": backlog})  # fmt: skip
    data = {"somaxconn": value, "backlog": backlog}
    summary = f"net.core.somaxconn {value}; the learner asks for a listen backlog of {backlog}"
    if value < backlog:
        return Check("somaxconn", "warn", summary + f": more than {value} actors connecting at once wait for SYN "
                     "retries (seconds)", f"sysctl -w net.core.somaxconn={backlog} (per network namespace: "
                     "set it in the container/pod)", data)  # fmt: skip
    return Check("somaxconn", "ok", summary, "", data)


def _mode_of(path: Path) -> dict[str, Any]:
    st = os.lstat(path)
    return {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "owner_uid": st.st_uid, "link": stat.S_ISLNK(st.st_mode),
            "private": st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)}  # fmt: skip


def check_token(config: Config) -> Check:
    """Where a token would come from (never its value), and whether the files holding one are private."""
    env_token, env_file = bool(os.environ.get("RLINK_TOKEN")), os.environ.get("RLINK_TOKEN_FILE") or None
    directory = tokens.token_dir(config)
    data: dict[str, Any] = {"rlink_token_set": env_token, "rlink_token_file": env_file, "token_dir": str(directory)}
    if env_file:
        try:
            data["token_file_mode"] = _mode_of(Path(env_file)) | {"exists": True}
        except OSError as exc:
            data["token_file_mode"] = {"exists": False, "error": exc.strerror or str(exc)}
    try:
        token = resolve_token(None)
    except ConfigError as exc:
        data["source"] = None
        return Check("token", "fail", str(exc), "fix the variable or file: chmod 600 the file, at least 16 bytes "
                     "of secret (`rlink token` makes one)", data)  # fmt: skip
    data["source"] = "RLINK_TOKEN" if env_token else ("RLINK_TOKEN_FILE" if token is not None else None)
    generated: list[dict[str, Any]] = []
    if directory.is_dir():
        data["token_dir_mode"] = _mode_of(directory)
        for path in sorted(directory.glob("*.token")):
            generated.append({"file": path.name, **_mode_of(path)})
    data["generated_tokens"] = generated
    if data.get("token_dir_mode") and not data["token_dir_mode"]["private"]:
        return Check("token", "warn", f"{directory} is not private to this user (mode {data['token_dir_mode']['mode']},"
                     f" uid {data['token_dir_mode']['owner_uid']})", "a learner refuses to keep its token there: "
                     "remove it or set RLINK_TOKEN_DIR to a 0700 directory", data)  # fmt: skip
    open_files = [g["file"] for g in generated if not g["private"]]
    if open_files:
        return Check("token", "warn", f"token file(s) open to others in {directory}: {', '.join(open_files)}",
                     "actors ignore them; remove them (a learner writes its own, mode 0600)", data)  # fmt: skip
    if data["source"] == "RLINK_TOKEN":
        also = " (RLINK_TOKEN_FILE is set too and ignored)" if env_file else ""
        return Check("token", "ok", f"RLINK_TOKEN is set ({len(token or b'')} bytes){also}",
                     "prefer RLINK_TOKEN_FILE on shared hosts: a process environment can leak into logs", data)  # fmt: skip
    if data["source"] == "RLINK_TOKEN_FILE":
        return Check("token", "ok", f"RLINK_TOKEN_FILE {env_file} (mode {data['token_file_mode']['mode']})", "", data)
    ports = ", ".join(g["file"] for g in generated) or "none"
    return Check("token", "ok", f"no token given: a learner generates one in {directory} for this user's local "
                 f"actors (token files now: {ports})", "across hosts give every process the same secret: "
                 "RLINK_TOKEN_FILE (make one with `rlink token`)", data)  # fmt: skip


def worst(checks: list[Check]) -> str:
    """The most severe status among ``checks``."""
    return max((c.status for c in checks), key=STATUSES.index, default="ok")
