"""What ``put`` and ``put_many`` check a step against: the negotiated schema, field by field,
with the conversions a value may get on its way into a frame."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import SchemaMismatch
from ..wire.codec import DTYPES, as_host_array

__all__ = ["Field", "check_chunk", "check_value", "raise_extra"]

_SCALAR_KINDS = {bool: "b", int: "iu", float: "f"}


class Field:
    """What ``put`` checks a value against, precomputed once per schema."""

    __slots__ = ("name", "spec", "dtype", "shape", "index", "scalars")

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


def check_value(f: Field, step: Mapping[str, Any]) -> Any:
    """The value of field ``f`` in ``step``, as it goes into a frame; SchemaMismatch if it cannot."""
    try:
        v = step[f.name]
    except KeyError:
        raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the step") from None
    kind = type(v)
    if kind is np.ndarray:
        if v.dtype == f.dtype and v.shape == f.shape and f.spec.dtype != "bfloat16":
            return v
    elif kind in _SCALAR_KINDS and not f.shape:
        if f.dtype.kind in _SCALAR_KINDS[kind] and f.spec.dtype != "bfloat16":
            return v
        raise f.mismatch(v, f"a Python {kind.__name__}")
    arr, dtype = as_host_array(v)
    if dtype != f.spec.dtype or arr.shape != f.shape:
        raise f.mismatch(v, f"{dtype}{list(arr.shape)}")
    return arr


def raise_extra(step: Mapping[str, Any], fields: list[Field]) -> None:
    known = {f.name for f in fields}
    extra = [k for k in step if k not in known]
    missing = [f.name for f in fields if f.name not in step]
    raise SchemaMismatch(f"step fields differ from the schema: extra {extra}, missing {missing}")


def check_chunk(fields: list[Field], steps: Mapping[str, Any]) -> tuple[list[np.ndarray], int]:
    """The arrays of a ``put_many`` chunk, one per field, and its number of steps."""
    arrays = []
    count = -1
    for f in fields:
        if f.name not in steps:
            raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the chunk")
        arr, dtype = as_host_array(steps[f.name])
        if dtype != f.spec.dtype or arr.shape[1:] != f.shape or arr.ndim != len(f.shape) + 1:
            got = f"{dtype}{list(arr.shape[1:])} per step (chunk shape {list(arr.shape)})"
            raise f.mismatch(arr, got if arr.ndim else f"{dtype}[] (a chunk needs a leading time axis)")
        if count not in (-1, arr.shape[0]):
            raise SchemaMismatch(f"field {f.name!r} has {arr.shape[0]} steps, others have {count}")
        count = arr.shape[0]
        arrays.append(arr)
    return arrays, count
