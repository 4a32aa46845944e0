"""Parsing ``host:port`` strings (IPv6 as ``[::1]:8443``)."""

from __future__ import annotations

import ipaddress

from ..errors import ConfigError

DEFAULT_PORT = 8443


def parse_address(address: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:  # a bare IPv6 address
        host, port_text = text, ""
    else:
        host, port_text = text, ""
    host = host or default_host
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError as exc:
        raise ConfigError(f"bad port in address {address!r}") from exc
    if not 0 <= port <= 65535:
        raise ConfigError(f"port out of range in address {address!r}")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
