"""One frozen configuration object for every timeout, cap and knob.

Precedence: an explicit ``Config(...)`` argument > ``RLINK_<FIELD>`` environment variable >
the default here, for every ``Config`` made (``Config()``, ``Config(put_timeout=5)``,
``Config.from_env()``); ``replace`` keeps what the config had. Every wait in the library
takes its limit from this object, so nothing blocks forever.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["Config"]

KiB = 1024
MiB = 1024 * KiB


_MAY_BE_ZERO = {"reconnect_timeout", "resend_buffer_bytes", "resend_large_puts", "ucx_recycle_after",
                "shm_direct_read", "weights_shared_memory", "weights_relay", "rank_port_base", "gc_freeze"}  # 0 switches the feature off

# The ranges every field is checked against, by its type (Config.__post_init__, and each RLINK_*
# variable as it is read): seconds are finite and at most a year (a longer wait is a mistake, and
# threading refuses waits past ~292 years); sizes (``*_bytes``) are whole numbers up to 256 TiB,
# past any host's memory; counts up to 2**31 - 1; 0 only for the fields in _MAY_BE_ZERO. A field
# named in _RANGES has its own. NaN and infinities fail every rule.
_MAX_SECONDS = 365 * 24 * 3600.0
_MAX_BYTES = 1 << 48
_MAX_COUNT = (1 << 31) - 1
_RANGES = {"rank_port_base": (0, 65535)}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Config:
    """Timeouts (seconds), memory caps (bytes) and data-plane knobs.

    Build with keyword arguments; fields not given fall back to ``RLINK_<NAME>``
    environment variables (``RLINK_PUT_TIMEOUT=5``), then to the defaults below.
    """

    # --- timeouts -------------------------------------------------------------------------
    connect_timeout: float = 120.0  # an actor waits this long for its learner (it may start first)
    handshake_timeout: float = 5.0
    # A new connection must prove the token (or attach with its session's ticket) this soon
    # after it is accepted, else it is dropped: unauthenticated sockets cannot hold a slot for
    # the whole handshake_timeout. An actor that was too slow retries with backoff.
    preauth_timeout: float = 3.0
    put_timeout: float = 30.0
    flush_timeout: float = 30.0
    fetch_timeout: float = 300.0
    # A fetch that has waited this long while no actor streams to the learner (none came yet, or
    # every one has gone) says so with a warning (the warnings module), once per fetch.
    fetch_warn_after: float = 5.0
    close_timeout: float = 5.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    frame_timeout: float = 10.0  # a started data frame must finish arriving within this
    reconnect_timeout: float = 60.0  # an actor retries a lost learner this long (0: never)

    weights_timeout: float = 30.0  # sending or awaiting one bucket of weights, a publish(wait=True)

    # --- actor-side coalescing ------------------------------------------------------------
    frame_bytes: int = 1 * MiB  # target payload per frame; small steps are coalesced to this
    # A step put while the actor's I/O side is idle leaves at once. One that comes less than this
    # long after the last frame left waits for company: its partly filled frame is sent about
    # this long after its first step (0.5x to 1.5x: one timer serves every actor of a process,
    # armed only while such a frame waits).
    frame_linger: float = 0.005
    frame_buffers: int = 4  # frames an actor can fill while earlier ones are in flight
    # Frames sent but not yet acknowledged are kept (up to this many bytes) and resent after a
    # reconnect; past it, put waits for acknowledgements (0: keep nothing). Small steps are
    # kept for free (their frame buffers wait for the acknowledgement); a put of a frame or
    # more is sent straight from the caller's memory and kept only with resend_large_puts,
    # which costs a copy (docs/reliability.md has the numbers). What a broken connection
    # loses unkept is counted on both sides, never silent.
    resend_buffer_bytes: int = 32 * MiB
    resend_large_puts: bool = False

    # --- learner-side caps ----------------------------------------------------------------
    # The learner's receive ring (per schema): a schema two of whose frames do not fit is refused;
    # the ring rounds up to whole batches (at least one), and up to 4 spare batches are kept for lending.
    buffer_bytes: int = 64 * MiB
    actor_window_bytes: int = 32 * MiB  # credit an actor may hold (in flight) at once
    max_frame_bytes: int = 64 * MiB  # largest frame payload accepted
    max_control_bytes: int = 1 * MiB  # largest control message after authentication
    max_preauth_bytes: int = 512  # largest message read before authentication
    max_connections: int = 1024  # actors served at once (each holds 2-4 file descriptors)
    max_handshakes: int = 128  # connections still handshaking, apart from the actors; the oldest goes first
    # ... and from one peer address (an IPv6 peer: its /64); at the cap that peer's oldest goes
    # if older than preauth_timeout/2, else the newcomer is refused (and retries), so a flood
    # from one address cannot push out the handshakes of others, nor a host's own storm churn.
    max_handshakes_per_peer: int = 32
    max_fields: int = 256
    max_weights_bytes: int = 16 * 1024 * MiB  # largest published model an actor accepts
    max_weights_tensors: int = 100_000
    # At the learner's first batch, move every object alive then out of the garbage
    # collector's way (gc.freeze): a full collection holds the GIL, and with torch imported it
    # walks enough objects to stall the learner's receiving (docs/reliability.md). What is
    # frozen is never collected, even if it becomes garbage.
    gc_freeze: bool = True

    # --- weights ---------------------------------------------------------------------------
    weights_bucket_bytes: int = 32 * MiB  # one tagged bucket: an actor checks each as it arrives
    # Actors on the learner's host read each version straight from the learner's shared memory
    # (one copy, no sockets) instead of over a weights stream; on another host, the actors of the
    # host share one copy that one of them streams (an actor's setting says whether it takes part);
    # docs/weights.md.
    weights_shared_memory: bool = True
    # Hosts off the learner's pass each version on, one to the next, so the learner sends it
    # about once (weights/relay.py, weights/chain.py; docs/weights.md): an actor that holds its
    # host's copy opens a relay listener when the learner asks (authenticated, admission-limited
    # like the learner's port). False: it never listens, and its host takes versions from the
    # learner. Needs weights_shared_memory.
    weights_relay: bool = True
    # How the learner sends each version's bytes to the hosts off its own: "relay" (the default)
    # is the above; "broadcast" is for a cluster whose network you trust: the learner and each
    # host's streamer form a torch.distributed group of their own (NCCL for a CUDA model, else
    # gloo) and the bytes go by broadcast (weights/broadcast.py, docs/weights.md). Keys and Seals
    # still travel on the authenticated control connections and actors check every tag, but
    # the group's store and gloo/NCCL listeners accept anyone who reaches them: a stranger on the
    # network can read the model's bytes and can break the group (SECURITY.md). Needs torch
    # on the learner and the actors' hosts; the actors' setting says whether they take part.
    weights_fanout: str = "relay"

    # --- transport ------------------------------------------------------------------------
    shm_ring_bytes: int = 8 * MiB  # per same-host actor on the shm plane
    # shm plane: an actor lets the learner read large payloads straight out of its memory
    # (process_vm_readv: one copy instead of two) where the kernel allows it; docs/transports.md.
    shm_direct_read: bool = True
    ucx_segment_bytes: int = 512 * KiB  # UCX_TCP_TX/RX_SEG_SIZE; see docs/transports.md
    # Congestion control of the tcp plane's data connections: "auto" = Reno where the peer is
    # this host (no pacing; docs/transports.md), the system's default elsewhere; "system" = the
    # system's default everywhere; or a kernel's name for all of them ("reno", "cubic", ...;
    # between containers Reno measured slower for rlink, docs/transports.md).
    tcp_congestion: str = "auto"
    # The learner's UCX worker keeps the shared memory of every actor process it talked to
    # (docs/reliability.md). Once this many ucx sessions, and at least twice as many as are
    # live, have ended, it starts a fresh worker and moves the live ucx actors to it (they
    # reconnect once, losing nothing); 0: never.
    ucx_recycle_after: int = 16

    # --- many learner ranks (Learner(distributed=True)) -------------------------------------
    # Where a rank other than 0 listens and is reached by the actors rank 0 sends it: "" is
    # the host of the address given where it is this host's, else all interfaces, reached at
    # this host's address on the way to rank 0. Port rank_port_base + rank (0: a free port).
    rank_host: str = ""
    rank_port_base: int = 0
    # A file (mode 0600) holding the job's rank token, the secret by which learner ranks prove
    # to each other that they are ranks (actors do not hold it). "": RLINK_RANK_TOKEN, else one
    # that rank 0 generates for ranks on its own host (docs/multi-learner.md).
    rank_token_file: str = ""

    # --- authentication -------------------------------------------------------------------
    # Where a learner given no token writes the one it generates, and where the same user's
    # actors on this host look for it ("": $XDG_RUNTIME_DIR/rlink, else /tmp/rlink-<uid>).
    token_dir: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            try:
                checked = _checked(field, value)
            except _Refused as exc:
                raise ConfigError(f"Config.{field.name} {exc}, got {repr(value)[:40]}") from None
            if checked is not value:
                object.__setattr__(self, field.name, checked)  # 1e6 for an int field, np.float32, ...
        if not re.fullmatch(r"[a-z0-9_]{1,15}", self.tcp_congestion):
            raise ConfigError(f'Config.tcp_congestion must be "auto", "system" or a congestion control\'s name '
                              f"(lowercase letters, digits, _), got {self.tcp_congestion!r}")  # fmt: skip
        if self.weights_fanout not in ("relay", "broadcast"):
            raise ConfigError(f'Config.weights_fanout must be "relay" or "broadcast", got {self.weights_fanout!r}')
        if self.frame_bytes > self.max_frame_bytes:
            raise ConfigError("Config.frame_bytes must not exceed Config.max_frame_bytes")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, overridden by ``RLINK_*`` variables (of ``environ``, else the process's),
        overridden by ``overrides``. ``Config(**overrides)`` does the same with the process's."""
        config = cls.__new__(cls)
        _dataclass_init(config, **{**_env_values(os.environ if environ is None else environ), **overrides})
        return config

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


