"""The learner's optional Prometheus endpoint.

A custom collector reads the learner's own counters when Prometheus scrapes (on the learner's
I/O loop, like ``stats()``), so the data path pays nothing per frame; each learner has its own
registry and HTTP server thread, so several learners in one process never collide.
``prometheus_client`` is imported only when a learner asks for metrics.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..errors import ConfigError, RLinkError
from ..transport.address import format_address, is_loopback
from ..transport.session_state import SessionState
from .counters import LATENCY_BOUNDS, PUBLISH_BOUNDS, STALENESS_BOUNDS, FetchTimings, cumulative

log = logging.getLogger(__name__)


def require_prometheus() -> None:
    """Raise :class:`ConfigError` naming the extra to install if prometheus_client is missing."""
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError('learner metrics need prometheus_client: pip install "rlink-ucx[metrics]"')


def sample(server: Any, timings: FetchTimings | None) -> dict[str, Any]:
    """Every number the endpoint serves, read from a ``LearnerServer`` (on its I/O loop)."""
    open_sessions = [s for s in server.sessions.values() if s.state is SessionState.OPEN]
    per_actor, total = server.totals.read((s.actor_id, s.stats) for s in server.sessions.values())
    ring = server.ring
    weights = server.publisher.snapshot_stats()
    out: dict[str, Any] = {
        "rank": server.rank,
        "connected_actors": len(open_sessions),
        "handshakes_in_flight": server.admission.in_flight,
        "shed_handshakes": server.admission.shed,
        "shed_handshakes_per_peer": server.admission.shed_per_peer,
        "preauth_timeouts": server.admission.timed_out,
        "auth_failures": server.admission.auth_failures,
        "rejected_connections": server.admission.rejected,
        "reconnects": server.totals.reconnects,
        "lost_sessions": server.totals.lost_sessions,
        "per_actor": per_actor,
        "total": total,
        "torn_frames": ring.stats.torn_frames if ring else 0,
        "stale_dropped": ring.stats.stale_dropped if ring else 0,
        "buffer_used_bytes": ring.buffered_bytes if ring else 0,
        "buffer_capacity_bytes": ring.capacity * ring.step_bytes if ring else 0,
        "ready_steps": ring.ready_steps() if ring else 0,
        "version": server.version,
        "weights": {k: weights.get(k) or 0 for k in
                    ("published", "fanouts", "fanout_failures", "streamed", "streamed_bytes", "from_peers",
                     "relayed", "last_fanout_seconds")},
        "staleness": cumulative(STALENESS_BOUNDS, dict(server.staleness.counts)),
    }  # fmt: skip
    if timings is not None:
        out["latency"] = timings.latency.read()
        out["put_latency"] = timings.put_latency.read()
        out["fetch"] = timings.fetch.read()
        out["publish"] = timings.publish.read()
    return out


_COUNTERS = (  # (name, help, key in sample()["total"] or sample())
    ("rlink_frames_received", "Data frames received from actors.", "total.frames"),
    ("rlink_steps_received", "Steps received from actors.", "total.steps"),
    ("rlink_bytes_received", "Payload bytes received from actors.", "total.bytes"),
    ("rlink_duplicate_steps", "Steps an actor resent after a reconnect that had already arrived (dropped).",
     "total.duplicate_steps"),
    ("rlink_lost_steps", "Steps a reconnecting actor could not resend (it kept no copy).", "total.lost_steps"),
    ("rlink_protocol_errors", "Sessions dropped for breaking the protocol.", "total.protocol_errors"),
    ("rlink_credit_exhausted", ("Frames after which the sending actor held no credit (its next put waits for "
                                "a grant: the learner is not consuming fast enough)."), "total.credit_exhausted"),
    ("rlink_torn_frames", "Frames whose sender vanished mid-transfer (never delivered).", "torn_frames"),
    ("rlink_stale_steps_dropped", "Steps dropped for being older than the dataset's max_staleness.",
     "stale_dropped"),
    ("rlink_auth_failures", "Connections refused for a failed authentication.", "auth_failures"),
    ("rlink_shed_handshakes", "Connections dropped or refused before authenticating (either cap).",
     "shed_handshakes"),
    ("rlink_shed_handshakes_per_peer", "Of those, by the per-address cap (max_handshakes_per_peer).",
     "shed_handshakes_per_peer"),
    ("rlink_preauth_timeouts", "Connections dropped for not authenticating within preauth_timeout.",
     "preauth_timeouts"),
    ("rlink_rejected_connections", "Actors turned away at max_connections.", "rejected_connections"),
    ("rlink_reconnects", "Sessions that resumed an actor's stream after a reconnect.", "reconnects"),
    ("rlink_lost_sessions", "Actor sessions that ended without a goodbye.", "lost_sessions"),
    ("rlink_weights_published", "Versions published.", "weights.published"),
    ("rlink_weights_fanouts", "Weight fan-outs finished.", "weights.fanouts"),
    ("rlink_weights_fanout_failures", "Versions not every subscribed actor confirmed within weights_timeout.",
     "weights.fanout_failures"),
    ("rlink_weights_streamed", "Versions sent on actors' weights streams.", "weights.streamed"),
    ("rlink_weights_streamed_bytes", "Bytes of weights sent on actors' weights streams.", "weights.streamed_bytes"),
    ("rlink_weights_from_peers", "Versions actors read from a copy another actor of their host holds.",
     "weights.from_peers"),
    ("rlink_weights_relayed", "Versions actors took from the relay of the host before them.", "weights.relayed"),
)  # fmt: skip
_GAUGES = (
    ("rlink_connected_actors", "Actors connected now.", "connected_actors"),
    ("rlink_handshakes_in_flight", "Connections still handshaking.", "handshakes_in_flight"),
    ("rlink_buffer_used_bytes", "Bytes held in the learner's receive ring.", "buffer_used_bytes"),
    ("rlink_buffer_capacity_bytes", "Size of the learner's receive ring.", "buffer_capacity_bytes"),
    ("rlink_ready_steps", "Steps ready for the dataset to fetch.", "ready_steps"),
    ("rlink_policy_version", "The newest published policy version.", "version"),
    ("rlink_weights_last_fanout_seconds", "How long the last weight fan-out took.", "weights.last_fanout_seconds"),
)
_BOUNDS = {"latency": LATENCY_BOUNDS, "put_latency": LATENCY_BOUNDS, "fetch": LATENCY_BOUNDS, "publish": PUBLISH_BOUNDS,
           "staleness": STALENESS_BOUNDS}  # fmt: skip
_HISTOGRAMS = (  # (name, help, key in sample() and _BOUNDS)
    ("rlink_put_to_fetch_seconds", ("Per step: time from the actor's put (its frame's first step; the actor's "
                                    "wall clock) to being handed out by RLinkDataset.fetch."), "put_latency"),
    ("rlink_receive_to_fetch_seconds", ("Per step: time from landing in the learner's ring to being handed out "
                                        "by RLinkDataset.fetch."), "latency"),
    ("rlink_fetch_seconds", "Per batch: how long RLinkDataset.fetch took, waiting for steps included.", "fetch"),
    ("rlink_publish_seconds", "Per Learner.publish call: how long it blocked the caller.", "publish"),
    ("rlink_fetched_staleness", "Per fetched step: learner version minus the step's policy version.", "staleness"),
)  # fmt: skip


def _get(s: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        s = s[part]
    return s


def families(s: dict[str, Any]) -> Iterator[Any]:
    """Prometheus metric families for one :func:`sample`; each carries the learner's ``rank``
    (0 for a lone learner), so the ranks of a job of many add up in one query."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    rank = str(s.get("rank", 0))
    yield _one(GaugeMetricFamily("rlink_up", _UP, labels=["rank"]), rank, 1)
    for name, doc, key in _COUNTERS:
        yield _one(CounterMetricFamily(name, doc, labels=["rank"]), rank, _get(s, key))
    for name, doc, key in _GAUGES:
        yield _one(GaugeMetricFamily(name, doc, labels=["rank"]), rank, _get(s, key))
    for metric, what in (("steps", "Steps"), ("bytes", "Payload bytes"), ("frames", "Data frames")):
        family = CounterMetricFamily(f"rlink_actor_{metric}_received",
                                     f'{what} received per actor (the first actors seen; the rest as actor="other").',
                                     labels=["rank", "actor"])  # fmt: skip
        for label, row in sorted(s["per_actor"].items()):
            family.add_metric([rank, label], row[metric])
        yield family
    for name, doc, key in _HISTOGRAMS:
        if key not in s:
            continue
        cum, total = s[key]
        les = [repr(float(b)) for b in _BOUNDS[key]] + ["+Inf"]
        histogram = HistogramMetricFamily(name, doc, labels=["rank"])
        histogram.add_metric([rank], buckets=list(zip(les, cum)), sum_value=total)
        yield histogram


