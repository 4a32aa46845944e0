"""The data-plane registry (transport/plane.py) and the one mapping of a connection's errors to
rlink's (no network: planes are looked up, chosen and asked, never attached)."""

from __future__ import annotations

import asyncio
import errno

import pytest

from rlink_ucx.config import Config
from rlink_ucx.errors import ConfigError, PeerLost, ProtocolError, RLinkError
from rlink_ucx.session.actor import reconnect
from rlink_ucx.transport import TRANSPORTS, check_transport, plane
from rlink_ucx.transport.frame_memory import FrameMemory
from rlink_ucx.transport.plane import (
    LearnerContext,
    LearnerPlanes,
    Plane,
    Situation,
    attach_proven,
    choose_plane,
    get_plane,
    map_plane_error,
    plane_names,
    register,
    registered,
    require,
)
from rlink_ucx.transport.shm import memory as shm_memory
from rlink_ucx.transport.shm.plane import ShmPlane
from rlink_ucx.transport.tcp.plane import TcpPlane
from rlink_ucx.transport.ucx import plane as ucx_plane
from rlink_ucx.transport.ucx.plane import UcxPlane
from rlink_ucx.wire import messages as _wire


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test (which may register planes of its own)."""
    monkeypatch.setattr(plane, "_REGISTRY", dict(plane._REGISTRY))
    return plane._REGISTRY


class _Carrier(Plane):
    """A plane that only exists in these tests: auto picks it first wherever both sides offer it."""

    name = "carrier"
    preference = -1

    @classmethod
    def auto(cls, s):
        return (True, "auto: carrier pigeons") if cls.name in s.both else (False, "auto: no pigeons")


def test_the_three_planes_are_registered_by_name_in_the_public_order():
    assert plane_names() == ("tcp", "ucx", "shm")
    assert TRANSPORTS == ("auto", "tcp", "ucx", "shm")
    assert [get_plane(n) for n in plane_names()] == [TcpPlane, UcxPlane, ShmPlane]
    assert registered() == [UcxPlane, ShmPlane, TcpPlane]  # auto asks them in this order


def test_an_unknown_plane_is_a_config_error_naming_every_plane():
    with pytest.raises(ConfigError) as info:
        get_plane("carrier")
    assert str(info.value) == "transport must be one of ('auto', 'tcp', 'ucx', 'shm'), got 'carrier'"
    with pytest.raises(ConfigError, match="got 'udp'"):
        check_transport("udp")
    assert check_transport("auto") == "auto" and check_transport("shm") == "shm"


def test_the_capabilities_that_replace_plane_names_above_transport():
    assert [p.data_connection for p in (TcpPlane, ShmPlane, UcxPlane)] == [True, True, False]
    assert [p.whole_fields for p in (TcpPlane, ShmPlane, UcxPlane)] == [False, False, True]
    assert [attach_proven(n) for n in ("tcp", "shm", "ucx", "carrier")] == [True, True, False, False]


def test_a_name_is_registered_once(registry):
    with pytest.raises(ValueError, match="'tcp' is already registered"):
        register(TcpPlane)

    class Auto(_Carrier):
        name = "auto"

    with pytest.raises(ValueError, match="'auto'"):
        register(Auto)
    assert plane_names() == ("tcp", "ucx", "shm")


def test_one_register_line_makes_a_plane_choosable_by_name_and_by_auto(registry):
    register(_Carrier)
    assert plane_names() == ("tcp", "ucx", "shm", "carrier")
    assert check_transport("carrier") == "carrier"
    both = Situation(frozenset({"tcp", "carrier"}), frozenset({"tcp", "carrier"}))
    assert choose_plane("auto", "auto", both) == ("carrier", "auto: carrier pigeons")
    assert choose_plane("carrier", "auto", both) == ("carrier", "requested")
    # The actor lacks it: auto falls back to tcp, with the first reason a plane gave for declining.
    learner_only = Situation(frozenset({"tcp", "carrier"}), frozenset({"tcp"}))
    assert choose_plane("auto", "auto", learner_only) == ("tcp", "auto: no pigeons")
    hello = _wire.Hello(1, 0, "0", "auto", False, "h", 1)
    assert plane.situation({"tcp": True, "carrier": True}, hello, same_host=False).actor == frozenset({"tcp"})


def test_choose_plane_refusals_and_a_name_no_plane_has():
    nothing = Situation(frozenset({"tcp"}), frozenset({"tcp"}), same_host=True)
    assert choose_plane("tcp", "ucx", nothing) == ("", "learner requires 'tcp' but actor requires 'ucx'")
    assert choose_plane("auto", "shm", Situation(frozenset({"tcp", "shm"}), frozenset({"tcp", "shm"}))) == (
        "", "shm requested but the actor runs on another host")
    name, why = choose_plane("ucx", "auto", Situation(frozenset({"tcp", "ucx"}), frozenset({"tcp"})))
    assert name == "" and why.startswith("ucx requested but the actor offers none")
    # A name no plane has is auto's choice across hosts (never the same-host ring).
    same_host_shm = Situation(frozenset({"tcp", "shm"}), frozenset({"tcp", "shm"}), same_host=True)
    assert choose_plane("auto", "auto", same_host_shm)[0] == "shm"
    assert choose_plane("auto", "pigeon", same_host_shm) == ("tcp", "auto: ucxx is not installed on both sides")


def test_require_refuses_a_plane_asked_for_by_name_that_cannot_work_here(monkeypatch):
    require("auto")
    require("tcp")
    monkeypatch.setattr(ucx_plane, "ucx_available", lambda: False)
    monkeypatch.setattr(ucx_plane, "ucx_failure", lambda: None)
    with pytest.raises(ConfigError, match=r"^transport='ucx', but ucxx is not installed: pip install"):
        require("ucx")
    monkeypatch.setattr(ucx_plane, "ucx_failure", lambda: "bad UCX_TLS")
    with pytest.raises(ConfigError) as info:
        require("ucx")
    assert str(info.value) == "transport='ucx', but UCX already failed to start in this process: bad UCX_TLS"


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _planes(wanted: str, loop: asyncio.AbstractEventLoop) -> LearnerPlanes:
    return LearnerPlanes(LearnerContext(wanted, Config(), loop, "127.0.0.1", True))


def test_the_learners_planes_offer_what_its_transport_allows_and_choose_per_hello(monkeypatch, loop):
    monkeypatch.setattr(ucx_plane, "ucx_available", lambda: False)
    monkeypatch.setattr(ucx_plane, "ucx_failure", lambda: None)
    local = _wire.Hello(1, 0, "0", "auto", False, "h", 1, {"shm": b""})
    planes = _planes("tcp", loop)
    assert planes.offers() == {"tcp": True, "ucx": False, "shm": False}
    assert planes.choose(local, same_host=True)[0] is planes["tcp"]
    planes = _planes("auto", loop)
    assert planes.offers()["shm"] == shm_memory.available()
    if shm_memory.available():
        chosen, reason = planes.choose(local, same_host=True)
        assert chosen is planes["shm"] and reason == "auto: same host, shared-memory ring"
    assert planes.counters() == {"ucx_workers_recycled": 0}


def test_a_learner_whose_ucx_failed_says_so_instead_of_not_installed(monkeypatch, loop):
    monkeypatch.setattr(ucx_plane, "ucx_available", lambda: False)
    monkeypatch.setattr(ucx_plane, "ucx_failure", lambda: "bad UCX_TLS")
    wants_ucx = _wire.Hello(1, 0, "0", "ucx", False, "h", 1, {"ucx": b""})
    assert _planes("auto", loop).choose(wants_ucx, same_host=False) == (None, "ucx requested: the learner's ucx is off (bad UCX_TLS)")
    remote = _wire.Hello(1, 0, "0", "auto", False, "h", 1, {"ucx": b""})
    chosen, reason = _planes("auto", loop).choose(remote, same_host=False)
    assert chosen is not None and chosen.name == "tcp" and reason == "auto: the learner's ucx is off (bad UCX_TLS)"


def test_an_rlink_error_is_its_own_mapping():
    for exc in (ProtocolError("bad header"), PeerLost("gone"), ConfigError("no")):
        assert map_plane_error(exc, "data connection broke") is exc


@pytest.mark.parametrize("exc", [
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    BrokenPipeError(errno.EPIPE, "Broken pipe"),
    EOFError("actor closed the data connection"),
    RuntimeError("UCXXError: Endpoint timeout"),  # what a ucxx request raises
])
def test_anything_else_is_peer_lost_with_its_cause(exc):
    mapped = map_plane_error(exc, "data connection broke")
    assert type(mapped) is PeerLost and isinstance(mapped, RLinkError)
    assert str(mapped) == f"data connection broke: {exc}"
    assert mapped.__cause__ is exc
    bare = map_plane_error(exc)
    assert str(bare) == str(exc) and bare.__cause__ is exc


def test_a_refused_connection_stays_visible_to_the_retry_loop():
    refused = map_plane_error(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert isinstance(refused, PeerLost) and reconnect._refused(refused)
    assert not reconnect._refused(map_plane_error(TimeoutError("timed out")))


def test_frame_memory_lends_the_arena_only_while_frames_are_kept_for_resending():
    memory = FrameMemory(Config(resend_buffer_bytes=0, frame_bytes=64 * 1024))
    assert memory.nbytes == (4 + 4) * 64 * 1024
    assert memory.shared() is None and memory.arena is None
    # The first frame buffer is plain memory (a slow actor never needs a second): no reserve
    # is made, and nothing is populated, until a second one is asked for.
    assert memory.take(4096) is None and memory.reserve is None
    block = memory.take(4096)
    assert block is not None and block.nbytes == 4096  # from the populated reserve
    assert memory.reserve is not None and memory.reserve.populating > 0
    assert memory.release() is None
    if not shm_memory.available():
        return
    memory = FrameMemory(Config(resend_buffer_bytes=1 << 20, frame_bytes=64 * 1024))
    arena = memory.shared()
    assert arena is not None and memory.shared() is arena  # made once, kept across attaches
    # Nothing of the arena is populated for its first frame buffer either; from the second on,
    # two frames ahead of what was handed out.
    assert memory.take(4096) is not None and arena._memory.populating == 0
    assert memory.take(4096) is not None and arena._memory.populating == 2 * 4096 + 2 * 64 * 1024  # both blocks, and two frames
    assert memory.release() is arena and memory.arena is None
    arena.close()


def test_a_plugin_module_that_does_not_import_is_a_config_error(monkeypatch):
    monkeypatch.setattr(plane, "_plugins_loaded", False)
    monkeypatch.setenv(plane.PLUGINS_ENV, "tests.no_such_plane_module")
    with pytest.raises(ConfigError, match="RLINK_PLANES names 'tests.no_such_plane_module', which does not import"):
        get_plane("tcp")
    assert plane._plugins_loaded  # tried once, not at every look
    assert get_plane("tcp") is TcpPlane