class _Refused(Exception):
    """A value a field does not take; the text says what it takes."""


def _checked(field: dataclasses.Field[Any], value: Any) -> Any:
    """``value`` as a value of ``field``: of its type (an integral float for an int field becomes
    an int, a numpy number a Python one) and in its range. :class:`_Refused` says what the field
    takes."""
    kind: Any = type(field.default)
    if kind is str:
        if not isinstance(value, str):
            raise _Refused("must be a string")
        return value
    if kind is bool:
        if not isinstance(value, numbers.Integral) or value not in (0, 1):
            raise _Refused("must be True or False")
        return bool(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Refused(f"must be a number ({kind.__name__})")
    number: Any = value
    zero = field.name in _MAY_BE_ZERO
    if kind is float:
        try:
            number = float(number)
        except OverflowError:  # an int past float's range
            number = math.inf
        if not (math.isfinite(number) and (number >= 0 if zero else number > 0) and number <= _MAX_SECONDS):
            raise _Refused(f"must be {'>= 0' if zero else '> 0'} and finite, at most {_MAX_SECONDS:.0f} s (a year)")
        return number
    low, high = _RANGES.get(field.name, (0 if zero else 1, _MAX_BYTES if field.name.endswith("_bytes") else _MAX_COUNT))
    whole = isinstance(number, numbers.Integral) or (math.isfinite(number) and float(number).is_integer())
    if not whole or not low <= number <= high:
        raise _Refused(f"must be a whole number from {low} to {high}")
    return int(number)


def _parsed(kind: type[Any], raw: str) -> Any:
    """An ``RLINK_*`` variable's text as a value of a field of type ``kind`` (checked later)."""
    if kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError
        return word in _TRUE
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            return float(raw)  # "1e6"; 1.5 or inf is refused by the range check
    return kind(raw)


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``RLINK_<FIELD>`` variables in ``env``, as Config field values, each checked as
    :func:`_checked` checks the field (the error names the variable and the setting)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Config):
        var = f"RLINK_{field.name.upper()}"
        raw = env.get(var)
        if raw is None:
            continue
        kind: type[Any] = type(field.default)
        try:
            value = _parsed(kind, raw)
        except ValueError:
            what = "one of " + "/".join(_TRUE + _FALSE) if kind is bool else f"a {kind.__name__}"
            raise ConfigError(f"{var}={raw!r} is not {what} (Config.{field.name})") from None
        try:
            values[field.name] = _checked(field, value)
        except _Refused as exc:
            raise ConfigError(f"{var}={raw!r}: Config.{field.name} {exc}") from None
    return values


_dataclass_init = Config.__init__


def _init_with_env(self: Config, *args: Any, **given: Any) -> None:
    # Fields not given come from RLINK_* variables, then the defaults: Config(frame_bytes=...)
    # in a script keeps the operator's RLINK_SHM_DIRECT_READ=0. (dataclasses.replace passes
    # every field, so a replaced config keeps the values it had.)
    given.update(zip((f.name for f in dataclasses.fields(Config)), args))
    _dataclass_init(self, **{**_env_values(os.environ), **given})


_init_with_env.__signature__ = inspect.signature(_dataclass_init)  # type: ignore[attr-defined]
_init_with_env.__doc__ = _dataclass_init.__doc__
Config.__init__ = _init_with_env  # type: ignore[method-assign]


def resolve(config: Config | None) -> Config:
    """The config to use: the caller's, or one built from the environment."""
    return config if config is not None else Config.from_env()