_UP = "1 when the learner answered this scrape."


def _one(family: Any, rank: str, value: float) -> Any:
    family.add_metric([rank], value)
    return family


class MetricsServer:
    """The HTTP endpoint (``GET /metrics``) of one learner, on a thread of its own."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict[str, Any]], rank: int = 0):
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.registry import Collector

        class _LearnerCollector(Collector):
            def collect(self) -> Iterator[Any]:
                try:
                    s = snapshot()
                except RLinkError as exc:  # closing, or the loop is wedged: say so, do not fail the scrape
                    log.debug("metrics scrape found no learner: %s", exc)
                    from prometheus_client.core import GaugeMetricFamily

                    yield _one(GaugeMetricFamily("rlink_up", _UP, labels=["rank"]), str(rank), 0)
                    return
                yield from families(s)

        self.registry = CollectorRegistry(auto_describe=False)  # private: learners never collide
        self.registry.register(_LearnerCollector())
        server_class = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, port, make_wsgi_app(self.registry), server_class, _QuietHandler)
        bound = self._httpd.socket.getsockname()
        self.address = format_address(bound[0], bound[1])
        if not is_loopback(host):
            log.warning("learner metrics served on non-loopback %s without authentication", self.address)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="rlink-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # One blocking accept at a time, not serve_forever: its poll would wake the thread
        # every poll_interval, and close() would wait up to one (0.5 s) for it to notice.
        while not self._stopping:
            self._httpd.handle_request()

    def close(self, timeout: float) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread.is_alive():
            self._stopping = True
            host, port = self._httpd.socket.getsockname()[:2]
            wake = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
            try:  # a connection of our own wakes the accept, and the loop sees the flag
                socket.create_connection((wake, port), timeout=timeout).close()
            except OSError:
                log.debug("could not wake the metrics thread", exc_info=True)
            self._thread.join(timeout)
        self._httpd.server_close()


# Loopback is reachable by every local user, so the endpoint bounds what any client can hold:
# a few requests at a time (a scraper needs one), each read within a few seconds whatever the
# pace of its bytes. Without them one slow client per open file brought the learner to its
# file limit, and honest actors could no longer connect.
MAX_SCRAPES = 8
REQUEST_SECONDS = 5.0


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds up the learner's exit
    # socketserver's default backlog of 5 dropped a scraper's SYN (a 1 s resend) whenever a
    # few strangers' connections waited to be accepted and refused.
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self.refused = 0  # connections closed at once: every slot was taken

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DeadlineSocket(io.RawIOBase):
    """Reads from a socket until a deadline for the whole request, not per ``recv``."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("metrics request not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Writer(io.BufferedIOBase):
    """Writes the answer with a fresh timeout: the request's deadline may be nearly spent."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.settimeout(REQUEST_SECONDS)
        self._sock.sendall(data)
        return len(memoryview(data))


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineSocket(self.connection, time.monotonic() + REQUEST_SECONDS))
        self.wfile = _Writer(self.connection)

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the client was too slow or went away: nothing to answer
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a line on stderr each."""
