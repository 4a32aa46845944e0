"""Tensors <-> raw buffers, and the schema that says how to read them back.

A *step* is a mapping of field name -> array. Every field has a fixed dtype and per-step
shape, negotiated once (the :class:`Schema`); on the wire a frame of ``n`` steps is the
fields one after another, each ``n * field.step_bytes`` bytes in C order. The codec never
imports torch or cupy itself: it recognises them by their array protocols.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError, SchemaMismatch

__all__ = ["DTYPES", "FieldSpec", "Schema", "as_host_array", "castable", "field_array", "host_array", "infer_schema",
           "is_device_array", "is_torch"]

# Allowlisted wire dtypes -> (numpy dtype used to hold the bytes, element size).
# bfloat16 has no numpy dtype: its bytes travel as uint16 and torch reinterprets them.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(np_name)
    for name, np_name in [
        ("bool", "bool"),
        ("uint8", "<u1"), ("int8", "<i1"),
        ("uint16", "<u2"), ("int16", "<i2"),
        ("uint32", "<u4"), ("int32", "<i4"),
        ("uint64", "<u8"), ("int64", "<i8"),
        ("float16", "<f2"), ("bfloat16", "<u2"),
        ("float32", "<f4"), ("float64", "<f8"),
    ]
}  # fmt: skip

MAX_DIMS = 8
MAX_NAME_LEN = 128


@dataclass(frozen=True)
class FieldSpec:
    """One field of a step: its name, wire dtype name and per-step shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not (0 < len(self.name) <= MAX_NAME_LEN) or not self.name.isprintable():
            raise ProtocolError(f"bad field name {self.name!r}: 1 to {MAX_NAME_LEN} printable characters")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:  # a list from the wire is unhashable
            raise ProtocolError(f"field {self.name!r}: dtype {self.dtype!r} is not allowed")
        if len(self.shape) > MAX_DIMS or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 or d > 2**31 for d in self.shape
        ):
            raise ProtocolError(f"field {self.name!r}: bad shape {self.shape!r}")

    @functools.cached_property  # read for every frame on the learner (frozen: computed once)
    def step_bytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Schema:
    """The ordered fields of a step. Two schemas are equal iff their fingerprints are."""

    fields: tuple[FieldSpec, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if not names:
            raise ProtocolError("a schema needs at least one field")
        if len(set(names)) != len(names):
            raise ProtocolError(f"duplicate field names in {names}")

    @functools.cached_property  # read for every frame on the learner (frozen: computed once)
    def step_bytes(self) -> int:
        return sum(f.step_bytes for f in self.fields)

    def frame_steps(self, frame_bytes: int) -> int:
        """Steps of this schema in a frame of ``frame_bytes`` (``Config.frame_bytes``), at least one."""
        return max(1, frame_bytes // max(self.step_bytes, 1))

    @property
    def fingerprint(self) -> str:
        text = ";".join(f"{f.name}:{f.describe()}" for f in self.fields)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def field(self, name: str) -> FieldSpec:
        for spec in self.fields:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def describe(self) -> str:
        return "{" + ", ".join(f"{f.name}: {f.describe()}" for f in self.fields) + "}"

    def to_wire(self) -> list[tuple[str, str, list[int]]]:
        return [(f.name, f.dtype, list(f.shape)) for f in self.fields]

    @classmethod
    def from_wire(cls, fields: Any, *, max_fields: int = 256) -> Schema:
        """Validate an untrusted field list (from the network) into a Schema."""
        if not isinstance(fields, (list, tuple)) or not 0 < len(fields) <= max_fields:
            raise ProtocolError(f"schema must be a non-empty list of at most {max_fields} fields")
        specs = []
        for item in fields:
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise ProtocolError(f"bad schema field {item!r}")
            name, dtype, shape = item
            if not isinstance(shape, (list, tuple)):
                raise ProtocolError(f"bad shape for field {name!r}")
            specs.append(FieldSpec(name, dtype, tuple(shape)))
        return cls(tuple(specs))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Schema:
        """Build from a user declaration ``{"obs": ("float32", (4,)), ...}``."""
        return cls(tuple(FieldSpec(name, _dtype_name(dt), tuple(shape)) for name, (dt, shape) in spec.items()))

    def casts_to(self, target: Schema) -> bool:
        """Whether steps of this schema can be put as ``target``'s: the same field names (in any
        order) and shapes, every dtype :func:`castable` to the target's."""
        theirs = {f.name: f for f in target.fields}
        return len(theirs) == len(self.fields) and all(
            (t := theirs.get(f.name)) is not None and t.shape == f.shape and castable(f.dtype, t.dtype)
            for f in self.fields
        )

    def compare(self, other: Schema) -> str:
        """A human sentence naming the first difference that :meth:`casts_to` does not bridge
        (else the first difference), for errors naming both sides."""
        mine = {f.name: f for f in self.fields}
        theirs = {f.name: f for f in other.fields}
        for name in list(mine) + [n for n in theirs if n not in mine]:
            a, b = mine.get(name), theirs.get(name)
            if a is None:
                return f"field {name!r} is new ({b.describe()}) and not in the learner's schema"  # type: ignore[union-attr]
            if b is None:
                return f"field {name!r} ({a.describe()}) is missing"
            if a.shape != b.shape or not castable(b.dtype, a.dtype):
                return f"field {name!r}: learner has {a.describe()}, actor sent {b.describe()}"
        for name, a in mine.items():
            if a != theirs[name]:
                return f"field {name!r}: learner has {a.describe()}, actor sent {theirs[name].describe()}"
        return "field order differs"


_NAMES: dict[Any, str] = {}  # dtype object -> wire name, for the dtypes seen (a few)
_MAX_NAMES = 256


def castable(src: str, dst: str) -> bool:
    """Whether values of wire dtype ``src`` are cast to ``dst`` on their way into a frame: the
    kind is kept (float -> float of any width, int -> int of any width or sign while the values
    fit, checked per put; int -> float as numpy's ``same_kind`` allows). A change of kind (float
    -> int, anything to or from bool, bfloat16 against another dtype) is not."""
    if src == dst:
        return True
    if "bfloat16" in (src, dst) or (src == "bool") != (dst == "bool"):
        return False
    a, b = DTYPES[src], DTYPES[dst]
    return (a.kind in "iu" and b.kind in "iu") or bool(np.can_cast(a, b, "same_kind"))


def _dtype_name(dtype: Any) -> str:
    """Map a numpy/torch/cupy dtype (or a string) to the allowlisted wire name.

    Names of dtype objects are remembered: ``str(dtype)`` runs Python code in numpy (~4 us),
    once per field on every ``put_many`` otherwise."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # not seen yet, or unhashable
        pass
    name = _wire_name(dtype)
    if not isinstance(dtype, str) and len(_NAMES) < _MAX_NAMES:
        try:
            _NAMES[dtype] = name
        except TypeError:
            pass
    return name


def _wire_name(dtype: Any) -> str:
    text = str(dtype)
    text = text.removeprefix("torch.")
    if text == "bfloat16":
        return text
    try:
        np_dtype = np.dtype(text)
    except TypeError as exc:
        raise SchemaMismatch(f"unsupported dtype {dtype!r}") from exc
    name = "bool" if np_dtype == np.bool_ else np_dtype.name
    if name not in DTYPES:
        raise SchemaMismatch(f"unsupported dtype {dtype!r}; allowed: {sorted(DTYPES)}")
    return name


def is_torch(x: Any) -> bool:
    """True for a torch tensor (without importing torch: one exists only once torch is imported).
    Another thread may be importing torch right now (a weights thread asking for torch arrays):
    a module without its ``Tensor`` yet has made no tensor the caller could hold."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(x, tensor)


def is_device_array(x: Any) -> bool:
    """True for CUDA tensors and anything exposing ``__cuda_array_interface__``."""
    if is_torch(x):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def as_host_array(x: Any) -> tuple[np.ndarray, str]:
    """A numpy view (or, for device memory, a host copy) of ``x`` and its wire dtype name.

    bfloat16 tensors come back as a uint16 view of the same bytes.
    """
    if is_torch(x):
        t = x.detach()
        if t.is_cuda:
            t = t.cpu()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return t.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16"
        return t.numpy(), _dtype_name(t.dtype)
    if isinstance(x, np.ndarray):
        return x, _dtype_name(x.dtype)
    if hasattr(x, "__cuda_array_interface__"):  # cupy and friends
        import cupy  # an object with this interface implies a CUDA library is present

        arr = cupy.asnumpy(x)
        return arr, _dtype_name(arr.dtype)
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
        arr = np.from_dlpack(x)
        return arr, _dtype_name(arr.dtype)
    arr = np.asarray(x)
    if arr.dtype == np.float64 and isinstance(x, float):
        arr = arr.astype(np.float32)  # a bare Python float is a float32 reward, as in RL libs
    if arr.dtype.kind == "i" and isinstance(x, int) and not isinstance(x, bool):
        arr = arr.astype(np.int64)
    return arr, _dtype_name(arr.dtype)


def field_array(name: Any, value: Any) -> tuple[np.ndarray, str]:
    """:func:`as_host_array` of a step's field ``name``; what cannot be an array of an allowed
    dtype (``"hello"``, a ragged list, an object) is a :class:`SchemaMismatch` naming the field."""
    try:
        return as_host_array(value)
    except SchemaMismatch as exc:
        raise SchemaMismatch(f"field {name!r}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise SchemaMismatch(f"field {name!r}: a {type(value).__name__} that is no array: {exc}") from exc


def host_array(x: Any) -> np.ndarray:
    """Any framework's array (numpy, JAX, TensorFlow, cupy, anything with ``__dlpack__`` or the
    array interface) as a host numpy array: a view where the framework lends its memory, a copy
    for device memory. bfloat16 comes back as ml_dtypes' bfloat16 (what JAX and TensorFlow use)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__") or is_torch(x):
        return as_host_array(x)[0]
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError, ValueError):
            pass  # a dtype DLPack cannot carry to numpy (bfloat16), or device memory: asarray copies
    return np.asarray(x)


def infer_schema(step: Mapping[str, Any], *, leading_dims: int = 0) -> Schema:
    """Infer a schema from one step (``leading_dims=1`` for a chunk with a time axis)."""
    if not isinstance(step, Mapping) or not step:
        raise SchemaMismatch("a step must be a non-empty mapping of field name -> array")
    specs = []
    for name, value in step.items():
        arr, dtype = field_array(name, value)
        if arr.ndim < leading_dims:
            raise SchemaMismatch(f"field {name!r} has {arr.ndim} dims; expected a leading time axis")
        specs.append(FieldSpec(str(name), dtype, tuple(int(d) for d in arr.shape[leading_dims:])))
    return Schema(tuple(specs))


def torch_dtype(name: str) -> Any:
    """The torch dtype of a wire dtype name (torch is imported only when this is called)."""
    import torch

    return {"bool": torch.bool}.get(name) or getattr(torch, name)


def typed_view(raw: Any, dtype: Any, *shape: int) -> Any:
    """A uint8 torch tensor's bytes as ``dtype`` in ``shape``, without a copy. A field of zero
    bytes (a dimension of size 0) gets an empty tensor: torch cannot view zero bytes as a
    wider dtype."""
    if raw.numel() == 0:
        return raw.new_empty(shape, dtype=dtype)
    return raw.view(dtype).view(*shape)
