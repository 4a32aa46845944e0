"""An actor for the one-copy-per-host tests, started on a "host" of its own (a UTS namespace
with its own host name, ``unshare --uts``; same network and PID namespace as the learner).

    python -m tests.integration.host_copy_actor ADDRESS ACTOR_ID [alter | alter-relay]

It reads every version with ``newer_than`` until the learner closes, checks each bit for bit
against the learner's (``np.full(n, version)``), and prints one line per version and, at the
end, its weights stats as JSON. With ``alter``, it flips a byte of every version after 1 in
its own copy, after verifying it and before confirming it (a hostile actor holding the token):
what its host's peers would read from it. With ``alter-relay``, it flips the first byte of
every piece of a version after 1 that it passes on to another host's actor as a relay
(``weights/relay.py``), keeping its own copy intact.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def alter_every_copy() -> None:
    from rlink_ucx.weights import subscriber

    expose = subscriber.Subscriber._expose

    def altered(self, snap):  # type: ignore[no-untyped-def]
        if snap.shared is not None and snap.version > 1:
            snap.flat[0] ^= 0xFF
        expose(self, snap)

    subscriber.Subscriber._expose = altered  # type: ignore[method-assign]


class _Flipping:
    """A relay reader's socket that flips the first byte of each piece of a version after 1."""

    def __init__(self, sock) -> None:  # type: ignore[no-untyped-def]
        self._sock, self._version = sock, 0

    def sendall(self, data) -> None:  # type: ignore[no-untyped-def]
        if len(data) >= 4096 and self._version > 1:  # a piece (the Publish header is smaller)
            data = bytearray(data)
            data[0] ^= 0xFF
        elif len(data) < 4096:
            from rlink_ucx.wire import messages

            msg = messages.decode(bytes(data)[messages.LENGTH.size :])
            self._version = msg.manifest.version if isinstance(msg, messages.Publish) else self._version
        self._sock.sendall(data)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._sock, name)


def alter_what_it_relays() -> None:
    from rlink_ucx.weights import relay

    forward = relay.RelayServer._forward

    def flipping(self, reader):  # type: ignore[no-untyped-def]
        reader.sock = _Flipping(reader.sock)
        forward(self, reader)

    relay.RelayServer._forward = flipping  # type: ignore[method-assign]


def main(address: str, actor_id: int, mode: str = "") -> None:
    from rlink_ucx import Actor, Closed

    if mode == "alter":
        alter_every_copy()
    elif mode == "alter-relay":
        alter_what_it_relays()

    with Actor(address, transport="tcp", actor_id=actor_id) as actor:
        version = 0
        try:
            while True:
                state, version = actor.get_remote_model(timeout=120, format="numpy", newer_than=version)
                w = state["w"]
                exact = w.dtype == np.float32 and bool(np.all(w == np.float32(version)))
                print(f"version {version} {'exact' if exact else 'WRONG'}", flush=True)
        except Closed:
            pass
        print("stats " + json.dumps(actor.stats()["weights"]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
