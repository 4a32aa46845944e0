"""The data frame header: a fixed 64-byte binary header in front of every frame's payload.

The payload that follows is each schema field's bytes for ``n_steps`` steps, one field after
another. The header is validated (magic, protocol version, size) before anything is allocated.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from ..errors import ProtocolError
from .messages import PROTOCOL_VERSION

FRAME_MAGIC = b"RLNK"
FRAME_HEADER = struct.Struct("<4sHHIIQQQqQQ")
FRAME_HEADER_BYTES = FRAME_HEADER.size  # 64
_PAYLOAD_BYTES = struct.Struct("<Q")
PAYLOAD_BYTES_AT = struct.calcsize("<4sHHIIQQQq")  # the payload size is the header's tenth field


def announced_payload(buf: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The payload size the header at ``buf[pos:]`` announces, read without unpacking (or
    validating: :meth:`FrameHeader.unpack` does that) the rest."""
    return int(_PAYLOAD_BYTES.unpack_from(buf, pos + PAYLOAD_BYTES_AT)[0])


# ``announced_payload`` without its call, for a loop that reads thousands of headers:
# ``unpack_payload_bytes(buf, pos + PAYLOAD_BYTES_AT)[0]``.
unpack_payload_bytes = _PAYLOAD_BYTES.unpack_from


class FrameHeader(NamedTuple):
    """A data frame's header fields (immutable). A named tuple rather than a frozen dataclass:
    the learner makes one per frame it receives, and a tuple is made several times faster."""

    schema_id: int
    n_steps: int
    actor_id: int
    incarnation: int
    seq: int  # seq of the first step; step i has seq + i
    version: int  # behaviour-policy version of every step in the frame
    payload_bytes: int
    flags: int = 0
    put_time_us: int = 0  # when the frame's first step was put: wall clock, microseconds since the epoch

    def pack(self) -> bytes:
        return FRAME_HEADER.pack(
            FRAME_MAGIC, PROTOCOL_VERSION, self.flags, self.schema_id, self.n_steps,
            self.actor_id, self.incarnation, self.seq, self.version, self.payload_bytes, self.put_time_us,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> FrameHeader:
        if len(raw) != FRAME_HEADER_BYTES:
            raise ProtocolError(f"frame header is {len(raw)} bytes, expected {FRAME_HEADER_BYTES}")
        magic, proto, flags, schema_id, n_steps, actor_id, incarnation, seq, version, payload, put = FRAME_HEADER.unpack(raw)
        if magic != FRAME_MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}")
        if proto != PROTOCOL_VERSION:
            raise ProtocolError(f"frame protocol version {proto} is not {PROTOCOL_VERSION}")
        return _new_header(cls, (schema_id, n_steps, actor_id, incarnation, seq, version, payload, flags, put))


_new_header = tuple.__new__  # FrameHeader without the generated __new__'s keyword handling


# The header as a numpy record, field for field: a burst's headers are checked as arrays
# (``session/learner/burst.py``) instead of one ``unpack`` each.
HEADER_DTYPE = np.dtype([("magic", "S4"), ("proto", "<u2"), ("flags", "<u2"), ("schema_id", "<u4"), ("n_steps", "<u4"),
                         ("actor_id", "<u8"), ("incarnation", "<u8"), ("seq", "<u8"), ("version", "<i8"),
                         ("payload_bytes", "<u8"), ("put_time_us", "<u8")])  # fmt: skip
assert HEADER_DTYPE.itemsize == FRAME_HEADER_BYTES


def unpack_many(headers: bytes) -> np.ndarray:
    """Frame headers one after another, as records of :data:`HEADER_DTYPE` (nothing checked:
    the caller compares the fields, magic and protocol version included, as arrays)."""
    return np.frombuffer(headers, dtype=HEADER_DTYPE)
