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
_PULL_LABEL = b"rlink-v1 pull"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def actor_proof(token: bytes, learner_nonce: bytes, actor_nonce: bytes) -> bytes:
    return _mac(token, _ACTOR_LABEL, learner_nonce, actor_nonce)


def learner_proof(token: bytes, learner_nonce: bytes, actor_nonce: bytes) -> bytes:
    return _mac(token, _LEARNER_LABEL, actor_nonce, learner_nonce)


def data_proof(ticket: bytes, learner_nonce: bytes, session: int) -> bytes:
    return _mac(ticket, _DATA_LABEL, learner_nonce, str(session).encode())


def pull_proof(ticket: bytes, learner_nonce: bytes, session: int) -> bytes:
    """Proves a weights pull connection belongs to ``session`` (its own label: a data-connection
    proof cannot be replayed as a pull, nor the other way round)."""
    return _mac(ticket, _PULL_LABEL, learner_nonce, str(session).encode())


def verify(expected: bytes, got: bytes, what: str) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError(f"{what}: token proof did not match (wrong token?)")
