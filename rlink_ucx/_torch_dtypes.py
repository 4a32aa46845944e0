"""Wire dtype names <-> torch dtypes (kept apart so the codec never imports torch)."""

from __future__ import annotations

from typing import Any


def torch_dtype(name: str) -> Any:
    import torch

    return {"bool": torch.bool}.get(name) or getattr(torch, name)
