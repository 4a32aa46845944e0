"""The rlink error tree: every error the library raises derives from :class:`RLinkError`.

Errors from sockets, ucxx or asyncio are translated where they enter the library
(``raise ... from exc``) so callers only ever need to catch these types.
"""

from __future__ import annotations

import builtins

__all__ = [
    "AuthError",
    "Backpressure",
    "Closed",
    "ConfigError",
    "ConnectError",
    "PeerLost",
    "ProtocolError",
    "RLinkError",
    "RLinkWarning",
    "SchemaMismatch",
    "TimeoutError",
]


class RLinkError(Exception):
    """Root of every error raised by rlink_ucx."""


class ConfigError(RLinkError, ValueError):
    """An option or argument is invalid (e.g. a non-loopback bind without a token)."""


class ConnectError(RLinkError, ConnectionError):
    """The peer could not be reached, or refused the session."""


class AuthError(ConnectError):
    """The mutual token handshake failed (missing, wrong or replayed credentials)."""


class Rejected(ConnectError):
    """The session was refused for a reason no retry cures (no common data plane, a requested
    plane that cannot work here): raised at once, not retried until ``connect_timeout``."""


class ProtocolError(RLinkError):
    """A peer sent a malformed, oversized or unexpected message; the connection is dropped."""


class SchemaMismatch(RLinkError, ValueError):
    """A step's fields, dtypes or shapes differ from the negotiated schema."""


class PeerLost(RLinkError, ConnectionError):
    """The peer broke the connection or stopped answering heartbeats (the peer's doing)."""


class Superseded(PeerLost):
    """A newer incarnation of this actor id connected to the learner: this one is retired."""


class Backpressure(RLinkError):
    """The learner granted no credit for longer than the put timeout."""


class Closed(RLinkError):
    """The object was closed by its owner (your doing, not the peer's)."""


class TimeoutError(RLinkError, builtins.TimeoutError):  # shadows the builtin on purpose, and derives from it
    """A blocking call ran past its timeout."""


# What a peer's ``Error.kind`` (wire/messages.py) means to the side that reads it. Only the
# final kinds are here: "timeout", "protocol" and unknown kinds are ``otherwise``, because
# whether they may be retried depends on where they arrive (a handshake retries them).
_REFUSALS: dict[str, type[RLinkError]] = {
    "auth": AuthError,
    "superseded": Superseded,
    "refused": Rejected,
}


def refusal(kind: str, text: str, *, otherwise: type[RLinkError] = ProtocolError) -> RLinkError:
    """The exception a peer's ``Error(kind, text)`` becomes: ``AuthError`` for "auth",
    ``Superseded`` for "superseded", ``Rejected`` for "refused", ``otherwise`` for any other kind.

    >>> type(refusal("auth", "learner refused: bad token")).__name__
    'AuthError'
    """
    return _REFUSALS.get(kind, otherwise)(text)


class CheckpointError(ConfigError):
    """A replay checkpoint is missing, truncated, corrupted, of another format, or asks for
    more than this machine holds."""


class RLinkWarning(UserWarning):
    """Something went wrong that did not make a call fail (steps dropped at ``Actor.close()``).
    Shown on stderr by Python's default warning filters; silence it with
    ``warnings.simplefilter("ignore", rlink_ucx.RLinkWarning)``, or make it an error with
    ``"error"`` in place of ``"ignore"``."""
