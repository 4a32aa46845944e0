"""A job of many learner ranks, without torch.distributed: this process's rank and the job's
size come from the launcher's environment, rank 0 is found at the address every rank was given,
and the ranks prove to each other that they are ranks with the job's rank token, a secret that
actors do not hold (the rank links themselves are in ``placement.py`` and ``link.py``).

Rank 0 writes a job file, ``job-<rendezvous>.rank0`` (mode 0600, in its user's token directory,
``tokens.token_dirs``), named by the launcher's rendezvous (``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``/``SLURM_STEP_ID``): its port (port 0 is a free one),
its pid, and the rank token it generated. Ranks on rank 0's host read it there, as local actors
read a generated token. Ranks on other hosts read no file: they need a fixed port and the rank
token given (``RLINK_RANK_TOKEN`` / ``RLINK_RANK_TOKEN_FILE``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....config import Config
from ....errors import ConfigError
from ....transport.address import is_loopback
from ... import tokens

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")
GIVE_RANK_TOKEN = ("give every learner rank the same rank token, one actors do not hold: RLINK_RANK_TOKEN_FILE=PATH "
                   "(mode 0600; make one with `rlink token --file PATH`) or RLINK_RANK_TOKEN")  # fmt: skip


@dataclass(frozen=True)
class Job:
    """This process's place in a job of many learner ranks.

    Attributes:
        rank, world: from the default process group where the user made one, else the launcher.
        rendezvous: the launcher's rendezvous, hashed (names rank 0's job file; "" without one).
        spans_hosts: the launcher says the ranks run on more than one host (None: it does not say).
    """

    rank: int
    world: int
    rendezvous: str
    spans_hosts: bool | None

    @property
    def job_file(self) -> str:
        return f"job-{self.rendezvous}.rank0"


@dataclass(frozen=True)
class RankZero:
    """What a rank read in rank 0's job file."""

    port: int
    rank_token: bytes | None  # the rank token rank 0 generated (None: one was given)


def find_job(address: str, environ: Any = None) -> Job:
    """This process's rank and the job's size: the user's default process group where one is
    initialised (read, never used), else the launcher's ``RANK``/``WORLD_SIZE`` (torchrun, a
    Kubernetes indexed job) or ``SLURM_PROCID``/``SLURM_NTASKS`` (srun).

    Raises:
        ConfigError: neither gives a rank, or the rank is not one of the job's.
    """
    env = os.environ if environ is None else environ
    found = _default_group() or launcher_rank(env)
    if found is None:
        raise ConfigError("Learner(distributed=True) found no launcher's variables: start it under torchrun, srun or a "
                          "launcher that sets RANK and WORLD_SIZE (or SLURM_PROCID and SLURM_NTASKS)")  # fmt: skip
    rank, world = found
    if not 0 <= rank < world:
        raise ConfigError(f"Learner(distributed=True): rank {rank} is not a rank of a job of {world}")
    values = [env.get(name, "") for name in RENDEZVOUS]
    key = ""
    if any(values[1:]):  # an address alone names no job
        key = hashlib.sha256("\0".join([*values, address, str(world)]).encode()).hexdigest()[:32]
    return Job(rank, world, key, _spans_hosts(env))


