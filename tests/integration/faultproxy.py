"""A userspace TCP proxy that misbehaves on purpose: delay, blackhole, cut, duplicate, truncate."""

from __future__ import annotations

import socket
import threading
import time


class FaultProxy:
    """Forwards every connection to ``target``. While a fault is switched on it applies to the
    actor -> learner direction of every connection (and new ones):

    - ``delay``: each chunk waits ``delay`` seconds first (both directions);
    - ``blackhole``: chunks are swallowed (the connections stay open);
    - ``cut``: chunks are swallowed in both directions (a link cut that TCP does not notice);
    - ``duplicate``: the next data chunk (256 bytes or more: a data frame, not a control message)
      is sent twice, once;
    - ``truncate``: the connection carrying the next data chunk is cut half way through it, once.
    """

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.fault: str | None = None
        self.delay = 0.0
        self.events: list[str] = []
        self.accepted = 0  # connections forwarded so far (a test waits for a reconnect attempt)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, fault: str | None, delay: float = 0.0) -> None:
        with self._lock:
            self.fault, self.delay = fault, delay

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_learner: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                with self._lock:
                    fault, delay = self.fault, self.delay
                    if to_learner and fault in ("duplicate", "truncate"):
                        if len(chunk) < 256:
                            fault = None  # a control message: wait for a data frame
                        else:
                            self.fault = None  # one-shot
                if delay:
                    time.sleep(delay)
                if (to_learner and fault == "blackhole") or fault == "cut":
                    continue
                if to_learner and fault == "duplicate":
                    self.events.append("duplicated")
                    dst.sendall(chunk)
                if to_learner and fault == "truncate":
                    self.events.append("truncated")
                    dst.sendall(chunk[: len(chunk) // 2])
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
