"""Keys and proofs of the weights path, derived from the shared token (never sent).

A session's weights key comes from the token and the session's ticket; every key actually used
also takes a nonce the actor chose just then (its subscription, or the opening of one weights
stream), so nothing recorded from an earlier session or stream verifies again. Each model version
has a random key of its own (the bucket tags are keyed with it, ``weights/mac.py``); it reaches an
actor only wrapped under that actor's key, inside a :class:`~rlink_ucx.wire.messages.Seal` whose
MAC binds it to the version, the manifest and the tags. An eavesdropper, or whoever can inject
into a weights stream or write to the learner's shared memory, holds none of these keys.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec

from .manifest import Manifest

__all__ = ["KEY_BYTES", "attach_proof", "manifest_digest", "relay_key", "relay_proof", "seal_mac", "session_key",
           "stream_key", "stream_proof", "subscription_key", "wrap", "wrap_relay_key"]  # fmt: skip

KEY_BYTES = 32
_SESSION = b"rlink-v1 weights session"
_SUBSCRIPTION = b"rlink-v1 weights subscription"
_STREAM = b"rlink-v1 weights stream"
_STREAM_PROOF = {"actor": b"rlink-v1 weights stream actor", "learner": b"rlink-v1 weights stream learner"}
_ATTACH = b"rlink-v1 attach learner"
_RELAY = b"rlink-v1 weights relay"
_RELAY_PROOF = {"reader": b"rlink-v1 weights relay reader", "relay": b"rlink-v1 weights relay relay"}
_U64 = struct.Struct("<Q")


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    # Each part is length-prefixed: no two different part lists hash the same input.
    body = b"".join(_U64.pack(len(p)) + p for p in parts)
    return hmac.new(key, label + b"|" + body, hashlib.sha256).digest()


def session_key(token: bytes | None, ticket: bytes, session: int) -> bytes:
    """The weights key of one session. Without a token (``insecure``) it is derived from the
    ticket alone, which the Welcome carries in clear: weights are then not authenticated."""
    return _mac(token or b"", _SESSION, ticket, str(session).encode())


def subscription_key(key: bytes, nonce: bytes) -> bytes:
    """The key of one subscription (versions read from the learner's shared memory), fresh by
    the actor's ``nonce``."""
    return _mac(key, _SUBSCRIPTION, nonce)


def stream_key(key: bytes, learner_nonce: bytes, actor_nonce: bytes) -> bytes:
    """The key of one weights stream, fresh by both sides' nonces."""
    return _mac(key, _STREAM, learner_nonce, actor_nonce)


def stream_proof(key: bytes, side: str, learner_nonce: bytes, actor_nonce: bytes, session: int) -> bytes:
    """A weights stream's proof of the session key, by ``side`` ("actor" or "learner"): each
    side's label differs, so neither proof can be reflected back as the other's."""
    return _mac(key, _STREAM_PROOF[side], learner_nonce, actor_nonce, str(session).encode())


def relay_key(key: bytes, link: bytes) -> bytes:
    """The key of one relay link, from the relaying actor's session key and the learner's fresh
    ``link`` nonce: the relay derives it itself, the reader gets it from the learner wrapped
    (:func:`wrap_relay_key`)."""
    return _mac(key, _RELAY, link)


def relay_proof(key: bytes, side: str, relay_nonce: bytes, reader_nonce: bytes) -> bytes:
    """A relay connection's proof of its link key, by ``side`` ("reader" or "relay")."""
    return _mac(key, _RELAY_PROOF[side], relay_nonce, reader_nonce)


def wrap_relay_key(key: bytes, link: bytes, secret: bytes) -> bytes:
    """A relay link's key encrypted for the holder of ``key`` (a subscription key); the same
    call unwraps. The pad is a PRF of (key, link), and one link has one key."""
    return _pad_xor(key, link, b"rlink relay", secret)


def attach_proof(key: bytes, session: int, transport: str) -> bytes:
    """The learner's proof that it attached ``session``'s data connection as ``transport``."""
    return _mac(key, _ATTACH, str(session).encode(), transport.encode())


def wrap(key: bytes, version: int, secret: bytes) -> bytes:
    """``secret`` (a version's 32-byte key) encrypted for the holder of ``key``; the same call
    unwraps. The pad is a PRF of (key, version), and one version has one secret, so no pad
    ever hides two different secrets."""
    return _pad_xor(key, _U64.pack(version), b"rlink wrap", secret)


def _pad_xor(key: bytes, what: bytes, person: bytes, secret: bytes) -> bytes:
    if len(secret) != KEY_BYTES:
        raise ValueError(f"a wrapped key has {KEY_BYTES} bytes, not {len(secret)}")
    pad = hashlib.blake2b(what, key=key, digest_size=KEY_BYTES, person=person).digest()
    return bytes(a ^ b for a, b in zip(secret, pad))


def manifest_digest(manifest: Manifest) -> bytes:
    """A digest of the manifest as encoded on the wire (names, dtypes, shapes, offsets)."""
    return hashlib.blake2b(msgspec.msgpack.encode(manifest), digest_size=32).digest()


def seal_mac(key: bytes, version: int, manifest: Manifest, wrapped: bytes, tags: list[bytes]) -> bytes:
    """The MAC of a Seal: binds the version, its manifest, its wrapped key and every bucket tag."""
    return _mac(key, b"rlink-v1 seal", _U64.pack(version), manifest_digest(manifest), wrapped, *tags)
