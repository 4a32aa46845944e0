"""What ``put`` and ``put_many`` check a step against: the negotiated schema, field by field,
with the conversions a value may get on its way into a frame."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import ProtocolError, SchemaMismatch
from ...wire import messages as _wire
from ...wire.codec import DTYPES, Schema, castable, field_array

__all__ = ["Field", "accepted_schema", "check_chunk", "check_value", "raise_extra"]

_SCALAR_KINDS = {bool: "b", int: "iu", float: "f"}


class Field:
    """What ``put`` checks a value against, precomputed once per schema."""

    __slots__ = ("dtype", "index", "name", "scalars", "shape", "spec")

    def __init__(self, index: int, spec: Any):
        self.index = index
        self.name = spec.name
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.shape = spec.shape
        # Scalar types a 0-d field takes as they are: Python's (bool for a bool field, ...) and
        # the numpy scalar of its exact dtype (np.float32 for a float32 field), which policies
        # and environments often return; any other goes through the converting path.
        python = [t for t, kinds in _SCALAR_KINDS.items() if self.dtype.kind in kinds]
        self.scalars = frozenset([*python, self.dtype.type] if not self.shape else [])

    def mismatch(self, value: Any, got: str) -> SchemaMismatch:
        return SchemaMismatch(f"field {self.name!r}: the negotiated schema says {self.spec.describe()}, got {got}")


def accepted_schema(proposed: Schema, reply: _wire.Accept, max_fields: int) -> Schema:
    """The schema the learner accepted for ``proposed``: itself, or the learner's schema, which
    steps are then cast to (another actor set it: float32 where this one's first step held a
    list or float64). ProtocolError for an answer ``proposed`` cannot be cast to."""
    if reply.fields is None:
        return proposed
    accepted = Schema.from_wire(reply.fields, max_fields=max_fields)
    if not proposed.casts_to(accepted):
        raise ProtocolError(f"the learner accepted the schema {proposed.describe()} as {accepted.describe()}, "
                            "which it cannot be cast to")  # fmt: skip
    return accepted


def check_value(f: Field, step: Mapping[str, Any]) -> Any:
    """The value of field ``f`` in ``step``, as it goes into a frame (see :func:`conform`)."""
    try:
        v = step[f.name]
    except KeyError:
        raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the step") from None
    kind = type(v)
    if kind is np.ndarray:
        if v.dtype == f.dtype and v.shape == f.shape and f.spec.dtype != "bfloat16":
            return v
    elif kind in _SCALAR_KINDS and not f.shape and f.spec.dtype != "bfloat16" and f.dtype.kind in _SCALAR_KINDS[kind]:
        if kind is int and not _int_fits(v, f.dtype):
            raise f.mismatch(v, f"the Python int {v}, outside {f.spec.dtype}'s range")
        return v
    arr, dtype = field_array(f.name, v)
    if arr.shape != f.shape:
        raise f.mismatch(v, _given(v, dtype, arr))
    return arr if dtype == f.spec.dtype else conform(f, arr, dtype, _given(v, dtype, arr))


def conform(f: Field, arr: np.ndarray, dtype: str, given: str) -> np.ndarray:
    """``arr`` in the field's negotiated dtype, by the one conversion rule of ``put`` and
    ``put_many`` (``wire.codec.castable``): the kind is kept (float64 -> float32, int64 -> int32
    or uint8 while every value fits, int -> float); a change of kind (float -> int, anything to
    or from bool) raises :class:`SchemaMismatch` naming the field, the expected and the given
    dtype."""
    if dtype == f.spec.dtype:
        return arr
    if not castable(dtype, f.spec.dtype):
        raise f.mismatch(arr, given)
    if f.dtype.kind in "iu" and arr.dtype.kind in "iu" and arr.size and not np.can_cast(arr.dtype, f.dtype):
        info = np.iinfo(f.dtype)
        low, high = int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            raise f.mismatch(arr, f"{given} with values in [{low}, {high}], outside {f.spec.dtype}")
    return arr.astype(f.dtype)


def _given(value: Any, dtype: str, arr: np.ndarray) -> str:
    kind = type(value)
    return f"a Python {kind.__name__}" if kind in _SCALAR_KINDS else f"{dtype}{list(arr.shape)}"


def _given_chunk(dtype: str, arr: np.ndarray) -> str:
    return f"{dtype}{list(arr.shape[1:])} per step (chunk shape {list(arr.shape)})"


def _int_fits(value: int, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    return info is None or info.min <= value <= info.max


def raise_extra(step: Mapping[str, Any], fields: list[Field]) -> None:
    known = {f.name for f in fields}
    extra = [k for k in step if k not in known]
    missing = [f.name for f in fields if f.name not in step]
    raise SchemaMismatch(f"step fields differ from the schema: extra {extra}, missing {missing}")


def check_chunk(fields: list[Field], steps: Mapping[str, Any]) -> tuple[list[np.ndarray], int]:
    """The arrays of a ``put_many`` chunk, one per field (see :func:`conform`), and its number
    of steps."""
    arrays = []
    count = -1
    for f in fields:
        if f.name not in steps:
            raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the chunk")
        arr, dtype = field_array(f.name, steps[f.name])
        if arr.shape[1:] != f.shape or arr.ndim != len(f.shape) + 1:
            raise f.mismatch(arr, _given_chunk(dtype, arr) if arr.ndim else f"{dtype}[] (a chunk needs a leading time axis)")
        if dtype != f.spec.dtype:  # the common case skips this (and the text it would need)
            arr = conform(f, arr, dtype, _given_chunk(dtype, arr))
        if count not in (-1, arr.shape[0]):
            raise SchemaMismatch(f"field {f.name!r} has {arr.shape[0]} steps, others have {count}")
        count = arr.shape[0]
        arrays.append(arr)
    return arrays, count
