"""Wrapped torch modules publish and load under the names of the module the user wrote.

``DistributedDataParallel`` and ``DataParallel`` keep the user's module as ``.module`` and a
``torch.compile``d module (``OptimizedModule``) keeps it as ``._orig_mod``; their state dicts
put that attribute in front of every name, which a plain module on an actor cannot load. The
wrappers are recognised by type, never by the look of a name: a user's own submodule called
``module`` keeps its name. ``FullyShardedDataParallel`` (and ``fully_shard``) hold parameters
in shards, so a full state dict is gathered, a collective every rank joins (every rank calls
``publish``, as docs/multi-learner.md asks).

Only wrapper classes whose module is already imported are looked at: a user who never made
one pays nothing, and rlink never imports ``torch._dynamo`` or ``torch.distributed`` itself.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["inner_module", "module_state_dict"]

# Wrappers nest (a compiled DDP module, DDP of a compiled one); deeper than this is a cycle.
_MAX_DEPTH = 16


def _wrapped(module: Any) -> Any | None:
    """The module that ``module`` wraps, if it is a DDP, DataParallel or compiled wrapper."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return module.module
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        return module._orig_mod
    return None


def inner_module(module: Any) -> Any:
    """The module under any DDP / DataParallel / ``torch.compile`` wrappers around ``module``
    (``module`` itself when it is not wrapped): the one whose parameter names actors use.

    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(policy)
        >>> inner_module(torch.compile(ddp)) is policy
        True
    """
    for _ in range(_MAX_DEPTH):
        inner = _wrapped(module)
        if inner is None:
            return module
        module = inner
    raise ConfigError(f"{type(module).__name__}: more than {_MAX_DEPTH} nested module wrappers")


def _sharded(module: Any) -> bool:
    """Does FSDP (``FullyShardedDataParallel`` or ``fully_shard``) manage any part of ``module``?"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return False
    kinds = tuple(k for k in (getattr(fsdp, "FullyShardedDataParallel", None), getattr(fsdp, "FSDPModule", None)) if k)
    return any(isinstance(m, kinds) for m in module.modules())


def module_state_dict(module: Any) -> Mapping[str, Any]:
    """The full state dict of a torch module under the inner module's names (see
    :func:`inner_module`); an FSDP module's shards are gathered into whole tensors on every rank.

    Raises:
        ConfigError: an FSDP module whose full state dict cannot be gathered (parameters
            still on the meta device, a process group that is gone), with torch's error chained.
    """
    inner = inner_module(module)
    if not _sharded(inner):
        state: Mapping[str, Any] = inner.state_dict()
        return state
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload=False: with it, only rank 0 would get the tensors, and every rank publishes.
        full: Mapping[str, Any] = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True))
    except Exception as exc:
        raise ConfigError(
            f"publish(): cannot gather the full state dict of the FSDP-sharded {type(inner).__name__} "
            f"({type(exc).__name__}: {exc}); every rank must call publish() together, while its process "
            "group lives and with its parameters materialized (not on the meta device), or publish a state "
            "dict it gathered itself"
        ) from exc
    return full
