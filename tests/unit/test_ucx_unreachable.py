"""An actor whose learner's UCX worker is gone gets an rlink error it retries, not ucxx's own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlink_ucx import Config, PeerLost
from tests.conftest import ucx_importable

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")]


def test_an_unreachable_learner_worker_is_peer_lost(monkeypatch):
    from ucxx._lib import libucxx

    from rlink_ucx.transport.ucx import actor as ucx_actor
    def unreachable(worker, address, error_handling):
        raise libucxx.UCXUnreachableError("Destination is unreachable")

    fake = SimpleNamespace(UCXError=libucxx.UCXError,
                           UCXAddress=SimpleNamespace(create_from_buffer=lambda b: b),
                           UCXEndpoint=SimpleNamespace(create_from_worker_address=unreachable))  # fmt: skip
    monkeypatch.setattr(ucx_actor, "make_worker", lambda config, loopback, devices: (fake, object(), object()))
    welcome = SimpleNamespace(answer=b"a worker that is gone")
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(PeerLost, match="ucx worker is unreachable .*UCXXUnreachableError"):
            loop.run_until_complete(ucx_actor.UcxActorPlane.connect(loop, welcome, b"k" * 32, 0, Config(),
                                                                    loopback=True))  # fmt: skip
    finally:
        loop.close()
    assert not ucx_actor._workers  # the failed connect gave back the worker it took
