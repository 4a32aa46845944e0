"""One copy per host: the actors of a host other than the learner's share each version.

Of the actors of one host (the same host name in their Hello) that can read sealed memfds
(``Subscribe.shared``), one, the host's *streamer*, takes each version on its weights stream;
it holds the version in a sealed memfd of its own and says where in its ``Got``. The learner
then tells the host's other actors (``Mapped``, ``route.Route.FROM_PEER``) to read it from
there, with the version's key and Seal as for its own host: the bytes are trusted only once the
learner's tags match, so a streamer that alters a byte makes its peers refuse that copy and take
the version on a stream. The learner so sends each version once per host, not once per actor.

When the streamer's session ends, the open peer with the lowest session id takes its place
(:func:`elect`): it opens a weights stream for the newest version, or, holding it already,
serves it to the peers that wait for it. So it does when a peer refused the streamer's copy of
:data:`STRIKES` versions in a row (:func:`note_refusal`). Everything here runs under the
publisher's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..transport.session_state import SessionState
from ..wire import messages as _wire
from .route import Route, delivery
from .shared import location

__all__ = ["STRIKES", "elect", "hosts_report", "location_of", "note_refusal", "note_served", "peers_of", "serve_peers",
           "strike", "take_over"]


STRIKES = 2  # versions in a row whose copy a peer refused, before its holder serves no more


def _sharing(sessions: Iterable[Any], host: str) -> list[Any]:
    """The open, subscribed sessions of ``host`` that share copies, by session id."""
    return sorted((s for s in sessions if s.state is SessionState.OPEN and s.weights.subscribed and s.weights.peers
                   and not s.weights.suspect and s.weights.host == host), key=lambda s: s.id)  # fmt: skip


def note_refusal(sessions: dict[int, Any], reader: Any, have: int) -> Any | None:
    """``reader`` opened a weights stream asking for versions above ``have``: if it was told to
    read a newer version from a peer's copy, that copy failed it (refused, or gone). Its
    holder's strike for that version is noted; at :data:`STRIKES` versions in a row the holder
    serves no more copies (an actor that alters what it holds costs its peers a detour for at
    most that many versions) and its host gets another streamer, returned (None: unchanged)."""
    member = reader.weights
    holder = sessions.get(member.mapped_from) if member.mapped_from is not None else None
    version = member.sent
    member.mapped_from = None
    if holder is None or have >= version:
        return None
    return strike(sessions, holder, version)


def strike(sessions: dict[int, Any], holder: Any, version: int, relay: bool = False) -> Any | None:
    """A copy of ``version`` that ``holder`` served (``relay``: passed on to another host) was
    refused: at :data:`STRIKES` versions in a row of one kind it serves no more and takes
    versions by stream; its host's new streamer is returned (None: unchanged). The kinds count
    apart: its host's peers reading good copies must not clear what it passes on altered."""
    if holder.state is not SessionState.OPEN:
        return None
    member = holder.weights
    strikes = member.relay_strikes if relay else member.strikes
    if version not in strikes:
        strikes = (*strikes, version)[-STRIKES:]
        if relay:
            member.relay_strikes = strikes
        else:
            member.strikes = strikes
    if len(strikes) < STRIKES:
        return None
    holder.weights.suspect, holder.weights.streamer = True, False
    return elect(sessions.values(), holder.weights.host)


def note_served(sessions: dict[int, Any], reader: Any, version: int) -> None:
    """``reader`` confirmed ``version`` it was told to read from a peer's copy: that holder's
    strikes start over."""
    member = reader.weights
    holder = sessions.get(member.mapped_from) if member.mapped_from is not None else None
    if holder is not None and version >= member.sent:
        holder.weights.strikes = ()
        member.mapped_from = None


def elect(sessions: Iterable[Any], host: str) -> Any | None:
    """Make sure ``host`` has one streamer among its sharing sessions: the current one while
    its session is open, else the one with the lowest id. Returns a newly elected streamer
    (None: unchanged, or the host has no sharing session left)."""
    members = _sharing(sessions, host)
    current = [s for s in members if s.weights.streamer]
    if current:
        for extra in current[1:]:  # never two (a stale flag after a race): keep the first
            extra.weights.streamer = False
        return None
    if not members:
        return None
    members[0].weights.streamer = True
    return members[0]


def peers_of(sessions: Iterable[Any], holder: Any, version: int) -> list[Any]:
    """The sessions of ``holder``'s host that read copies from their peers and have not been
    sent ``version`` yet (``holder`` just confirmed it)."""
    return [s for s in _sharing(sessions, holder.weights.host)
            if s is not holder and s.weights.sent < version and delivery(s.weights, None) is Route.FROM_PEER]  # fmt: skip


def serve_peers(sessions: dict[int, Any], holder: Any, snap: Any, where: list[Any],
                tell: Callable[[Any, Any, list[Any]], None]) -> None:  # fmt: skip
    """Tell ``holder``'s host's peers still without ``snap`` to read it from ``where``
    (``tell(peer, snap, where)`` sends Mapped, the key and the Seal)."""
    for peer in peers_of(sessions.values(), holder, snap.version):
        peer.weights.sent, peer.weights.mapped_from = snap.version, holder.id
        tell(peer, snap, where)


def take_over(sessions: dict[int, Any], successor: Any | None, latest: Any | None,
              tell: Callable[[Any, Any, list[Any]], None], send: Callable[..., None]) -> None:  # fmt: skip
    """A host's new streamer serves the newest version ``latest`` to its peers if it holds
    it, else is told of it (``send([successor], Version)``) and opens a weights stream for it."""
    if successor is None or latest is None:
        return
    held = successor.weights.held
    if held is not None and held[0] == latest.version:
        serve_peers(sessions, successor, latest, held[1], tell)
    else:
        send([successor], _wire.Version(latest.version))


def location_of(where: Any, nbytes: int) -> list[Any] | None:
    """An actor's ``Got.where`` if it has the shape of a memfd location of ``nbytes`` bytes
    ([pid, fd, nonce, bytes]); None otherwise. The reading actor checks it in full
    (``shared.read_into``, with the same :func:`~.shared.location`); this only keeps junk
    from being passed on."""
    checked = location(where)
    return where if checked is not None and checked[3] == nbytes else None


def hosts_report(sessions: Iterable[Any], newest: int) -> dict[str, dict[str, Any]]:
    """Per host off the learner's that shares copies: its actors, its streamer and the holders
    refused (actor ids), and its lag: how many versions its furthest-behind actor is behind
    ``newest``."""
    out: dict[str, dict[str, Any]] = {}
    for s in sorted((s for s in sessions if s.state is SessionState.OPEN and s.weights.peers), key=lambda s: s.id):
        row = out.setdefault(s.weights.host, {"actors": [], "streamer": None, "refused": [], "lag": 0})
        row["actors"].append(s.actor_id)
        row["lag"] = max(row["lag"], newest - s.weights.acked)
        if s.weights.streamer:
            row["streamer"] = s.actor_id
        if s.weights.suspect:  # its copies were refused: it takes versions by stream, serves none
            row["refused"].append(s.actor_id)
    return out
