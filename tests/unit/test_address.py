"""Learner addresses: every accepted form, and a clear ConfigError for everything else."""

from __future__ import annotations

import pytest

from rlink_ucx import ConfigError
from rlink_ucx.transport.address import parse_address, parse_endpoint


@pytest.mark.parametrize(
    ("address", "transport", "expected"),
    [
        ("127.0.0.1:8443", "auto", ("127.0.0.1", 8443, "auto")),
        ("127.0.0.1", "auto", ("127.0.0.1", 8443, "auto")),
        (":9000", "auto", ("127.0.0.1", 9000, "auto")),
        ("learner-host:0", "tcp", ("learner-host", 0, "tcp")),
        ("my_proj_learner_1:8443", "auto", ("my_proj_learner_1", 8443, "auto")),  # docker compose names
        ("[::1]:8443", "auto", ("::1", 8443, "auto")),
        ("::1", "auto", ("::1", 8443, "auto")),
        ("tcp://127.0.0.1:8443", "auto", ("127.0.0.1", 8443, "tcp")),
        ("ucx://10.0.0.5:9000", "auto", ("10.0.0.5", 9000, "ucx")),
        ("shm://localhost:1234", "shm", ("localhost", 1234, "shm")),
        ("rlink://127.0.0.1:8443", "tcp", ("127.0.0.1", 8443, "tcp")),  # rlink:// leaves the choice
        ("TCP://[::1]:7", "auto", ("::1", 7, "tcp")),
        ("  127.0.0.1:8443 ", "auto", ("127.0.0.1", 8443, "auto")),
    ],
)
def test_every_accepted_form_parses(address, transport, expected):
    assert parse_endpoint(address, transport) == expected
    assert parse_address(address) == expected[:2]


@pytest.mark.parametrize(
    ("address", "transport", "message"),
    [
        ("http://127.0.0.1:8443", "auto", "unknown scheme 'http'.*accepted forms.*tcp, ucx, shm or rlink"),
        ("tcp://127.0.0.1:8443", "ucx", "names the tcp transport but transport='ucx'"),
        ("256.1.1.1:8443", "auto", "'256.1.1.1'.*not a valid IP address"),
        ("1.2.3:8443", "auto", "not a valid IP address"),
        ("tcp://127.0.0.1:8443:8443", "auto", "not a valid IP address"),
        ("127.0.0.1:http", "auto", "bad port 'http'"),
        ("127.0.0.1:70000", "auto", "port 70000 out of range"),
        ("bad host:8443", "auto", "not a valid host name"),
        ("-leading:8443", "auto", "not a valid host name"),
        ("[::1:8443", "auto", "malformed address"),
        ("[::1]8443", "auto", "malformed address"),
        ("[1::2::3]:8443", "auto", "not a valid IP address"),
    ],
)
def test_a_bad_address_is_a_config_error_that_says_what_is_wrong(address, transport, message):
    with pytest.raises(ConfigError, match=message):
        parse_endpoint(address, transport)


@pytest.mark.timeout(30)
def test_the_learner_checks_the_address_before_the_token():
    from rlink_ucx import Learner

    # A non-loopback host without a token is refused too, but the address is what is wrong here.
    with pytest.raises(ConfigError, match="not a valid IP address"):
        Learner("256.1.1.1:8443")
    with pytest.raises(ConfigError, match="unknown scheme"):
        Learner("udp://0.0.0.0:8443")


@pytest.mark.timeout(30)
def test_a_scheme_picks_the_learners_transport():
    from rlink_ucx import Learner

    with Learner("tcp://127.0.0.1:0") as learner:
        assert learner.address.startswith("127.0.0.1:") and learner.port > 0
        assert learner._server.transport == "tcp"
