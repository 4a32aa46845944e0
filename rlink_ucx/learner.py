"""The learner: accepts actors, buffers their steps, and serves them to datasets."""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from .config import Config, resolve, resolve_token
from .errors import Closed, ConfigError
from .session.learner_server import LearnerServer
from .transport import check_transport
from .transport.address import format_address, is_loopback, parse_endpoint
from .transport.loop import IOThread
from .wire.codec import Schema

log = logging.getLogger(__name__)

__all__ = ["Learner"]


class Learner:
    """Accepts actor connections and buffers their steps for :class:`RLinkDataset`.

    Args:
        address: ``host:port`` to listen on (``[::1]:8443`` for IPv6; a ``tcp://``, ``ucx://``,
            ``shm://`` or ``rlink://`` prefix names the transport). Port 0 picks a free port;
            read the real one from :attr:`address`. Binding a non-loopback host requires a token.
        token: shared secret for the mutual HMAC handshake (default: ``RLINK_TOKEN`` or the
            0600 file named by ``RLINK_TOKEN_FILE``).
        transport: ``"auto"`` (per actor: ``shm`` on this host, ``ucx`` where UCX has RDMA or
            CUDA transports, ``tcp`` otherwise), or ``"tcp"``, ``"ucx"``, ``"shm"`` for all.
        config: timeouts and caps; defaults from ``RLINK_*`` environment variables.
        schema: optional declaration ``{"obs": ("float32", (4,)), ...}``; otherwise the first
            actor's schema is accepted.

    Closing the learner (``close()``, the end of a ``with`` block, or the end of the process)
    tells every actor, whose next call then raises :class:`Closed`.

    Example::

        with Learner("127.0.0.1:0") as learner:
            print(learner.address)

    Raises:
        ConfigError: bad address/transport, or a non-loopback bind without a token.
    """

    def __init__(self, address: str = "127.0.0.1:8443", *, token: str | bytes | None = None,
                 transport: str = "auto", config: Config | None = None,
                 schema: dict[str, Any] | Schema | None = None):  # fmt: skip
        self.config = resolve(config)
        check_transport(transport)
        host, port, transport = parse_endpoint(address, transport)  # the address first: a typo is a typo
        self._token = resolve_token(token)
        if self._token is None and not is_loopback(host):
            raise ConfigError(
                f"refusing to listen on non-loopback address {host!r} without a token: pass token=... "
                "or set RLINK_TOKEN (the data would otherwise be open to the network)"
            )
        declared = Schema.from_spec(schema) if isinstance(schema, dict) else schema
        self._closed = False
        self._io = IOThread(name="rlink-learner-io")
        self._server = LearnerServer(host, port, token=self._token, transport=transport, config=self.config,
                                     loop=self._io.loop, schema=declared)  # fmt: skip
        try:
            self._io.call(self._server.start(), self.config.connect_timeout, "learner start")
        except OSError as exc:
            self._io.stop(self.config.close_timeout)
            raise ConfigError(f"cannot listen on {address}: {exc}") from exc
        except BaseException:
            self._io.stop(self.config.close_timeout)
            raise
        self._address = format_address(host, self._server.port)
        # Closes at interpreter exit (so actors hear the learner finished) or when collected.
        self._finalizer = weakref.finalize(self, _shutdown, self._server, self._io, self.config)
        log.info("learner listening on %s (transport=%s, auth=%s)", self.address, transport, self._token is not None)

    @property
    def address(self) -> str:
        """The ``host:port`` the learner listens on, with the real port when 0 was asked for."""
        return self._address

    @property
    def port(self) -> int:
        """The port the learner listens on."""
        return self._server.port

    @property
    def version(self) -> int:
        """The current model version (0 until the first publish)."""
        return self._server.version

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, model_or_state_dict: Any, *, wait: bool = False, timeout: float | None = None) -> int:
        """Publish new parameters to every subscribed actor; returns the new version.

        The tensors are copied first, so training may modify them as soon as this returns; the
        fan-out (torch.distributed broadcast in a group of its own, or pulls) runs in the
        background. With ``wait=True``, also wait (up to ``timeout``, default
        ``Config.weights_timeout``) until every live subscriber has the version; an actor that
        does not confirm in time is dropped from the broadcast group and pulls instead.
        """
        self._check_open()
        return self._server.publisher.publish(model_or_state_dict, wait=wait, timeout=timeout)

    def wait_published(self, version: int | None = None, timeout: float | None = None) -> bool:
        """Wait until every live subscriber has ``version`` (default: the newest); False on timeout."""
        return self._server.publisher.wait(self.version if version is None else version, timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the learner is closed")

    def stats(self) -> dict[str, Any]:
        """Per-actor and total counters, buffer use and the data plane chosen for each actor."""
        if self._closed:
            return {"closed": True}
        return self._io.call(self._snapshot(), self.config.close_timeout, "stats")

    async def _snapshot(self) -> dict[str, Any]:
        return self._server.snapshot()

    # Used by RLinkDataset ----------------------------------------------------------------------
    def _wait_ring(self, timeout: float) -> Any:
        """The receive ring, once the schema is known (declared, or from the first actor)."""
        deadline = time.monotonic() + timeout
        while not self._server.ring_ready.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self._closed:
                raise Closed("the learner is closed")
            if time.monotonic() >= deadline:
                return None
        return self._server.ring

    def _actors_done(self) -> bool:
        return self._server.actors_done()

    def _record_staleness(self, counts: dict[int, int]) -> None:
        self._server.staleness.record(counts)

    def _request_pinned(self) -> None:
        self._server.pin_memory = True

    def _hint_batch_size(self, batch_size: int) -> None:
        """Size ring chunks to the batch so CPU batches can be lent without a copy (only
        possible before the first actor's schema creates the ring)."""
        if self._server.batch_steps is None:
            self._server.batch_steps = batch_size

    def close(self) -> None:
        """Tell every actor the learner is finishing (their next call raises ``Closed``),
        disconnect them and stop the I/O thread. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Learner(address={self.address!r}, version={self.version}, closed={self._closed})"


def _shutdown(server: LearnerServer, io: IOThread, config: Config) -> None:
    """Close a learner's server and I/O thread (once: from close(), at exit, or when collected)."""
    server.publisher.close()
    try:
        io.call(server.stop(), config.close_timeout, "learner close")
    except Exception:  # noqa: BLE001 - close must release resources even if the graceful path fails
        log.debug("graceful learner shutdown failed", exc_info=True)
    finally:
        if server.ring is not None:
            server.ring.close()
        io.stop(config.close_timeout)
