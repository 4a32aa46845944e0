"""Mutual HMAC-SHA256 challenge-response over fresh nonces, keyed by the shared token.

The learner proves the token as well as the actor, with distinct labels for each direction so
a challenge reflected back at its sender is useless, and fresh nonces on both sides so a
recorded handshake cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..errors import AuthError

NONCE_BYTES = 32
_ACTOR_LABEL = b"rlink-v1 actor"
_LEARNER_LABEL = b"rlink-v1 learner"
_DATA_LABEL = b"rlink-v1 data"
_RANK_LABEL = b"rlink-v1 rank"
_RANK_0_LABEL = b"rlink-v1 rank 0"
_RANK_ACTOR_TOKEN_LABEL = b"rlink-v1 rank's actor token"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def actor_proof(token: bytes, learner_nonce: bytes, actor_nonce: bytes) -> bytes:
    return _mac(token, _ACTOR_LABEL, learner_nonce, actor_nonce)


def learner_proof(token: bytes, learner_nonce: bytes, actor_nonce: bytes) -> bytes:
    return _mac(token, _LEARNER_LABEL, actor_nonce, learner_nonce)


def rank_proof(rank_token: bytes, learner_nonce: bytes, rank_nonce: bytes) -> bytes:
    """A learner rank's proof of the job's rank token (a Login's mac on a rank link)."""
    return _mac(rank_token, _RANK_LABEL, learner_nonce, rank_nonce)


def rank_0_proof(rank_token: bytes, learner_nonce: bytes, rank_nonce: bytes) -> bytes:
    """Rank 0's proof of the rank token to a rank linking to it."""
    return _mac(rank_token, _RANK_0_LABEL, rank_nonce, learner_nonce)


def rank_actor_token_proof(token: bytes | None, learner_nonce: bytes, rank_nonce: bytes) -> bytes:
    """A rank's proof that it holds the same actors' token as rank 0 (``b""``: none, insecure)."""
    return b"" if token is None else _mac(token, _RANK_ACTOR_TOKEN_LABEL, learner_nonce, rank_nonce)


def data_proof(session_key: bytes, learner_nonce: bytes, session: int) -> bytes:
    """Proves a data connection belongs to ``session``: keyed with the session's key (from the
    token and the ticket, ``wire.keys.session_key``), never with the ticket alone, which the
    Welcome carries in clear."""
    return _mac(session_key, _DATA_LABEL, learner_nonce, str(session).encode())


def verify(expected: bytes, got: bytes, what: str) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError(f"{what}: token proof did not match (wrong token?)")
