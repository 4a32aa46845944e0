"""A job of many learner ranks: the torch.distributed group they meet in, and what rank 0 tells
the others when they start (its port, a token it generated). No pickle: rank 0's word is a
msgpack struct in a fixed-size byte tensor.

Every rank calls these in the same order (they are collectives): :func:`join`, then
:meth:`Job.tell` on rank 0 / :meth:`Job.hear` on the others, then :meth:`Job.agree`."""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import msgspec

from ...config import Config
from ...errors import ConfigError
from ...transport.address import is_loopback

log = logging.getLogger(__name__)

WORD_BYTES = 4096  # rank 0's word to the others, msgpack, zero-padded
WILDCARDS = ("0.0.0.0", "::", "")


class Home(msgspec.Struct, frozen=True):
    """What rank 0 tells the other ranks once it listens."""

    error: str  # "" when rank 0 started
    port: int
    token: bytes  # the token rank 0 generated (loopback only), else b""
    digest: bytes  # the job's token, hashed: every rank must hold the same (b"": insecure)


@dataclass
class Job:
    """This process's rank in the job, and rlink's own gloo group (never the user's)."""

    rank: int
    world: int
    group: Any
    created_default: bool  # rlink initialised the default group (and destroys it at close)

    def tell(self, home: Home) -> None:
        """Rank 0: tell every other rank ``home`` (collective)."""
        self._broadcast(msgspec.msgpack.encode(home))

    def hear(self) -> Home:
        """Another rank: what rank 0 said (collective)."""
        body = self._broadcast(None)
        try:
            return msgspec.msgpack.decode(body, type=Home)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"rank {self.rank}: rank 0's word is unreadable ({exc}): is every rank the same rlink "
                              "version?") from exc  # fmt: skip

    def agree(self, error: str | None) -> None:
        """Every rank says whether it started; raise on every rank if one did not (collective)."""
        import torch
        import torch.distributed as dist

        failed = torch.tensor([0 if error is None else 1 + self.rank], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if error is not None:
            raise ConfigError(error)
        if int(failed.item()):
            raise ConfigError(f"learner rank {int(failed.item()) - 1} of {self.world} did not start (see its log): "
                              "no rank serves actors")  # fmt: skip

    def _broadcast(self, body: bytes | None) -> bytes:
        import torch
        import torch.distributed as dist

        buf = torch.zeros(WORD_BYTES, dtype=torch.uint8)
        if body is not None:
            if len(body) + 4 > WORD_BYTES:
                raise ConfigError("rank 0's word to the other ranks is too long")
            raw = len(body).to_bytes(4, "little") + body
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        raw = buf.numpy().tobytes()
        return raw[4 : 4 + min(int.from_bytes(raw[:4], "little"), WORD_BYTES - 4)]

    def close(self) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group(self.group)
                if self.created_default:
                    dist.destroy_process_group()
        except Exception:  # a group whose peers already left: nothing more to release here
            log.debug("destroying rlink's process group", exc_info=True)


def launcher_rank(environ: Any = None) -> tuple[int, int] | None:
    """``(rank, world size)`` from torchrun's ``RANK``/``WORLD_SIZE``, else srun's
    ``SLURM_PROCID``/``SLURM_NTASKS``; None when neither is set."""
    env = os.environ if environ is None else environ
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if env.get(rank) is not None and env.get(world) is not None:
            try:
                return int(env[rank]), int(env[world])
            except ValueError as exc:
                raise ConfigError(f"{rank}={env[rank]!r} / {world}={env[world]!r} are not numbers") from exc
    return None


def join(config: Config) -> Job:
    """Meet the job's other ranks: in the default process group where one is initialised (any
    backend), else in one initialised from the launcher's environment (gloo); rlink's traffic
    goes in a gloo group of its own."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ConfigError("Learner(distributed=True) needs torch: pip install 'rlink-ucx[torch]'") from exc
    if not dist.is_available():
        raise ConfigError("Learner(distributed=True): this torch build has no torch.distributed")
    timeout = datetime.timedelta(seconds=config.connect_timeout)
    created = False
    if not dist.is_initialized():
        found = launcher_rank()
        if found is None:
            raise ConfigError("Learner(distributed=True) found no process group and no launcher's variables: start it "
                              "under torchrun or srun (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS), or call "
                              "torch.distributed.init_process_group first")  # fmt: skip
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ConfigError(f"Learner(distributed=True): set {' and '.join(missing)} (where rank 0 of the job meets the "
                              "others; torchrun sets them, a SLURM script exports them)")  # fmt: skip
        rank, world = found
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        created = True
    group = dist.new_group(backend="gloo", timeout=timeout)
    return Job(dist.get_rank(), dist.get_world_size(), group, created)


def token_digest(token: bytes | None) -> bytes:
    return b"" if token is None else hashlib.sha256(b"rlink job token\0" + token).digest()


def rank_home(address_host: str) -> str:
    """Where the other ranks reach rank 0: the host of the address every rank was given, or
    for a wildcard, ``MASTER_ADDR`` (torchrun and the SLURM recipe set it to rank 0's host)."""
    if address_host not in WILDCARDS:
        return address_host
    master = os.environ.get("MASTER_ADDR", "")
    if not master:
        raise ConfigError(f"Learner(distributed=True) on {address_host or 'all interfaces'}: the other ranks cannot tell "
                          "where rank 0 is; give a concrete address or set MASTER_ADDR")  # fmt: skip
    return master


def rank_bind(address_host: str, home: str, rank: int, config: Config) -> tuple[str, int, str]:
    """Where a rank other than 0 listens, ``(bind host, port, advertised host)``:
    ``Config.rank_host`` when set; else the host of the address given when it is one of this
    host's (loopback, or rank 0's host shared), else all interfaces, advertised as the address
    this host reaches rank 0 from. Port ``Config.rank_port_base + rank``, or a free one."""
    port = config.rank_port_base + rank if config.rank_port_base else 0
    if config.rank_host:
        return config.rank_host, port, config.rank_host
    if address_host not in WILDCARDS and (is_loopback(address_host) or _is_local(address_host)):
        return address_host, port, address_host
    wildcard = "::" if ":" in address_host else "0.0.0.0"
    return wildcard, port, _source_address(home)


def _is_local(host: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def _source_address(home: str) -> str:
    """This host's address on the route to ``home`` (no packet is sent)."""
    try:
        info = socket.getaddrinfo(home, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as sock:
            sock.connect(info[4])
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise ConfigError(f"cannot tell this rank's address on the way to rank 0 at {home!r} ({exc}): set "
                          "Config.rank_host (RLINK_RANK_HOST)") from exc  # fmt: skip
