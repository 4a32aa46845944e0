"""The read-only batch a dataset hands to the training loop."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Batch"]


class Batch(Mapping[str, Any]):
    """A read-only mapping of field name -> ``torch.Tensor`` of shape ``[batch_size, ...]``.

    Per-sample metadata rides along as attributes, each an int64 tensor of shape
    ``[batch_size]`` on the same device:

    - ``version``: the behaviour-policy version that produced the step,
    - ``actor_id`` and ``seq``: which actor sent it, and its position in that actor's stream,
    - ``staleness``: the learner's version at fetch time minus ``version``.

    Batches sampled from a :class:`ReplayDataset` also carry ``index`` (int64 ``[batch_size]``:
    item ids to hand back to ``update_priorities``) and ``weight`` (float32 ``[batch_size]``:
    importance weights); with ``sequence_length=T`` fields and the four metadata tensors are
    ``[batch_size, T, ...]``. Both are None on batches from :class:`RLinkDataset`.
    """

    __slots__ = ("_fields", "actor_id", "index", "seq", "staleness", "version", "weight")

    def __init__(self, fields: dict[str, Any], *, version: Any, actor_id: Any, seq: Any, staleness: Any,
                 index: Any = None, weight: Any = None):  # fmt: skip
        self._fields = fields
        self.version = version
        self.actor_id = actor_id
        self.seq = seq
        self.staleness = staleness
        self.index = index
        self.weight = weight

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    @property
    def batch_size(self) -> int:
        return int(self.version.shape[0])

    @property
    def device(self) -> Any:
        return self.version.device

    def head(self, n: int) -> Batch:
        """The first ``n`` samples (views, no copy)."""
        fields = {k: v[:n] for k, v in self._fields.items()}
        return Batch(fields, version=self.version[:n], actor_id=self.actor_id[:n], seq=self.seq[:n],
                     staleness=self.staleness[:n], index=None if self.index is None else self.index[:n],
                     weight=None if self.weight is None else self.weight[:n])  # fmt: skip

    def to_tensordict(self) -> Any:
        """The batch as a ``tensordict.TensorDict`` (metadata under ``"_rlink"``)."""
        try:
            from tensordict import TensorDict
        except ImportError as exc:
            raise ImportError('Batch.to_tensordict() needs tensordict: pip install "rlink-ucx[torch]" tensordict') from exc
        meta = {"version": self.version, "actor_id": self.actor_id, "seq": self.seq, "staleness": self.staleness}
        meta.update({k: v for k, v in (("index", self.index), ("weight", self.weight)) if v is not None})
        return TensorDict({**self._fields, "_rlink": meta}, batch_size=[self.batch_size], device=self.device)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self._fields.items())
        return f"Batch(batch_size={self.batch_size}, device={self.device}, {{{fields}}})"
