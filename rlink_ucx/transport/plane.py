"""A data plane behind one interface, the registry that names the planes, and the one place
where what a connection raises becomes rlink's error.

A plane is one :class:`Plane` subclass (``TcpPlane`` in ``tcp/plane.py``, ``ShmPlane`` in
``shm/plane.py``, ``UcxPlane`` in ``ucx/plane.py``), registered in ``transport/__init__.py``
(or, for a plane defined outside rlink, in a module named by ``RLINK_PLANES``).
Its class says what it is and what this process can offer (``available``), how it is chosen
(``refusal`` when asked for by name, ``auto`` otherwise) and how an actor attaches to it
(``connect``); an instance is the plane in one learner (``start``, ``prepare``, ``open`` a
session, ``close``). What a session holds between its Welcome and its attach is an
:class:`Opening`, whose ``attach`` hands back the started receiver and the Ready to send.
Nothing above ``transport/`` compares plane names: it asks the plane.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import msgspec

from ..errors import ConfigError, PeerLost, ProtocolError, RLinkError
from .base import FrameSink

if TYPE_CHECKING:
    from ..config import Config
    from ..wire import messages as _wire
    from .base import FrameReceiver, FrameSender
    from .control import ControlConnection
    from .frame_memory import FrameMemory

AUTO = "auto"
_T = TypeVar("_T")


def encode_blob(value: Any) -> bytes:
    """A plane's offer, answer or attach detail as the opaque bytes the protocol carries
    (msgpack; the wire caps their size)."""
    return msgspec.msgpack.encode(value)


def decode_blob(blob: bytes, kind: type[_T], what: str) -> _T:
    """The plane's ``kind`` read back from ``blob``, validated by type; :class:`ProtocolError`
    naming ``what`` for bytes that are not one (a peer's bad blob never reaches the plane)."""
    try:
        return msgspec.msgpack.decode(blob, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from exc
    except RecursionError:
        raise ProtocolError(f"malformed {what}: nested too deeply") from None


def map_plane_error(exc: BaseException, what: str = "") -> RLinkError:
    """rlink's error for what a control or data connection raised: an :class:`RLinkError` as it
    is; anything else (``OSError``, ``EOFError``, a ucxx error, ...) means the peer or the link
    broke it, so :class:`PeerLost` (``"{what}: {exc}"``) with ``exc`` as its cause, which is
    where a retry loop looks for ``ConnectionRefusedError``."""
    if isinstance(exc, RLinkError):
        return exc
    lost = PeerLost(f"{what}: {exc}" if what else str(exc))
    lost.__cause__ = exc
    return lost


@dataclass(frozen=True)
class Situation:
    """What the choice of one actor's plane depends on: the planes each side offers (by
    name) and whether the actor runs on the learner's host."""

    learner: frozenset[str]
    actor: frozenset[str]
    same_host: bool = False

    @property
    def both(self) -> frozenset[str]:
        return self.learner & self.actor


class SessionSide(FrameSink, Protocol):
    """What a plane's learner side uses of a session (``LearnerSession``)."""

    actor_id: int
    key: bytes
    hello: _wire.Hello
    transport: str
    transport_reason: str


@dataclass
class ActorSide:
    """What a plane's actor side is handed to attach one session."""

    welcome: _wire.Welcome
    config: Config
    loop: asyncio.AbstractEventLoop
    wanted: str  # the plane the actor asked for, or "auto"
    loopback: bool  # the learner is on a loopback address
    control: socket.socket  # the control channel's socket
    session_key: bytes  # proves the data connection (``wire.keys.session_key``)
    incarnation: int
    memory: FrameMemory  # the actor's frame buffers (the shm plane lends the learner its arena)
    open_data: Callable[[], Awaitable[tuple[ControlConnection, _wire.Challenge]]]  # a data connection


@dataclass
class Attached:
    """An actor's attached plane: its sender, and the Welcome as the plane left it (a plane
    that falls back to another says so in its ``transport`` and ``reason``)."""

    sender: FrameSender
    welcome: _wire.Welcome


@dataclass
class LearnerContext:
    """What a plane's learner side is made with."""

    wanted: str  # the learner's ``transport``
    config: Config
    loop: asyncio.AbstractEventLoop
    host: str  # the control channel's bind address
    loopback: bool


@dataclass
class Opening:
    """One session's plane between its Welcome and its attach: the plane's ``answer`` that
    the Welcome carries to the actor (opaque bytes the plane encodes) and what its attach needs."""

    plane: type[Plane]
    reason: str
    answer: bytes = b""
    congestion: str = "auto"  # ``Config.tcp_congestion`` for a data connection's socket

    def attach(self, session: SessionSide, conn: ControlConnection | None,
               msg: _wire.Attach | None) -> tuple[FrameReceiver, _wire.Ready]:  # fmt: skip
        """Receive ``session``'s frames: on ``conn``, the data connection its Attach ``msg``
        came on, for a plane with a ``data_connection``; else (``None``, ``None``) at once.
        Returns the started receiver and the Ready to send the actor."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the session held (it ended before it attached)."""


class Plane:
    """One data plane. Class attributes and class methods describe it and attach an actor;
    an instance is the plane in one learner."""

    name: ClassVar[str]
    preference: ClassVar[int]  # auto asks the planes in this order (lowest first)
    # The actor opens a data connection and proves it with an Attach; the learner proves it
    # attached it (AttachProof) before its Ready. Else the plane is attached at the Welcome.
    data_connection: ClassVar[bool] = True
    # The receiver takes each field into one contiguous buffer: a frame that wraps in the
    # ring lands in a scratch buffer and is scattered on commit.
    whole_fields: ClassVar[bool] = False
    # Every actor can use it, whether or not its Hello offers it (the fallback plane).
    every_actor: ClassVar[bool] = False

    # --- what this process offers, and the choice -------------------------------------------
    @classmethod
    def available(cls) -> bool:
        """Whether this process can offer the plane."""
        return True

    @classmethod
    def offer(cls) -> bytes | None:
        """What an actor in this process offers of the plane in its Hello (opaque bytes the
        plane's learner side reads); None: the actor cannot use it."""
        return b"" if cls.available() else None

    @classmethod
    def offered(cls, wanted: str) -> bool:
        """Whether a learner whose ``transport`` is ``wanted`` offers the plane to actors."""
        return cls.available()

    @classmethod
    def unusable(cls) -> str | None:
        """Why a learner asked for this plane by name could not serve any actor (None: it can)."""
        return None

    @classmethod
    def refusal(cls, s: Situation) -> str | None:
        """Why the plane cannot serve an actor when one side asked for it by name (None: it can)."""
        return None

    @classmethod
    def auto(cls, s: Situation) -> tuple[bool, str]:
        """Whether ``auto`` picks this plane, and why (or why not: the reason a fallback gives)."""
        return False, ""

    @classmethod
    def explain(cls, picked: str, reason: str) -> str:
        """The reason a learner gives for ``picked`` ("": refused), corrected with what this
        plane knows that the choice did not (why it is off in this process)."""
        return reason

    # --- the actor's side ----------------------------------------------------------------------
    @classmethod
    async def connect(cls, side: ActorSide) -> Attached:
        """Attach the actor to the session its Welcome opened on this plane."""
        raise NotImplementedError

    # --- the learner's side --------------------------------------------------------------------
    def __init__(self, context: LearnerContext):
        self.context = context
        self.is_offered = self.offered(context.wanted)

    async def start(self) -> None:
        """The learner asked for this plane by name: start what it needs now (raises
        ``ConfigError`` where it cannot), not at the first actor."""

    async def prepare(self) -> None:
        """Before a session opens on the plane (the plane may start here; raising, it stops
        being offered and the actor is chosen another)."""

    def open(self, reason: str) -> Opening:
        """A new session on the plane, chosen for ``reason``. May raise :class:`Rejected`
        (asked for by name, impossible here), or return an opening on another plane."""
        raise NotImplementedError

    async def close(self) -> None:
        """The learner is closing."""

    def counters(self) -> dict[str, int]:
        """The plane's counters for ``learner.stats()``."""
        return {}


_REGISTRY: dict[str, type[Plane]] = {}
# Modules (comma-separated) imported at the first look at the registry, each registering its
# planes: how a plane defined outside rlink reaches every process of a job, spawned ones too.
PLUGINS_ENV = "RLINK_PLANES"
_plugins_loaded = False


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # first: a plugin that looks at the registry must not load itself again
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(f"{PLUGINS_ENV} names {module!r}, which does not import: {exc}") from exc


def register(plane: type[Plane]) -> type[Plane]:
    """Make ``plane`` known by its ``name``: choosable, attachable, listed in ``TRANSPORTS``."""
    if plane.name == AUTO or plane.name in _REGISTRY:
        raise ValueError(f"a data plane named {plane.name!r} is already registered")
    _REGISTRY[plane.name] = plane
    return plane


def plane_names() -> tuple[str, ...]:
    """Every registered plane's name, in the order they were registered."""
    _load_plugins()
    return tuple(_REGISTRY)


def actor_offers() -> dict[str, bytes]:
    """The Hello's offers of an actor in this process: every plane it can use, by name."""
    return {p.name: offer for p in registered() if (offer := p.offer()) is not None}


def registered() -> list[type[Plane]]:
    """Every registered plane, in auto's order of preference."""
    _load_plugins()
    return sorted(_REGISTRY.values(), key=lambda p: p.preference)


def find_plane(name: str) -> type[Plane] | None:
    _load_plugins()
    return _REGISTRY.get(name)


def get_plane(name: str) -> type[Plane]:
    """The plane named ``name``; ``ConfigError`` for a name no plane has."""
    _load_plugins()
    plane = _REGISTRY.get(name)
    if plane is None:
        raise ConfigError(f"transport must be one of {(AUTO, *plane_names())}, got {name!r}")
    return plane


def require(wanted: str) -> None:
    """Raise ``ConfigError`` where a learner asked for ``wanted`` by name could serve no actor."""
    if wanted == AUTO:
        return
    why = get_plane(wanted).unusable()
    if why is not None:
        raise ConfigError(why)


def choose_plane(learner_wants: str, actor_wants: str, s: Situation) -> tuple[str, str]:
    """Pick a data plane for one actor: ``(name, reason)``, or ``("", why_not)``."""
    wants = {learner_wants, actor_wants} - {AUTO}
    if len(wants) > 1:
        return "", f"learner requires {learner_wants!r} but actor requires {actor_wants!r}"
    requested = [p for p in map(find_plane, wants) if p is not None]
    if requested:
        why_not = requested[0].refusal(s)
        return ("", why_not) if why_not else (requested[0].name, "requested")
    if wants:  # a name no plane has: auto's choice across hosts
        s = Situation(s.learner, s.actor, same_host=False)
    declined = ""
    for plane in registered():
        picked, reason = plane.auto(s)
        if picked:
            return plane.name, reason or declined or AUTO
        declined = declined or reason
    return "", declined or "no data plane is offered by both sides"


def situation(learner_offers: dict[str, bool], hello: _wire.Hello, same_host: bool) -> Situation:
    """The choice's inputs from the learner's offers and the actor's Hello."""
    actor = frozenset(p.name for p in registered() if p.every_actor or p.name in hello.offers)
    learner = frozenset(name for name, offered in learner_offers.items() if offered)
    return Situation(learner, actor, same_host)


def attach_proven(transport: str) -> bool:
    """Whether an actor waits for the learner's AttachProof before using ``transport``: the
    planes whose data connection the learner attaches."""
    plane = find_plane(transport)
    return plane is not None and plane.data_connection


class LearnerPlanes:
    """Every registered plane in one learner: offers, choice, start and close."""

    def __init__(self, context: LearnerContext):
        self.context = context
        self._planes = {p.name: p(context) for p in registered()}

    def __getitem__(self, name: str) -> Plane:
        return self._planes[name]

    def __iter__(self) -> Iterator[Plane]:
        return iter(self._planes.values())

    def offers(self) -> dict[str, bool]:
        return {name: plane.is_offered for name, plane in self._planes.items()}

    async def start(self) -> None:
        """Start the plane the learner asked for by name, if any (``ConfigError`` if it cannot)."""
        if self.context.wanted in self._planes:
            await self._planes[self.context.wanted].start()

    def choose(self, hello: _wire.Hello, same_host: bool) -> tuple[Plane | None, str]:
        """The plane for the actor whose Hello this is, and why; (None, why not)."""
        name, reason = choose_plane(self.context.wanted, hello.transport, situation(self.offers(), hello, same_host))
        for plane in self._planes.values():
            reason = plane.explain(name, reason)
        return self._planes.get(name), reason

    async def close(self) -> None:
        for plane in self._planes.values():
            await plane.close()

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for plane in self._planes.values():
            out.update(plane.counters())
        return out
