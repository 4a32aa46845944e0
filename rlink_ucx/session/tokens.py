"""The token a learner generates when it is given none, kept where only its user can read it.

One file per listening port, ``<dir>/<port>.token`` (mode 0600), in a directory of mode 0700
owned by the user: ``Config.token_dir`` when set; else the first of ``$XDG_RUNTIME_DIR/rlink``
(where that variable names a directory of this user closed to others), ``<tmp>/rlink-<uid>``
(``<tmp>`` is ``$TMPDIR`` or ``/tmp``) and ``~/.cache/rlink/tokens`` that is private to the user
or can be made so. Every directory is checked before it is trusted (a real directory, not a
link, owned by this user, closed to group and others): another user can neither read a token
nor plant one, and one who pre-created ``/tmp/rlink-<uid>`` only pushes the token to the next
place. The same user's actors on this host look in the same places, in the same order, at each
connection attempt, so a restarted learner's new token is picked up.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from ..store.private_files import create_private, make_private_dir

MIN_TOKEN_BYTES = 16  # the token as given (a 16-byte secret as hex or base64 is longer)
MAKE_TOKEN = "make one with `rlink token` (or python -c 'import secrets; print(secrets.token_urlsafe(32))')"


def check_token(token: str | bytes, source: str = "the token") -> bytes:
    """``token`` as bytes, refused when empty or shorter than ``MIN_TOKEN_BYTES``.

    The rule counts the bytes of the string as given, so a 16-byte secret written as hex (32
    characters) or base64 (24) passes, and so does any passphrase of 16 characters or more.

    Raises:
        ConfigError: the token is too short to resist guessing.
    """
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if len(raw) < MIN_TOKEN_BYTES:
        what = "empty" if not raw else f"{len(raw)} bytes long"
        raise ConfigError(f"{source} is {what}; a token must be at least {MIN_TOKEN_BYTES} bytes: {MAKE_TOKEN}")
    return raw


def read_token_file(path: str) -> bytes:
    """The token in the file ``path`` (``~`` expanded, surrounding whitespace stripped), which
    must not be accessible by group or others (chmod 600), like an ssh key.

    Raises:
        ConfigError: the file is missing, unreadable, open to others, or holds a short token.
    """
    path = os.path.expanduser(path)  # RLINK_TOKEN_FILE='~/.rlink-token' from compose, k8s, systemd
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"token file {path} is accessible by group/others; chmod 600 it")
        with open(path, "rb") as fh:
            raw = fh.read(64 * 1024).strip()
    except OSError as exc:
        hint = f"; make one with `rlink token --file {path}`" if isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror or exc}{hint}") from exc
    return check_token(raw, f"the token in {path}")


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The token as bytes: the argument, else ``RLINK_TOKEN``, else the file in ``RLINK_TOKEN_FILE``;
    None when none is given (the learner then generates one, see ``Config.token_dir``). Surrounding
    whitespace is stripped from each, as from a token file, so ``open(path).read()`` (with the
    newline ``rlink token --file`` writes) matches ``RLINK_TOKEN_FILE=path`` on the other side.

    Raises:
        ConfigError: the token is shorter than ``MIN_TOKEN_BYTES``, or the file is unusable.
    """
    if token is not None:
        return check_token((token.encode() if isinstance(token, str) else bytes(token)).strip())
    if os.environ.get("RLINK_TOKEN"):
        return check_token(os.environ["RLINK_TOKEN"].strip(), "RLINK_TOKEN")
    if os.environ.get("RLINK_TOKEN_FILE"):
        return read_token_file(os.environ["RLINK_TOKEN_FILE"])
    return None


log = logging.getLogger(__name__)

TOKEN_BYTES = 32  # of randomness; urlsafe base64 makes it 43 characters


