"""Actor side, the control reader: credit, acknowledgements, revokes, weights announcements,
heartbeats and the data plane's Ready from the learner, each handed to the part it concerns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ...errors import Closed, ProtocolError, RLinkError, refusal
from ...transport.plane import map_plane_error
from ...wire import messages as _wire
from .attach import PlaneAttach
from .heartbeat import Heartbeat
from .outbox import Outbox
from .state import LinkState

__all__ = ["ControlReader"]

# Weights messages on the control connection go to the subscriber (a version's bytes come on its
# weights stream or from shared memory).
_WEIGHTS = (_wire.Version, _wire.Mapped, _wire.WeightsKey, _wire.Seal, _wire.RelayServe, _wire.RelayFrom,
            _wire.BroadcastJoin, _wire.Broadcast)


class ControlReader:
    """Reads the learner's control messages on the I/O loop, one connection at a time.

    Args:
        state: the connection's shared state (the control channel, the futures a handshake
            and a proposal wait on, the weights listener).
        outbox: takes credit, revokes and acknowledgements.
        heartbeat: answers the learner's heartbeats.
        attach: checks the data plane's AttachProof and Ready.
        fail: called with the error when the channel breaks or the learner ends the session.
    """

    def __init__(self, state: LinkState, outbox: Outbox, heartbeat: Heartbeat, attach: PlaneAttach,
                 fail: Callable[[RLinkError], None]):  # fmt: skip
        self._state = state
        self._outbox = outbox
        self._heartbeat = heartbeat
        self._attach = attach
        self._fail = fail

    async def run(self) -> None:
        s = self._state
        control = s.control
        assert control is not None
        try:
            while True:
                msg = await control.recv(s.config.max_control_bytes)
                self._heartbeat.heard()
                if isinstance(msg, _wire.Credit):
                    self._outbox.add_credit(msg.steps, msg.acked)
                elif isinstance(msg, _wire.Ack):
                    self._outbox.acknowledged(msg.next_seq)
                elif isinstance(msg, _wire.Revoke):
                    control.send(_wire.Returned(self._outbox.credit.revoke(msg.steps)))
                elif isinstance(msg, _wire.Heartbeat):
                    self._heartbeat.answer()
                elif isinstance(msg, _WEIGHTS):
                    self._on_weights(msg)
                elif isinstance(msg, _wire.AttachProof):
                    self._attach.proof(msg.mac)
                elif isinstance(msg, _wire.Ready):
                    self._attach.ready(msg)
                    if not s.ready.done():
                        s.ready.set_result(msg.transport)
                elif isinstance(msg, (_wire.Accept, _wire.Reject)):
                    if s.proposal is not None and not s.proposal.done():
                        s.proposal.set_result(msg)
                elif isinstance(msg, _wire.Error):
                    raise refusal(msg.kind, f"learner reported: {msg.text}")
                elif isinstance(msg, _wire.Bye):  # the learner is finishing: final, no reconnect
                    raise Closed(f"the learner closed the session ({msg.reason})")
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from the learner")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller's thread
            self._fail(map_plane_error(exc, "control connection broke"))

    def _on_weights(self, msg: Any) -> None:
        s = self._state
        if isinstance(msg, _wire.Version):
            s.latest_version = max(s.latest_version, msg.version)
        elif isinstance(msg, (_wire.Mapped, _wire.Broadcast)):
            s.latest_version = max(s.latest_version, msg.manifest.version)
        if s.weights_listener is not None:
            s.weights_listener(msg)
        elif not isinstance(msg, _wire.Version):
            raise ProtocolError(f"{type(msg).__name__} for an actor that did not subscribe to weights")
