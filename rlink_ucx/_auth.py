"""Mutual HMAC-SHA256 challenge-response over fresh nonces, keyed by the shared token.

The learner proves the token as well as the actor, with distinct labels for each direction so
a challenge reflected back at its sender is useless, and fresh nonces on both sides so a
recorded handshake cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat

from ._errors import AuthError, ConfigError

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


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The token as bytes: the argument, else ``RLINK_TOKEN``, else the file in ``RLINK_TOKEN_FILE``.

    A token file must not be readable by group or others (mode 0600), like an ssh key.
    """
    if token is None:
        token = os.environ.get("RLINK_TOKEN") or None
    if token is None and os.environ.get("RLINK_TOKEN_FILE"):
        path = os.environ["RLINK_TOKEN_FILE"]
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"token file {path} is accessible by group/others; chmod 600 it")
        with open(path, "rb") as fh:
            token = fh.read().strip()
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        raise ConfigError("an empty token is not a token")
    return raw


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
