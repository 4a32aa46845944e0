"""The control messages: msgspec structs encoded as msgpack behind a 4-byte little-endian
length prefix (never pickle). Data frames have their own binary header (``frame.py``)."""

from __future__ import annotations

import struct
from typing import Annotated, Any, TypeAlias

import msgspec

from ..errors import ProtocolError
from .manifest import Manifest

# Sent in the handshake and in every frame header; each side refuses a peer of another version.
# Bump it with any change to a message or the frame header (docs/architecture.md lists them).
PROTOCOL_VERSION = 14


class _Msg(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


# A plane's offer, answer or attach detail: bytes only that plane encodes and decodes (never
# pickle), so the protocol names no plane. Capped here; the plane validates what it reads.
PLANE_BLOB_BYTES = 64 * 1024
PlaneBlob = Annotated[bytes, msgspec.Meta(max_length=PLANE_BLOB_BYTES)]
PlaneName = Annotated[str, msgspec.Meta(max_length=64)]
PlaneOffers = Annotated[dict[PlaneName, PlaneBlob], msgspec.Meta(max_length=32)]


# --- handshake (bounded, pre-authentication) -----------------------------------------------
class Challenge(_Msg, frozen=True):
    """Learner -> any new connection: protocol version, fresh nonce, whether a token is needed."""

    proto: int
    nonce: bytes
    auth: bool


class Login(_Msg, frozen=True):
    """Actor -> learner on a control connection: its nonce and proof of the token."""

    proto: int
    nonce: bytes
    mac: bytes


class Proof(_Msg, frozen=True):
    """Learner -> actor: the learner's proof of the token (mutual authentication)."""

    mac: bytes


class Attach(_Msg, frozen=True):
    """Actor -> learner on a data connection: the session it belongs to, proven by its ticket."""

    proto: int
    session: int
    mac: bytes
    detail: PlaneBlob = b""  # the chosen plane's own attach detail, encoded and checked by that plane


# --- session ----------------------------------------------------------------------------------
# Actor ids and incarnations are u64 in frame headers but int64 in batches (Batch.actor_id).
ActorId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class Hello(_Msg, frozen=True):
    actor_id: ActorId | None
    incarnation: ActorId
    library: str
    transport: str  # what the actor asks for: auto or a plane's name
    cuda: bool
    host: str
    pid: int
    offers: PlaneOffers = {}  # plane name -> that plane's offer (the planes this actor can use)


class Welcome(_Msg, frozen=True):
    session: int
    actor_id: int
    version: int  # the learner's current model version
    transport: str  # the data plane chosen for this actor
    reason: str  # why that plane was chosen
    ticket: bytes  # secret that proves a data connection belongs to this session
    max_frame_bytes: int
    heartbeat_interval: float
    heartbeat_timeout: float
    resume_seq: int  # this (actor, incarnation) already delivered every seq below this; -1: unknown
    answer: PlaneBlob = b""  # the chosen plane's answer to the actor (that plane encodes it)


class Redirect(_Msg, frozen=True):
    """Learner rank 0 -> actor, answering its Hello: stream to rank ``rank`` of the job at
    ``host:port``, as actor ``actor_id`` (this connection ends here)."""

    rank: int
    host: str
    port: int
    actor_id: ActorId


class RankHello(_Msg, frozen=True):
    """Learner rank ``rank`` of ``world`` -> rank 0, after a Login that proved the job's rank
    token: actors may be sent to ``host:port``; this connection stays up while the rank lives.
    ``token_proof``: that the rank holds rank 0's actors' token (``auth.rank_actor_token_proof``)."""

    rank: int
    world: int
    host: str
    port: int
    token_proof: bytes = b""


class RankWelcome(_Msg, frozen=True):
    """Rank 0 -> a rank: registered, once every rank of the job has linked; rank 0 sends actors
    to it from now on."""

    world: int


class RankActors(_Msg, frozen=True):
    """A rank -> rank 0: the actor ids it serves now (sent when the set changes)."""

    actors: list[ActorId]


class Propose(_Msg, frozen=True):
    fields: list[Any]  # [[name, dtype, [dims...]], ...], validated by Schema.from_wire


class Accept(_Msg, frozen=True):
    schema_id: int
    max_steps: int  # the most steps one frame may carry (the learner's ring reserve)
    # The learner's schema where it differs from the proposal by dtypes the actor casts
    # (wire.codec.castable); the actor then puts as it. None: the proposal as it was.
    fields: list[Any] | None = None


class Reject(_Msg, frozen=True):
    reason: str


class Ready(_Msg, frozen=True):
    """The data plane of this session is attached and authenticated."""

    transport: str
    answer: PlaneBlob = b""  # what the plane's learner side tells its actor side at the attach


class Credit(_Msg, frozen=True):
    steps: int
    acked: int  # piggybacked Ack.next_seq


class Revoke(_Msg, frozen=True):
    """Learner -> actor: give back up to ``steps`` of unused credit (you are idle, others wait)."""

    steps: int


class Returned(_Msg, frozen=True):
    """Actor -> learner: ``steps`` of credit given back (no longer usable by the actor)."""

    steps: int


class Sync(_Msg, frozen=True):
    """Actor -> learner: acknowledge once every step before ``seq`` is buffered (flush)."""

    seq: int


class Ack(_Msg, frozen=True):
    next_seq: int  # every step with seq < next_seq is in the learner's buffer


# --- weights ----------------------------------------------------------------------------------
class Subscribe(_Msg, frozen=True):
    """Actor -> learner: keep me up to date with every published version. ``nonce`` makes this
    subscription's key fresh (``wire/keys.py``); ``shared``: the actor can read versions from
    the learner's sealed shared memory (the learner decides whether it shares its host);
    ``relay``: it passes versions on to another host's actor when the learner asks
    (``RelayServe``); ``broadcast``: it joins the learner's broadcast group when asked
    (``BroadcastJoin``, ``Config.weights_fanout="broadcast"``)."""

    nonce: bytes
    shared: bool = False
    relay: bool = False
    broadcast: bool = False


class Version(_Msg, frozen=True):
    """Learner -> actor: ``version`` is the newest published version (open a weights stream
    for it if none is open and it is not read from shared memory)."""

    version: int


class Publish(_Msg, frozen=True):
    """Learner -> actor on its weights stream: ``manifest``'s bytes follow raw on the same
    connection, between this version's WeightsKey and its Seal."""

    manifest: Manifest


class Got(_Msg, frozen=True):
    """Actor -> learner: ``version`` arrived complete and verified. ``where``: the actor holds
    it in a sealed memfd of its own, [pid, fd, nonce, bytes] (None: in private memory), from
    which the learner may have actors of the same host read it (``Mapped``)."""

    version: int
    where: list[Any] | None = None


class OpenStream(_Msg, frozen=True):
    """Actor -> learner on a new connection: make it my weights stream, starting with the
    newest version newer than ``have``. ``nonce`` is the actor's; ``mac`` proves the session's
    weights key over both nonces (the Challenge's and this one). The learner answers with its
    own Proof first."""

    proto: int
    session: int
    mac: bytes
    have: int
    nonce: bytes


class Heartbeat(_Msg, frozen=True):
    pass


class Bye(_Msg, frozen=True):
    reason: str


class Error(_Msg, frozen=True):
    kind: str
    text: str


# --- weights, keyed (wire/keys.py) -------------------------------------------------------------
class Mapped(_Msg, frozen=True):
    """Learner -> actor: ``manifest``'s bytes lie in a sealed memfd on the actor's host,
    ``where`` = [pid, fd, nonce, bytes]: the learner's (on its host), or another actor's there
    that holds the version (``Got.where``); read them from there. WeightsKey and Seal follow."""

    manifest: Manifest
    where: list[Any]

    @property
    def version(self) -> int:
        return self.manifest.version


class WeightsKey(_Msg, frozen=True):
    """Learner -> actor: the secret of weights ``version`` (its bucket tags are keyed with it),
    wrapped for this subscription or weights stream."""

    version: int
    wrapped: bytes


class Seal(_Msg, frozen=True):
    """Learner -> actor: one keyed tag per bucket of ``version``, and a MAC under this
    subscription's (or weights stream's) key over the version, its manifest, the wrapped key and
    the tags."""

    version: int
    tags: list[bytes]
    mac: bytes


# --- weights relays between hosts (weights/relay.py, weights/chain.py) ---------------------------
class RelayServe(_Msg, frozen=True):
    """Learner -> an actor that holds each version (its host's streamer): let the actor that
    proves the relay key of ``link`` (``wire.keys.relay_key`` of your session key) take every
    version you receive from you. Answered with RelayAt."""

    link: bytes


class RelayAt(_Msg, frozen=True):
    """Actor -> learner: my relay listener for ``link`` is on ``port`` (0: none could open),
    at the address my control connection comes from."""

    link: bytes
    port: int


class RelayFrom(_Msg, frozen=True):
    """Learner -> actor: take versions from ``session``'s actor at ``host``:``port``, proving
    the relay key of ``link``, sent ``wrapped`` under this subscription's key. ``port`` 0:
    take them from the learner again (a weights stream). The learner sends each version's
    WeightsKey and Seal on the control connection, so a relay cannot alter what it passes on."""

    session: int
    host: str
    port: int
    link: bytes
    wrapped: bytes


class Relayed(_Msg, frozen=True):
    """Actor -> learner: ``session``'s relay accepted my proof and proved its own (``ok``), or
    could not be reached or proven, stalled or broke (not ``ok``): I take versions by stream
    meanwhile. ``refused``: the version whose copy from it failed its tags or Seal (0: none)."""

    session: int
    ok: bool
    refused: int = 0


class RelayOpen(_Msg, frozen=True):
    """Actor -> a relay's listener, after its Challenge: make this connection my relay for
    ``link``; ``mac`` proves the link's relay key over both nonces. The relay answers with its
    own Proof, then sends each version newer than ``have`` as the learner does on a weights
    stream, without its WeightsKey and Seal."""

    proto: int
    link: bytes
    mac: bytes
    nonce: bytes
    have: int = 0


# --- weights by broadcast on a trusted network (weights/broadcast.py, weights/cast_member.py) -----
class BroadcastJoin(_Msg, frozen=True):
    """Learner -> a host's streamer: join broadcast group ``group`` as ``rank`` of ``world``
    (the learner is rank 0), over the torch.distributed store at ``host``:``port`` under
    ``prefix`` (random, per group), with ``backend`` ("gloo" or "nccl"). ``world`` 0: leave
    any group. Answered with BroadcastJoined."""

    group: int
    host: str
    port: int
    prefix: str
    rank: int
    world: int
    backend: str


class BroadcastJoined(_Msg, frozen=True):
    """Actor -> learner: I joined ``group`` (``ok``), or could not, or left it after a
    broadcast failed (not ``ok``): I take versions by stream meanwhile."""

    group: int
    ok: bool


class Broadcast(_Msg, frozen=True):
    """Learner -> a member of broadcast group ``group``: ``manifest``'s bytes follow by
    broadcast in the group, bucket by bucket; WeightsKey and Seal come on this connection."""

    group: int
    manifest: Manifest

    @property
    def version(self) -> int:
        return self.manifest.version


class AttachProof(_Msg, frozen=True):
    """Learner -> actor, right before Ready: proof (under the session's weights key, which
    takes the token) that the learner itself attached this session's data connection."""

    mac: bytes


# --- status (read-only, after Login) ---------------------------------------------------------
class StatsRequest(_Msg, frozen=True):
    """A client (``rlink stats``) -> learner, after Login: send your ``stats()``. The reply
    ends the connection."""


class StatsReply(_Msg, frozen=True):
    """Learner -> client: ``Learner.stats()`` as it is now (plain data)."""

    stats: dict[str, Any]


Message: TypeAlias = (
    Challenge | Login | Proof | Attach | Hello | Welcome | Propose | Accept | Reject | Ready | Credit | Sync | Ack |
    Heartbeat | Bye | Error | Subscribe | Version | Publish | Got | OpenStream | Revoke | Returned | WeightsKey |
    Seal | AttachProof | Mapped | Redirect | RankHello | RankWelcome | RankActors | StatsRequest | StatsReply | RelayServe | RelayAt | RelayFrom |
    Relayed | RelayOpen | BroadcastJoin | BroadcastJoined | Broadcast
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
LENGTH = struct.Struct("<I")


def encode(msg: _Msg) -> bytes:
    body = _encoder.encode(msg)
    return LENGTH.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from exc
    except RecursionError:  # lists nested ~1000 deep in a field typed ``list``
        raise ProtocolError("malformed control message: nested too deeply") from None


def check_length(length: int, limit: int) -> None:
    if length > limit:
        raise ProtocolError(f"control message of {length} bytes exceeds the {limit}-byte limit")


# --- blocking helpers (threads that own a socket outright, e.g. a weights stream) --------------
def recv_exact_into(sock: Any, view: memoryview) -> None:
    """Fill ``view`` from a blocking socket (its timeout bounds each wait)."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed mid-message")
        got += k


def read_message(sock: Any, max_bytes: int) -> Message:
    head = bytearray(LENGTH.size)
    recv_exact_into(sock, memoryview(head))
    (length,) = LENGTH.unpack(head)
    check_length(length, max_bytes)
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    return decode(body)
