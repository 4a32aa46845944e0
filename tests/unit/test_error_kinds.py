"""What a peer's ``Error.kind`` becomes on the side that reads it: one table for every reader."""

from __future__ import annotations

import pytest

from rlink_ucx.errors import (
    AuthError,
    ConnectError,
    ProtocolError,
    Rejected,
    RLinkError,
    Superseded,
    refusal,
)

# Every kind a learner sends (session/learner/server.py, session.py, ranks/placement.py), and one no
# learner sends: an actor of a newer rlink may meet kinds this one does not know.
KINDS = {
    "auth": AuthError,
    "superseded": Superseded,
    "refused": Rejected,
    "timeout": ProtocolError,
    "protocol": ProtocolError,
    "config": ProtocolError,  # RankRefused.kind: ranks/link.py turns it into RankRefused first
    "no-such-kind": ProtocolError,
}


@pytest.mark.parametrize(("kind", "expected"), sorted(KINDS.items()))
def test_each_kind_maps_to_its_exception(kind: str, expected: type[RLinkError]) -> None:
    exc = refusal(kind, f"learner refused: {kind} text")
    assert type(exc) is expected
    assert str(exc) == f"learner refused: {kind} text"


@pytest.mark.parametrize("kind", ["timeout", "protocol", "no-such-kind"])
def test_a_handshake_retries_the_kinds_that_are_not_final(kind: str) -> None:
    # connect.py passes otherwise=ConnectError: these kinds are retried until connect_timeout.
    assert type(refusal(kind, "x", otherwise=ConnectError)) is ConnectError


@pytest.mark.parametrize("kind", ["auth", "superseded", "refused"])
def test_final_kinds_stay_final_whatever_the_default(kind: str) -> None:
    assert type(refusal(kind, "x", otherwise=ConnectError)) is KINDS[kind]


def test_the_final_kinds_are_what_a_retry_loop_expects() -> None:
    # The actor's retry loop gives up at once on AuthError and Rejected (ConnectError subclasses)
    # and retires on Superseded (a PeerLost, not a ConnectError).
    assert issubclass(AuthError, ConnectError) and issubclass(Rejected, ConnectError)
    assert not issubclass(Superseded, ConnectError)
    assert not issubclass(ProtocolError, ConnectError)
