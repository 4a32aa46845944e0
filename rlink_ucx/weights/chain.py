"""The chain of hosts each version travels along: the learner sends it once.

Of the hosts off the learner's that share copies (``hosts.py``), each has one streamer. When
there are two or more and the model is at least :data:`RELAY_MIN_BYTES`, the learner links
their streamers into a chain, in session order: the first takes each version on its weights
stream, each other one from the streamer before it (``relay.py``), which passes every piece on
as soon as it has it. So the last host holds a version about ``B / link + hops x piece / link``
after the learner began sending it, and the learner's link carries it once (docs/weights.md,
"Topology and its cost").

Linking one pair: the learner asks the upstream to relay (``RelayServe(link)``, a fresh nonce);
it answers with its port (``RelayAt``); the learner gives the downstream the address and the
link's key wrapped under the downstream's subscription key (``RelayFrom``); the downstream
proves it to the upstream and says so (``Relayed``). Until then, and whenever a link fails,
the downstream takes versions by stream from the learner.

A streamer that has confirmed nothing for :func:`~.relay.stall_timeout` while behind the
version it was sent (stopped, or cut off) leaves the chain at the next version and the chain closes around it; it
comes back once it caught up. A relay whose copy a reader refused gets a strike, as a host
copy does (``hosts.strike``), unless it refused that version itself: a relay passes each piece
on before it can check it, so every host behind an altering one refuses the version, and only
the first of them names the culprit. The verdict waits :data:`BLAME_DELAY` for the refusals of
one version to come in. Everything here runs under the publisher's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..transport.session_state import SessionState
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .hosts import strike
from .membership import stalled
from .relay import stall_timeout

__all__ = ["RELAY_MIN_BYTES", "Chain"]

RELAY_MIN_BYTES = 1 << 20  # below it the chain's hops cost more than the copies it saves
BLAME_DELAY = 0.5  # seconds a refusal waits for the refusals of the hosts before it
RETRY_SECONDS = (1.0, 60.0)  # a pair whose link failed is tried again after 1, 2, 4 ... 60 s

Send = Callable[..., None]  # send(sessions, *messages) on their control connections


@dataclass
class _Asked:
    """A link asked of an upstream, until it answers where."""

    upstream: int
    downstream: int
    at: float


class Chain:
    def __init__(self, config: Config):
        self.config = config
        self.order: list[int] = []  # session ids, the head first
        self._asked: dict[bytes, _Asked] = {}  # link nonce -> the pair it links
        self._blames: list[tuple[int, int, float]] = []  # (relay, version refused from it, when)

    def relink(self, sessions: dict[int, Any], model_bytes: int, send: Send) -> list[Any]:
        """Before a version goes out (and as streamers confirm one): link each streamer to the
        one before it in the chain, and unlink those that left it. Returns the hosts' new
        streamers where a relay was struck out (they take over, ``hosts.take_over``)."""
        now = time.monotonic()
        successors = self._judge(sessions, now)
        chain = self._plan(sessions.values(), model_bytes, now)
        self.order = [s.id for s in chain]
        want = {s.id: (chain[i - 1].id if i else None) for i, s in enumerate(chain)}
        for old in [k for k, a in self._asked.items() if now - a.at > self.config.weights_timeout]:
            del self._asked[old]  # never answered: its upstream was stopped or gone
        for s in sessions.values():
            member = s.weights
            desired = want.get(s.id)
            if s.state is not SessionState.OPEN or member.relay_want == desired or now < member.relay_retry_at:
                continue
            member.relay_want, member.relay_from = desired, None  # by stream until linked
            if desired is None:
                send([s], _wire.RelayFrom(0, "", 0, b"", b""))
                continue
            link = _auth.new_nonce()
            self._asked[link] = _Asked(desired, s.id, now)
            send([sessions[desired]], _wire.RelayServe(link))
        return successors

    def _judge(self, sessions: dict[int, Any], now: float) -> list[Any]:
        """Strike each relay whose copy a reader refused, unless it refused that version too."""
        successors, waiting = [], []
        for relay, version, at in self._blames:
            holder = sessions.get(relay)
            if now - at < BLAME_DELAY:
                waiting.append((relay, version, at))
            elif holder is not None and holder.weights.relay_refused < version:
                successor = strike(sessions, holder, version, relay=True)
                if successor is not None:
                    successors.append(successor)
        self._blames = waiting
        return successors

    def _plan(self, sessions: Iterable[Any], model_bytes: int, now: float) -> list[Any]:
        """The streamers that relay, in chain order (empty: no chain is worth it)."""
        if self.config.weights_fanout == "broadcast":
            return []  # hosts outside the broadcast group take versions by stream (broadcast.py)
        stall = stall_timeout(self.config)
        chain = []
        for s in sorted(sessions, key=lambda s: s.id):
            member = s.weights
            if not (s.state is SessionState.OPEN and member.subscribed and member.streamer and member.relay
                    and not member.suspect):  # fmt: skip
                continue
            if not stalled(member, now, stall):
                chain.append(s)
        return chain if model_bytes >= RELAY_MIN_BYTES and len(chain) >= 2 else []

    def on_relay_at(self, sessions: dict[int, Any], upstream: Any, msg: _wire.RelayAt, send: Send) -> None:
        """The upstream listens for the link: tell its downstream where, with the link's key."""
        asked = self._asked.pop(msg.link, None)
        if asked is None or asked.upstream != upstream.id:
            return  # not a link we asked of it (or one that expired)
        down = sessions.get(asked.downstream)
        if down is None or down.state is not SessionState.OPEN or down.weights.relay_want != upstream.id:
            return
        if not 0 < msg.port < 65536 or down.weights.key is None:
            self._failed(down)  # it cannot listen: the downstream stays on its stream a while
            return
        key = _keys.relay_key(upstream.key, msg.link)
        wrapped = _keys.wrap_relay_key(down.weights.key, msg.link, key)
        host = upstream.control.sock.getpeername()[0]  # where the upstream reaches us from
        send([down], _wire.RelayFrom(upstream.id, host, msg.port, msg.link, wrapped))

    def on_relayed(self, session: Any, msg: _wire.Relayed) -> None:
        """The downstream linked to its relay (or failed to, or lost it, or refused its copy)."""
        member = session.weights
        if msg.refused > 0 and member.relay_read == msg.session:  # a copy we had it take from there
            member.relay_refused = max(member.relay_refused, msg.refused)
            member.relay_read = None
            self._blames.append((msg.session, msg.refused, time.monotonic()))
        if msg.ok and member.relay_want == msg.session:
            member.relay_from, member.relay_failures = msg.session, 0
        elif not msg.ok and member.relay_want == msg.session:
            self._failed(session)

    def _failed(self, session: Any) -> None:
        member = session.weights
        member.relay_want = member.relay_from = None
        member.relay_failures += 1
        low, high = RETRY_SECONDS
        member.relay_retry_at = time.monotonic() + min(high, low * 2 ** (member.relay_failures - 1))

    @staticmethod
    def served(sessions: dict[int, Any], reader: Any, version: int) -> None:
        """``reader`` confirmed ``version``: if it took it from a relay, that relay's strikes
        start over."""
        member = reader.weights
        relay = sessions.get(member.relay_read) if member.relay_read is not None else None
        if relay is not None and version >= member.sent:
            relay.weights.relay_strikes = ()
            member.relay_read = None

    def lost_stream(self, session: Any) -> None:
        """``session`` opened a weights stream of its own while linked: its relay failed it."""
        if session.weights.relay_from is not None:
            self._failed(session)

    def report(self, sessions: dict[int, Any]) -> dict[str, Any]:
        """The chain as ``stats()["weights"]["relay"]`` shows it: hosts in order, and who each
        actually takes versions from."""
        hosts = [sessions[i].weights.host for i in self.order if i in sessions]
        links = {}
        for i in self.order:
            s = sessions.get(i)
            if s is not None:
                up = sessions.get(s.weights.relay_from) if s.weights.relay_from is not None else None
                links[s.weights.host] = up.weights.host if up is not None else "learner"
        return {"order": hosts, "from": links}
