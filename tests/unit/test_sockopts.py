"""The congestion control of rlink's TCP connections (``Config.tcp_congestion``), on real
loopback sockets: Reno where a connection stays on this host, the system's default or a named
one otherwise, and the same-host test behind it."""

from __future__ import annotations

import logging
import sys

import pytest

from rlink_ucx import Config
from rlink_ucx.errors import ConfigError
from rlink_ucx.transport import sockopts as _sockopts
from rlink_ucx.transport.sockopts import LOOPBACK_CONGESTION, congestion_of, same_host, set_congestion

pytestmark = pytest.mark.timeout(30)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux-only")



@pytest.mark.parametrize(
    ("peer", "local", "expected"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.2", "127.0.0.1", True),
        ("::1", "::1", True),
        ("::ffff:127.0.0.1", "::ffff:127.0.0.1", True),  # IPv4 on a dual-stack socket
        ("10.1.2.3", "10.1.2.3", True),  # this host's own address: routed through loopback
        ("fe80::1%eth0", "fe80::1%eth0", True),
        ("10.1.2.4", "10.1.2.3", False),
        ("::ffff:10.1.2.4", "::ffff:10.1.2.3", False),
        ("fe80::2%eth0", "fe80::1%eth0", False),
        ("not-an-address", "10.1.2.3", False),
    ],
)
def test_same_host_tells_loopback_and_own_addresses_from_remote_ones(peer, local, expected):
    assert same_host(peer, local) is expected


@linux_only
def test_auto_chooses_reno_on_loopback(paced_connection):
    client, _ = paced_connection
    set_congestion(client)
    assert congestion_of(client) == LOOPBACK_CONGESTION


@linux_only
def test_auto_and_system_keep_the_default_where_it_should(paced_connection, monkeypatch):
    client, accepted = paced_connection
    before = congestion_of(client)
    set_congestion(client, "system")  # on loopback, but asked to keep the default
    assert congestion_of(client) == before
    monkeypatch.setattr(_sockopts, "on_loopback", lambda sock: False)  # as if the peer were remote
    set_congestion(accepted)
    assert congestion_of(accepted) == before


@linux_only
def test_a_named_congestion_control_applies_off_this_host_too(paced_connection, monkeypatch):
    # e.g. containers on one machine, whose connections cross a bridge
    client, _ = paced_connection
    monkeypatch.setattr(_sockopts, "on_loopback", lambda sock: False)
    set_congestion(client, "reno")  # built into every kernel, allowed for every user
    assert congestion_of(client) == "reno"


@linux_only
def test_a_name_the_kernel_refuses_is_logged_once_and_changes_nothing(paced_connection, caplog, monkeypatch):
    monkeypatch.setattr(_sockopts, "_refused", set())
    client, accepted = paced_connection
    before = congestion_of(client)
    with caplog.at_level(logging.WARNING, logger="rlink_ucx"):
        set_congestion(client, "nosuchcc")
        set_congestion(accepted, "nosuchcc")
    assert congestion_of(client) == before
    warnings = [r.getMessage() for r in caplog.records if "nosuchcc" in r.getMessage()]
    assert len(warnings) == 1 and "the system's default stays" in warnings[0]


def test_config_takes_a_name_from_the_environment_and_rejects_a_malformed_one():
    assert Config().tcp_congestion == "auto"
    assert Config.from_env({"RLINK_TCP_CONGESTION": "cubic"}).tcp_congestion == "cubic"
    for bad in ("", "Reno", "bbr; rm -rf", "x" * 16):
        with pytest.raises(ConfigError, match="tcp_congestion"):
            Config(tcp_congestion=bad)