def _default_group() -> tuple[int, int] | None:
    """The user's default torch.distributed group's rank and size, where one is initialised
    (torch is not imported for it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _spans_hosts(env: Any) -> bool | None:
    for local, whole in (("LOCAL_WORLD_SIZE", "WORLD_SIZE"), ("SLURM_NNODES", None), ("SLURM_JOB_NUM_NODES", None)):
        try:
            if whole is None and env.get(local):
                return int(env[local]) > 1
            if whole is not None and env.get(local) and env.get(whole):
                return int(env[local]) < int(env[whole])
        except ValueError:
            continue
    return None


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


def given_rank_token(config: Config, actor_token: bytes | None) -> bytes | None:
    """The rank token given to this rank (``RLINK_RANK_TOKEN``, else the file named by
    ``Config.rank_token_file`` / ``RLINK_RANK_TOKEN_FILE``); None when none is.

    Raises:
        ConfigError: a short token, an unusable file, or the actors' token given as the rank token.
    """
    if os.environ.get("RLINK_RANK_TOKEN"):
        token: bytes | None = tokens.check_token(os.environ["RLINK_RANK_TOKEN"].strip(), "RLINK_RANK_TOKEN")
    elif config.rank_token_file:
        token = tokens.read_token_file(config.rank_token_file)
    else:
        return None
    if token == actor_token:
        raise ConfigError("the rank token is the actors' token: a rank proves it is one with a secret actors do not "
                          f"hold; {GIVE_RANK_TOKEN}")  # fmt: skip
    return token


def rank_0_token(job: Job, given: bytes | None) -> bytes:
    """Rank 0's rank token: the one given, else a generated one (for ranks on its host only).

    Raises:
        ConfigError: none given for a job the launcher says spans hosts, or one with no rendezvous.
    """
    if given is not None:
        return given
    if job.spans_hosts:
        raise ConfigError(f"this job's learner ranks run on more than one host: {GIVE_RANK_TOKEN}")
    if not job.rendezvous:
        raise ConfigError("no rank token given and no launcher's rendezvous (MASTER_PORT, TORCHELASTIC_RUN_ID or "
                          f"SLURM_JOB_ID) by which the other ranks on this host find one: {GIVE_RANK_TOKEN}")  # fmt: skip
    return tokens.new_token().encode()


def publish_rank_0(config: Config, job: Job, port: int, generated: bytes | None) -> Path | None:
    """Rank 0: write the job file where the ranks on this host find its port and generated rank
    token (None without a rendezvous: nothing to name it by)."""
    if not job.rendezvous:
        return None
    body = {"port": port, "pid": os.getpid(), "rank_token": generated.decode() if generated else ""}
    return tokens.publish_private(config, job.job_file, json.dumps(body).encode(), "rank 0's job file")


def await_rank_0(config: Config, job: Job, home: str, deadline: float) -> RankZero:
    """Another rank: rank 0's job file, once rank 0 (a live process of this user on this host)
    wrote it, polling until ``deadline`` (``time.monotonic()``).

    Raises:
        ConfigError: rank 0 is on another host, the job has no rendezvous, or no file in time.
    """
    if not (is_loopback(home) or _is_local(home)):
        raise ConfigError(f"rank 0 at {home} is on another host: give every rank a fixed port (not 0) and {GIVE_RANK_TOKEN}")
    if not job.rendezvous:
        raise ConfigError("no launcher's rendezvous (MASTER_PORT, TORCHELASTIC_RUN_ID or SLURM_JOB_ID) names this job: "
                          f"give every rank a fixed port (not 0) and {GIVE_RANK_TOKEN}")  # fmt: skip
    why = ""
    while True:
        raw, why = tokens.find_private(config, job.job_file)
        word = None if raw is None else _read_job_file(raw)
        if word is not None:
            return word
        if time.monotonic() >= deadline:
            raise ConfigError(f"learner rank {job.rank}: rank 0 wrote no job file on this host in time ({why}): did it "
                              f"start? Ranks on other hosts need a fixed port and {GIVE_RANK_TOKEN}")  # fmt: skip
        time.sleep(0.1)


def _read_job_file(raw: bytes) -> RankZero | None:
    """The file's word, or None when it is unreadable or its writer is gone (a rank 0 of an
    earlier job that was killed)."""
    try:
        body = json.loads(raw)
        port, pid, token = int(body["port"]), int(body["pid"]), str(body["rank_token"])
        os.kill(pid, 0)
    except PermissionError:  # a live process (of another user: the file is private, so not expected)
        pass
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if not 0 < port < 65536:
        return None
    return RankZero(port, token.encode() if token else None)


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


@dataclass(frozen=True)
class RankPlan:
    """How a rank other than 0 starts: where rank 0 is, the tokens, where it listens."""

    home: tuple[str, int]  # rank 0's host and port
    rank_token: bytes
    actor_token: bytes | None  # the actors' token rank 0 generated and published on this host, if any
    bind: tuple[str, int]  # where this rank listens
    advertised: str  # the host actors placed here are sent to


def plan_rank(job: Job, config: Config, address: tuple[str, int], actor_token: bytes | None, insecure: bool) -> RankPlan:
    """Find rank 0 and the job's tokens for rank ``job.rank`` (> 0), given the ``address``
    every rank was given and this rank's actors' token (None: none given).

    Raises:
        ConfigError: rank 0 cannot be found in ``Config.connect_timeout``, or a token is missing.
    """
    host, port = address
    home = rank_home(host)
    given = given_rank_token(config, actor_token)
    deadline = time.monotonic() + config.connect_timeout
    word = await_rank_0(config, job, home, deadline) if port == 0 or given is None else None
    home_port = port or (word.port if word else 0)
    rank_token = given or (word.rank_token if word else None)
    if rank_token is None:
        raise ConfigError(f"learner rank {job.rank} was given no rank token, and rank 0 generated none (it was given "
                          f"one): {GIVE_RANK_TOKEN}")  # fmt: skip
    generated = None
    if actor_token is None and not insecure and (is_loopback(home) or _is_local(home)):
        while generated is None:  # rank 0 publishes a token it generated as soon as it listens
            generated, _ = tokens.find(config, home_port)
            if word is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    bind_host, bind_port, advertised = rank_bind(host, home, job.rank, config)
    return RankPlan((home, home_port), rank_token, generated, (bind_host, bind_port), advertised)


def check_rank_0_port(job: Job, port: int) -> None:
    """Refuse port 0 on rank 0 where the other ranks could not learn the port chosen."""
    if port == 0 and (job.spans_hosts or not job.rendezvous):
        why = "the job's ranks run on more than one host" if job.spans_hosts else "no launcher's rendezvous " \
              "(MASTER_PORT, TORCHELASTIC_RUN_ID or SLURM_JOB_ID) names this job"  # fmt: skip
        raise ConfigError(f"Learner(distributed=True) on port 0: {why}, so the other ranks cannot learn the port rank 0 "
                          "picks; give a fixed port")  # fmt: skip


def withdraw_rank_0(path: Path | None) -> None:
    """Remove rank 0's job file if this process wrote it (idempotent)."""
    if path is None:
        return
    try:
        if int(json.loads(path.read_bytes())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass
