"""UCX settings and tags, without starting UCX: tags are 64 secret bits each, and UCX's TCP
transport is confined to the interfaces of the control channel."""

from __future__ import annotations

import os

import pytest

from rlink_ucx import Config
from rlink_ucx.transport import interfaces
from rlink_ucx.transport.ucx import probe as ucx_probe
from rlink_ucx.transport.ucx.setup import session_tags, ucx_options


def test_tags_carry_64_secret_bits_each_and_a_shared_ticket_prefix_tells_nothing():
    ticket = os.urandom(32)
    cousin = ticket[:16] + os.urandom(16)  # the same first half
    tags = session_tags(ticket)
    assert session_tags(ticket) == tags  # both sides derive the same
    assert len(set(tags) | set(session_tags(cousin))) == 4
    many = [session_tags(os.urandom(32)) for _ in range(256)]
    for kind in (0, 1):
        ones, zeros = 0, (1 << 64) - 1
        for t in many:
            assert 0 <= t[kind] < 1 << 64
            ones, zeros = ones | t[kind], zeros & t[kind]
        assert ones == (1 << 64) - 1 and zeros == 0, "some of the 64 bits never vary"


def test_net_devices_follow_the_bind_address(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    config = Config()
    assert ucx_options(config, loopback=True)["NET_DEVICES"] == "lo"
    assert ucx_options(config, devices=["eth7", "mlx5_0:1"])["NET_DEVICES"] == "eth7,mlx5_0:1"
    assert "NET_DEVICES" not in ucx_options(config)  # a wildcard bind: every interface is ours
    monkeypatch.setenv("UCX_NET_DEVICES", "all")
    assert "NET_DEVICES" not in ucx_options(config, devices=["eth7"])  # the user's setting wins


def test_interfaces_holding_an_address():
    assert interfaces.holding("0.0.0.0") is None and interfaces.holding("::") is None
    assert interfaces.holding("203.0.113.254") is None  # TEST-NET-3: not on this host
    assert interfaces.holding("127.0.0.1") == ["lo"]
    pairs = [(n, a) for n, a in interfaces.addresses() if n != "lo" and not a.startswith("fe80")]
    if not pairs:
        pytest.skip("no non-loopback address here")
    name, addr = pairs[0]
    assert name in interfaces.holding(addr)
    assert "lo" not in interfaces.holding(addr)


def test_net_devices_add_rdma_devices_to_the_interface(monkeypatch):
    monkeypatch.setattr(ucx_probe, "transports", lambda: {"tcp": ["eth0", "lo"], "rc_mlx5": ["mlx5_0:1"],
                                                          "posix": ["memory"]})  # fmt: skip
    assert ucx_probe.net_devices("127.0.0.1") == ["lo", "mlx5_0:1"]
    assert ucx_probe.net_devices("0.0.0.0") is None


def test_small_fields_ride_in_the_header_message_while_it_stays_eager():
    from rlink_ucx.transport.ucx.setup import HEADER_MESSAGE_BYTES, inline_fields
    from rlink_ucx.wire.frame import FRAME_HEADER_BYTES

    # An Atari frame of 32 steps: t_ns, obs, action, reward, done.
    assert inline_fields([256, 903_168, 256, 128, 32]) == [True, False, True, True, True]
    # In order, while the message fits: the field that would overflow it goes alone, and a
    # later small one may still fit; empty fields never count.
    room = HEADER_MESSAGE_BYTES - FRAME_HEADER_BYTES
    assert inline_fields([room - 100, 0, 200, 100]) == [True, False, False, True]
    assert inline_fields([room + 1]) == [False]


def test_ucx_is_kept_off_sysv_segments_unless_the_user_chose_the_transports(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert ucx_options(Config())["TLS"] == "^sysv"  # group read/write segments: see ucx_options
    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    assert "TLS" not in ucx_options(Config())
