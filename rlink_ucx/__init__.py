"""rlink_ucx: a fast, secure communication layer between RL actors and a learner.

Actors ``put`` steps; the learner reads batches, already on its device, from
:class:`RLinkDataset`. See the README for a two-minute tour.
"""

from __future__ import annotations

import logging
from typing import Any

from ._version import __version__
from .actor import Actor
from .batch import Batch
from .config import Config
from .errors import (
    AuthError,
    Backpressure,
    Closed,
    ConfigError,
    ConnectError,
    PeerLost,
    ProtocolError,
    RLinkError,
    SchemaMismatch,
    Superseded,
    TimeoutError,
)
from .learner import Learner
from .session.tokens import read_token_file
from .wire.codec import FieldSpec, Schema

__all__ = [
    "Actor",
    "AuthError",
    "Backpressure",
    "Batch",
    "Closed",
    "Config",
    "ConfigError",
    "ConnectError",
    "FieldSpec",
    "Learner",
    "PeerLost",
    "ProtocolError",
    "RLinkDataset",
    "RLinkError",
    "ReplayDataset",
    "Schema",
    "SchemaMismatch",
    "Superseded",
    "TimeoutError",
    "__version__",
    "read_token_file",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    # RLinkDataset and ReplayDataset subclass torch's IterableDataset; importing it lazily keeps
    # `import rlink_ucx` free of torch for actors that only use numpy.
    if name == "RLinkDataset":
        from .dataset import RLinkDataset

        return RLinkDataset
    if name == "ReplayDataset":
        from .replay import ReplayDataset

        return ReplayDataset
    raise AttributeError(f"module 'rlink_ucx' has no attribute {name!r}")
