"""rlink_ucx: a fast, secure communication layer between RL actors and a learner.

Actors ``put`` steps; the learner reads batches, already on its device, from
:class:`RLinkDataset`. See the README for a two-minute tour.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ._version import __version__
from .actor import Actor
from .batch import Batch
from .config import Config
from .errors import (
    AuthError,
    Backpressure,
    CheckpointError,
    Closed,
    ConfigError,
    ConnectError,
    PeerLost,
    ProtocolError,
    RLinkError,
    RLinkWarning,
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
    "CheckpointError",
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
    "RLinkWarning",
    "ReplayDataset",
    "Schema",
    "SchemaMismatch",
    "Superseded",
    "TimeoutError",
    "__version__",
    "log_to_stderr",
    "read_token_file",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def log_to_stderr(level: int | str = "INFO") -> logging.Handler:
    """Show rlink's log records of ``level`` and above on stderr (the library itself only
    installs a ``NullHandler``). Setting ``RLINK_LOG=INFO`` (or ``DEBUG``, ``WARNING``) in the
    environment does the same at import. Returns the handler, for ``removeHandler``.

    Example:
        >>> import rlink_ucx
        >>> handler = rlink_ucx.log_to_stderr("DEBUG")
    """
    logger = logging.getLogger(__name__)
    level_no = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(level_no, int):
        raise ConfigError(f"log level must be DEBUG, INFO, WARNING or ERROR, not {level!r}")
    for old in [h for h in logger.handlers if getattr(h, "_rlink_stderr", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler._rlink_stderr = True  # type: ignore[attr-defined]  # marks the one handler this function owns
    logger.addHandler(handler)
    logger.setLevel(level_no)
    return handler


if os.environ.get("RLINK_LOG"):
    try:
        log_to_stderr(os.environ["RLINK_LOG"])
    except ConfigError as _exc:  # a typo in a variable must not make the package unimportable
        import warnings

        warnings.warn(f"RLINK_LOG ignored: {_exc}", stacklevel=1)


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
