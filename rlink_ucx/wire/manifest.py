"""The manifest of one model version: where each tensor lies in the flat weights buffer, split
into buckets (each tagged on its own, and checked as it arrives). A receiver validates it before allocating anything; the
buckets' keyed tags travel apart, in a Seal (``wire/keys.py``, ``weights/mac.py``).

Nesting travels in the entry names: a pytree of mappings (flax's ``{"params": {"Dense_0":
{"kernel": ...}}}``) is published as one entry per leaf, named by its path joined with ``/``,
where each key's own ``~`` and ``/`` are escaped as ``~0`` and ``~1`` (JSON Pointer's rule). A flat
torch state dict keeps its names (``"fc.weight"``), and any mapping comes back as it went.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import ConfigError, ProtocolError
from .codec import DTYPES, MAX_DIMS, MAX_NAME_LEN

__all__ = ["ALIGN", "KEYED", "Entry", "Manifest", "flatten", "unflatten"]

ALIGN = 64
KEYED = "gmac-v1"  # the bucket check: an AES-GMAC tag per bucket, sent in a Seal (weights/mac.py)
MAX_BUCKETS = 1 << 16  # a manifest cannot make a receiver build a huge bucket list


class Entry(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int

    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class Manifest(msgspec.Struct, array_like=True, frozen=True):
    """Where every tensor of one version lives in the flat buffer, and how its buckets are checked."""

    version: int
    entries: list[Entry]
    total_bytes: int
    bucket_bytes: int
    checksums: list[int]  # always empty: the keyed tags of the buckets follow in a Seal message
    checksum: str  # the bucket check: KEYED (unkeyed checksums are refused)

    def buckets(self) -> list[tuple[int, int]]:
        """``(start, stop)`` byte ranges, one per bucket."""
        step = self.bucket_bytes
        return [(start, min(start + step, self.total_bytes)) for start in range(0, self.total_bytes, step)]

    def validate(self, *, max_bytes: int, max_entries: int) -> None:
        """Reject a manifest that could make the receiver over-allocate or read out of bounds."""
        if not 0 <= self.total_bytes <= max_bytes:
            raise ProtocolError(f"weights of {self.total_bytes} bytes exceed max_weights_bytes={max_bytes}")
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN or self.version <= 0:
            raise ProtocolError("weights manifest has a bad bucket size or version")
        n_buckets = -(-self.total_bytes // self.bucket_bytes)  # counted, not listed: no allocation yet
        if n_buckets > MAX_BUCKETS:
            raise ProtocolError(f"weights manifest splits into {n_buckets} buckets; limit {MAX_BUCKETS}")
        if len(self.entries) > max_entries:
            raise ProtocolError(f"weights manifest lists {len(self.entries)} tensors; limit {max_entries}")
        if self.checksum != KEYED or self.checksums:
            raise ProtocolError(f"weights manifest with checksums {self.checksum[:20]!r}: only {KEYED!r} is accepted")
        names = set()
        for e in self.entries:
            if e.dtype not in DTYPES or not 0 < len(e.name) <= 4 * MAX_NAME_LEN or e.name in names:
                raise ProtocolError(f"weights entry {e.name[:60]!r}: bad or duplicate name, or dtype {e.dtype!r}")
            for part in e.name.split("/"):
                _unescape(part, e.name)  # names are canonical: no two mean one key
            if len(e.shape) > MAX_DIMS or any(d < 0 or d > 2**40 for d in e.shape):
                raise ProtocolError(f"weights entry {e.name[:60]!r}: bad shape {e.shape[:MAX_DIMS + 1]}")
            if e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes() > self.total_bytes:
                raise ProtocolError(f"weights entry {e.name[:60]!r} lies outside the buffer")
            names.add(e.name)

    def describe(self) -> str:
        return f"version {self.version}: {len(self.entries)} tensors, {self.total_bytes} bytes"


_ESCAPED = re.compile(r"(?:[^~/]|~[01])*")  # what _escape makes, and nothing else: one name, one key
_ESCAPE = re.compile(r"~([01])")


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _unescape(part: str, name: str) -> str:
    if _ESCAPED.fullmatch(part) is None:
        raise ProtocolError(f"weights entry {name[:60]!r}: bad escape (only ~0 and ~1, for ~ and /)")
    return _ESCAPE.sub(lambda m: "~" if m.group(1) == "0" else "/", part)


def flatten(tree: Mapping[Any, Any]) -> dict[str, Any]:
    """The leaves of a nested mapping keyed by their escaped paths (``{"a": {"b": x}}`` ->
    ``{"a/b": x}``). ValueError for a mapping with no leaves or a tree deeper than ``MAX_DIMS * 4``;
    ConfigError for two keys of one mapping with one name (``{1: a, "1": b}``: names are
    ``str(key)``, and the receiver could keep only one of them)."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[Any, Any], prefix: str, depth: int) -> None:
        if depth > 4 * MAX_DIMS:
            raise ValueError(f"params nested deeper than {4 * MAX_DIMS} levels")
        if not node:
            raise ValueError(f"params {prefix or 'mapping'!r} is an empty mapping: nothing to publish there")
        seen: dict[str, Any] = {}
        for key, value in node.items():
            escaped = _escape(key)
            if escaped in seen:
                raise ConfigError(f"params keys {seen[escaped]!r} and {key!r} of {prefix or 'the top level'!r} "
                                  f"have one name, {str(key)!r}: rename one (names are str(key))")  # fmt: skip
            seen[escaped] = key
            path = prefix + escaped
            if isinstance(value, Mapping):
                walk(value, path + "/", depth + 1)
            else:
                out[path] = value

    walk(tree, "", 0)
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested mapping whose :func:`flatten` is ``flat``. ProtocolError for names that cannot
    come from one (a leaf that is also a subtree, a bad escape)."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        keys = [_unescape(k, name) for k in name.split("/")]
        node = out
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ProtocolError(f"weights entry {name[:60]!r} lies under a leaf")
            node = child
        if keys[-1] in node:
            raise ProtocolError(f"weights entry {name[:60]!r} is both a leaf and a subtree")
        node[keys[-1]] = value
    return out
