"""Files only their user may read: created mode 0600, in directories of mode 0700, whatever the
process's umask. The learner's generated tokens (``session/tokens.py``) and replay checkpoints
(``replay/checkpoint.py``) are kept this way: a checkpoint holds the actors' trajectories, as
private as the token that let them in."""

from __future__ import annotations

import os

__all__ = ["create_private", "make_private_dir"]

FILE_MODE = 0o600
DIR_MODE = 0o700


def create_private(path: str | os.PathLike[str]) -> int:
    """Create ``path`` for writing (never an existing file, never through a link), mode 0600;
    returns its descriptor. ``FileExistsError``/``OSError`` as ``os.open`` raises them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        # The umask only takes bits away; one that leaves 0600 short (0o277) must not leave
        # the owner unable to read what it wrote.
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create the directory ``path`` (not its parents), mode 0700. ``FileExistsError`` where
    something is there already."""
    os.mkdir(path, DIR_MODE)
    os.chmod(path, DIR_MODE, follow_symlinks=False)  # just made by us: the umask may have left it 0o500
