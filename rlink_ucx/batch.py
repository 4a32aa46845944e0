"""The read-only batch a dataset hands to the training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from .wire.frameworks import aligned

__all__ = ["Batch", "Host"]


class Host(NamedTuple):
    """A field or metadata array not handed out yet: a numpy view of rlink's host memory and its
    wire dtype name. A :class:`Batch` made with ``convert`` turns each into the dataset's
    framework on first access, so a training step pays for the arrays it reads, not for all."""

    array: Any
    dtype: str


_META = ("version", "actor_id", "seq", "staleness", "index", "weight")


class Batch(Mapping[str, Any]):
    """A read-only mapping of field name -> array of shape ``[batch_size, ...]``: ``torch.Tensor``
    by default, or numpy / JAX / TensorFlow arrays (the dataset's ``format``). From a dataset
    made with ``time_major=True``, fields with a time axis are ``[T, batch_size, ...]``
    (:meth:`time_major`).

    Per-sample metadata rides along as attributes, each an int64 array of shape
    ``[batch_size]`` on the same device (int32 for JAX unless ``jax_enable_x64`` is on):

    - ``version``: the behaviour-policy version that produced the step,
    - ``actor_id`` and ``seq``: which actor sent it, and its position in that actor's stream,
    - ``staleness``: the learner's version at fetch time minus ``version``.

    Batches sampled from a :class:`ReplayDataset` also carry ``index`` (int64 ``[batch_size]``:
    item ids to hand back to ``update_priorities``) and ``weight`` (float32 ``[batch_size]``:
    importance weights); with ``sequence_length=T`` fields and the four metadata tensors are
    ``[batch_size, T, ...]``. Both are None on batches from :class:`RLinkDataset`.

    For formats other than torch each array is made from rlink's host memory when first read
    (``wire/frameworks.py``): fields and metadata you never read cost nothing.
    """

    __slots__ = ("_convert", "_fields", "_meta")

    def __init__(self, fields: dict[str, Any], *, version: Any, actor_id: Any, seq: Any, staleness: Any,
                 index: Any = None, weight: Any = None, convert: Callable[[Any, str], Any] | None = None):  # fmt: skip
        self._fields = fields
        self._meta = {"version": version, "actor_id": actor_id, "seq": seq, "staleness": staleness,
                      "index": index, "weight": weight}  # fmt: skip
        self._convert = convert  # turns a Host value into the framework's array

    def _get(self, store: dict[str, Any], key: str) -> Any:
        value = store[key]
        if type(value) is Host:
            assert self._convert is not None
            value = store[key] = self._convert(value.array, value.dtype)
        return value

    def __getitem__(self, key: str) -> Any:
        return self._get(self._fields, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    version = property(lambda self: self._get(self._meta, "version"), doc="behaviour-policy version per sample")
    actor_id = property(lambda self: self._get(self._meta, "actor_id"), doc="the actor that sent each sample")
    seq = property(lambda self: self._get(self._meta, "seq"), doc="each sample's place in its actor's stream")
    staleness = property(lambda self: self._get(self._meta, "staleness"), doc="learner version minus version")
    index = property(lambda self: self._get(self._meta, "index"), doc="replay item ids (None from RLinkDataset)")
    weight = property(lambda self: self._get(self._meta, "weight"), doc="importance weights (None from RLinkDataset)")

    @property
    def batch_size(self) -> int:
        version = self._meta["version"]
        return int((version.array if type(version) is Host else version).shape[0])

    @property
    def device(self) -> Any:
        return self.version.device

    def head(self, n: int) -> Batch:
        """The first ``n`` samples (views, no copy)."""

        def cut(v: Any) -> Any:
            if v is None:
                return None
            return Host(v.array[:n], v.dtype) if type(v) is Host else v[:n]

        return Batch({k: cut(v) for k, v in self._fields.items()}, convert=self._convert,
                     **{k: cut(v) for k, v in self._meta.items()})  # fmt: skip

    def time_major(self) -> Batch:
        """The batch with every field that has a time axis, ``[B, T, ...]``, as ``[T, B, ...]``
        (contiguous, a copy); fields of one value per step (``[B]``) and the metadata stay
        ``[B]``. What ``RLinkDataset(time_major=True)`` hands out."""

        def swap(v: Any) -> Any:
            if type(v) is Host:
                if v.array.ndim < 2:
                    return v
                out = aligned((v.array.shape[1], v.array.shape[0], *v.array.shape[2:]), v.array.dtype)
                out[...] = v.array.swapaxes(0, 1)
                return Host(out, v.dtype)
            return v.transpose(0, 1).contiguous() if v.ndim >= 2 else v  # a torch tensor (CUDA path)

        return Batch({k: swap(v) for k, v in self._fields.items()}, convert=self._convert, **self._meta)

    def to_tensordict(self) -> Any:
        """The batch as a ``tensordict.TensorDict`` (metadata under ``"_rlink"``)."""
        try:
            from tensordict import TensorDict
        except ImportError as exc:
            raise ImportError('Batch.to_tensordict() needs tensordict: pip install "rlink-ucx[torch]" tensordict') from exc
        meta = {k: getattr(self, k) for k in _META if self._meta[k] is not None}
        return TensorDict({**dict(self.items()), "_rlink": meta}, batch_size=[self.batch_size], device=self.device)

    def __repr__(self) -> str:
        def describe(v: Any) -> str:
            return f"{tuple(v.array.shape)} {v.dtype}" if type(v) is Host else f"{tuple(v.shape)} {v.dtype}"

        fields = ", ".join(f"{k}: {describe(v)}" for k, v in self._fields.items())
        return f"Batch(batch_size={self.batch_size}, device={self.device}, {{{fields}}})"
