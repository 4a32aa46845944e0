"""One actor session's place in the weights fan-out, and the learner's side as the publisher
sees it (``Member``, ``Owner``).

The publisher owns it: it writes every field under its condition lock (the I/O loop on a
Subscribe or a Got, the fan-out thread, and each weights stream's thread all do), so a
version counter is never read-modify-written by two threads at once. Others only read it
(``stats()`` rows, on the I/O loop).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import Config
from ..transport.control import ControlConnection
from ..transport.session_state import SessionState
from ..wire import messages as _wire


@dataclass
class Membership:
    """What the publisher knows of one actor session."""

    subscribed: bool = False  # wants every published version
    shared: bool = False  # on the learner's host: reads versions from its shared memory
    host: str = ""  # its host's name (Hello): actors of one host share one copy of a version
    # Off the learner's host: it can read its host's other actors' copies (sealed memfds), and
    # whether it is the one actor of its host that takes versions by weights stream.
    peers: bool = False
    streamer: bool = False
    held: tuple[int, list[Any]] | None = None  # the newest version it holds in a memfd, and where
    mapped_from: int | None = None  # the session whose copy it was last told to read
    # Versions of its copy that a peer refused, in a row (``hosts.note_refusal``); at
    # ``hosts.STRIKES`` it no longer serves copies (``suspect``) and takes versions by stream.
    strikes: tuple[int, ...] = ()
    suspect: bool = False
    # Relays between hosts (``chain.py``): whether its actor relays when asked (Subscribe), the
    # streamer it should take versions from and the one it does take them from (None: the
    # learner), its failed links in a row and when to try the next, since when it is behind the
    # version it was sent, confirming nothing (out of the chain past ``relay.stall_timeout``), the relay
    # it was told to take the last version from, the newest version it refused from its relay (a
    # relay passing on what it refused is no culprit), and the versions in a row whose copy it
    # passed on was refused (``hosts.strike``).
    relay: bool = False
    relay_want: int | None = None
    relay_from: int | None = None
    relay_failures: int = 0
    relay_retry_at: float = 0.0
    behind: tuple[float, int] | None = None  # since when it is behind, and what it had confirmed then
    relay_read: int | None = None
    relay_refused: int = 0
    relay_strikes: tuple[int, ...] = ()
    # Broadcast on a trusted network (``broadcast.py``): whether its actor joins the learner's
    # group when asked (Subscribe), its rank in the group the learner holds now (0: none), and
    # when it may be asked again after failing to join or to take a version; the first version
    # the group brings it (older ones still come by stream, if it lacks them).
    cast: bool = False
    cast_rank: int = 0
    cast_first: int = 0
    cast_retry: tuple[int, float] = (0, 0.0)  # failures in a row, and when it may be asked again
    # Its subscription's key (``wire.keys.subscription_key``), set with ``shared``; never printed.
    key: bytes | None = field(default=None, repr=False)
    sent: int = 0  # newest version announced or sent to it
    acked: int = 0  # newest version it confirmed complete and verified


def stalled(member: Membership, now: float, stall: float) -> bool:
    """Whether ``member`` is behind the version it was sent and has confirmed nothing for
    ``stall`` seconds (a stopped or cut-off actor), as against merely behind the newest while
    still confirming one version after another (a learner publishing faster than it reads).
    Notes since when in ``member.behind``; the publisher's lock is held."""
    behind = member.behind
    if member.acked >= member.sent or (behind is not None and member.acked > behind[1]):
        member.behind = behind = None
    if member.acked < member.sent and behind is None:
        member.behind = behind = (now, member.acked)
    return behind is not None and now - behind[0] >= stall


class Member(Protocol):
    """One actor's session as the publisher sees it (a ``session.Member``)."""

    id: int
    state: SessionState
    hello: _wire.Hello
    ticket: bytes  # the session's ticket (sent in clear in the Welcome)
    key: bytes  # the session's key, from the token and the ticket (``wire.keys.session_key``)
    control: ControlConnection
    weights: Membership  # written by the publisher only, under its lock


class Owner(Protocol):
    """The learner side the publisher serves (a ``session.LearnerServer``)."""

    config: Config
    loop: asyncio.AbstractEventLoop
    host: str
    token: bytes | None  # the shared token: every weights key derives from it
    version: int  # the newest published version: the publisher advances it

    @property
    def sessions(self) -> dict[int, Any]:  # session id -> Member
        ...
