"""An actor pointed at a port where no rlink learner listens says so: at once when the service
there speaks first (SSH, a banner), and by name when it waits for the client (HTTP)."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from rlink_ucx import Actor, Config, ConnectError

TOKEN = "not-a-learner-token-" + "x" * 12


@pytest.mark.timeout(60)
def test_a_service_that_speaks_first_is_refused_at_once_as_not_an_rlink_learner():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def banner() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
            conn.close()

    threading.Thread(target=banner, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port} is not an rlink learner"):
            Actor(f"127.0.0.1:{port}", token=TOKEN, transport="tcp", config=Config(connect_timeout=30))
    finally:
        server.close()
    assert time.monotonic() - started < 5  # not connect_timeout's 30 s


@pytest.mark.timeout(60)
def test_an_http_server_that_waits_for_the_client_is_named_as_another_service():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ConnectError, match="accepted the connection but sent no rlink challenge"):
            Actor(f"127.0.0.1:{port}", token=TOKEN, transport="tcp",
                  config=Config(connect_timeout=4, handshake_timeout=1))  # fmt: skip
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert time.monotonic() - started < 20


@pytest.mark.timeout(120)
def test_a_step_over_the_learners_limits_names_the_settings_to_raise_and_works_once_raised():
    import numpy as np

    from rlink_ucx import Learner, RLinkDataset, SchemaMismatch

    step = {"obs": np.ones(25_000_000, np.float32)}  # a 100 MB observation
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        with Actor(learner.address, token=TOKEN, transport="tcp") as actor:
            with pytest.raises(SchemaMismatch, match=r"over max_frame_bytes=67108864: start the learner with "
                                                     r"Config\(max_frame_bytes=100000000, buffer_bytes=200000000\)"):
                actor.put(step)
    raised = Config(max_frame_bytes=100_000_000, buffer_bytes=200_000_000)
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=raised) as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        with Actor(learner.address, token=TOKEN, transport="tcp") as actor:
            actor.put(step)
            actor.flush(60)
            batch = dataset.fetch(timeout=60)
        assert batch["obs"].shape == (1, 25_000_000) and float(batch["obs"][0, -1]) == 1.0
