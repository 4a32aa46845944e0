"""Learner addresses: ``[scheme://]host[:port]``, with IPv6 as ``[::1]:8443``.

A scheme names the data plane (``tcp``, ``ucx``, ``shm``) or leaves the choice to ``auto``
(``rlink``). Addresses are checked before anything else is, so a typo is reported as a typo.
"""

from __future__ import annotations

import ipaddress
import re

from ..errors import ConfigError

DEFAULT_PORT = 8443
SCHEMES = {"tcp": "tcp", "ucx": "ucx", "shm": "shm", "rlink": "auto"}  # scheme -> transport
FORMS = ("host:port, [ipv6]:port, or scheme://host:port with scheme tcp, ucx, shm or rlink (auto); "
         "e.g. 127.0.0.1:8443, [::1]:8443, learner-host:8443, tcp://10.0.0.5:8443")  # fmt: skip
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def parse_address(address: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address without a scheme (see :func:`parse_endpoint`)."""
    host, port, _ = parse_endpoint(address, "auto", default_host=default_host)
    return host, port


def parse_endpoint(address: str, transport: str = "auto", *, default_host: str = "127.0.0.1") -> tuple[str, int, str]:
    """``(host, port, transport)`` of ``[scheme://]host[:port]``.

    The scheme's transport must agree with ``transport`` unless one of them is ``auto``; the
    port defaults to 8443 and the host to ``default_host``.

    Raises:
        ConfigError: an unknown scheme, a conflicting transport, a malformed host or port.
    """
    if not isinstance(address, str):
        raise ConfigError(f"an address is a string ({FORMS}), got {type(address).__name__}")
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        wanted = SCHEMES.get(scheme.lower())
        if wanted is None:
            raise ConfigError(f"unknown scheme {scheme!r} in address {address!r}; accepted forms: {FORMS}")
        if "auto" not in (wanted, transport) and wanted != transport:
            raise ConfigError(f"address {address!r} names the {wanted} transport but transport={transport!r}")
        if wanted != "auto":
            transport = wanted
        text = rest
    host, port_text = _split(text, address)
    host = host or default_host
    _check_host(host, address)
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError as exc:
        raise ConfigError(f"bad port {port_text!r} in address {address!r}; accepted forms: {FORMS}") from exc
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} out of range (0-65535) in address {address!r}")
    return host, port, transport


def _split(text: str, address: str) -> tuple[str, str]:
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ConfigError(f"malformed address {address!r}; accepted forms: {FORMS}")
        return host, rest[1:]
    if text.count(":") == 1:
        host, port_text = text.split(":")
        return host, port_text
    if ":" in text:  # a bare IPv6 address, no port
        return text, ""
    return text, ""


def _check_host(host: str, address: str) -> None:
    if ":" in host or host.replace(".", "").isdigit():  # must be an IP address
        try:
            ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            raise ConfigError(f"{host!r} in address {address!r} is not a valid IP address") from None
        return
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"{host!r} in address {address!r} is not a valid host name; accepted forms: {FORMS}")


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