def new_token() -> str:
    """A fresh random token (32 bytes from ``secrets``, urlsafe base64)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_dirs(config: Config) -> list[Path]:
    """Where generated tokens may live, in the order a learner and its actors try them."""
    if config.token_dir:
        return [Path(config.token_dir)]
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and _private(Path(xdg)) is None:
        out.append(Path(xdg) / "rlink")
    out.append(Path(tempfile.gettempdir()) / f"rlink-{os.geteuid()}")
    home = Path(os.path.expanduser("~"))
    if home.is_absolute() and _owned(home):  # a shared or foreign HOME would not keep a secret
        out.append(home / ".cache" / "rlink" / "tokens")
    return out


def token_dir(config: Config) -> Path:
    """The directory a learner keeps its generated token in: the first of :func:`token_dirs`
    that is private to this user or does not exist yet (not created or checked here)."""
    candidates = token_dirs(config)
    for directory in candidates:
        if not os.path.lexists(directory) or _private(directory) is None:
            return directory
    return candidates[0]


def token_path(config: Config, port: int) -> Path:
    return token_dir(config) / f"{port}.token"


def _owned(path: Path) -> bool:
    try:
        return os.stat(path).st_uid == os.geteuid()
    except OSError:
        return False


def _private(path: Path, *, is_dir: bool = True) -> str | None:
    """Why ``path`` is not private to this user (None when it is); follows no link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return _why_not_private(path, st, is_dir)


def _why_not_private(path: Path, st: os.stat_result, is_dir: bool) -> str | None:
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        return f"{path} is not a {'directory' if is_dir else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"{path} is open to group/others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _ensure_dir(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        make_private_dir(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the token directory {path}: {exc.strerror or exc}") from exc
    why = _private(path)
    if why is not None:
        raise ConfigError(f"refusing to keep the learner's token in {path}: {why}. Remove it, set "
                          "Config(token_dir=...) / RLINK_TOKEN_DIR to a private directory, or pass a token")  # fmt: skip


def publish(config: Config, port: int, token: bytes) -> Path:
    """Write ``token`` to ``<dir>/<port>.token`` (mode 0600), atomically; returns the path.

    Raises:
        ConfigError: the directory cannot be made private to this user, or written.
    """
    return publish_private(config, f"{port}.token", token + b"\n", "the learner's token")


def publish_private(config: Config, name: str, body: bytes, what: str) -> Path:
    """Write ``body`` to ``<dir>/<name>`` (mode 0600) in the first token directory that is or
    can be made private to this user, atomically; returns the path.

    Raises:
        ConfigError: no directory can be made private to this user, or written.
    """
    candidates = token_dirs(config)
    for i, directory in enumerate(candidates):
        try:
            _ensure_dir(directory)
            break
        except ConfigError as exc:
            if i == len(candidates) - 1:
                raise
            log.warning("%s; keeping the token in %s instead", exc, candidates[i + 1])
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = create_private(tmp)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers never see a half-written file
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {what} to {path}: {exc.strerror or exc}") from exc
    return path


def find(config: Config, port: int) -> tuple[bytes | None, str]:
    """The token a learner of this user published for ``port``, and where it came from; or
    None and why there is none (missing, or a file or directory that is not private). Looks in
    the places :func:`publish` writes to, in its order."""
    raw, where = find_private(config, f"{port}.token")
    if raw is not None and len(raw) < MIN_TOKEN_BYTES:
        return None, f"{where} holds no usable token"
    return raw, where


def find_private(config: Config, name: str) -> tuple[bytes | None, str]:
    """The contents (stripped, at most 4 KiB) of ``<dir>/<name>`` in the first token directory
    that holds it, when directory and file are private to this user; else None and why not."""
    reasons = []
    for directory in token_dirs(config):
        raw, where = _find_in(directory, name)
        if raw is not None:
            return raw, where
        reasons.append(where)
    return None, "; ".join(reasons)


def _find_in(directory: Path, name: str) -> tuple[bytes | None, str]:
    why = _private(directory)
    if why is not None:
        return None, why
    path = directory / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, f"no token file {path}"
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    try:
        why = _why_not_private(path, os.fstat(fd), is_dir=False)
        if why is not None:
            return None, why
        raw = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    return raw, str(path)


def withdraw(path: Path, token: bytes) -> None:
    """Remove the file at ``path`` if it still holds ``token`` (a newer learner on the same port
    may have replaced it: that one stays)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4096).strip() != token:
                return
        path.unlink()
    except OSError:
        pass


def write_new(path: str, token: str) -> None:
    """Create ``path`` holding ``token``, mode 0600 (``rlink token --file``); never overwrites.

    Missing parent directories are made, closed to group and others (``~/.rlink/token``).

    Raises:
        ConfigError: the file exists or cannot be created.
    """
    path = os.path.expanduser(path)
    parent = os.path.dirname(path)
    try:
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, 0o700)
        fd = create_private(path)
    except FileExistsError:
        raise ConfigError(f"{path} exists: remove it first (a token file is never overwritten)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror or exc}") from exc
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
