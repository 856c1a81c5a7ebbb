"""The learner's step source: the receiving end of the actors' step channels.

The actor sends through a :class:`~oakemu_core.transport.channels.StepChannel`; the learner reads
through a :class:`SocketStepSource`: one multipart message from its PULL socket, decoded by a
:class:`~oakemu_core.transport.channels.StepReceiver` (arrays inline or in the sender's step-ring
slot, frame stacks rebuilt) and checked to come from the peer its actor joined from
(:meth:`~oakemu_core.transport.auth.PeerBinding.allows`). The service owns the socket; what is done
with a message is the ingest loop's (:mod:`oakemu_core.algo.ingest_loop`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from oakemu_core.transport.channels import StepReceiver, recv_frames
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.steps import StepMessage

if TYPE_CHECKING:
    from oakemu_core.transport.auth import PeerBinding

__all__ = ["ForeignStep", "Received", "SocketStepSource"]


@dataclass(frozen=True)
class ForeignStep:
    """A decoded step message for ``actor_id`` from another peer than the one it joined from (its
    ring slot, if any, is left alone: it is the actor's own to free)."""

    actor_id: str


Received = StepMessage | MessageRejected | ForeignStep
"""What :meth:`SocketStepSource.receive` read: a message to ingest, a rejection (its ``sender``
names a departed incarnation's message when its header was read), or a foreign step."""


class SocketStepSource:
    """Reads the actors' step messages from the learner's PULL socket.

    Args:
        socket: the PULL socket the actors' step channels connect to (owned by the caller).
        receiver: decodes the messages (step rings, frame stacks).
        peers: the actors' peer bindings.
    """

    def __init__(self, socket: zmq.Socket, receiver: StepReceiver, peers: PeerBinding) -> None:
        self.socket = socket
        self.receiver = receiver
        self.peers = peers

    def receive(self) -> Received | None:
        """The next message, without waiting; None when none is queued."""
        try:
            frames = recv_frames(self.socket)
        except zmq.Again:
            return None
        try:
            message = self.receiver.decode(frames)
        except MessageRejected as error:
            return error
        if not self.peers.allows(message.actor_id, message.incarnation, frames[0]):
            return ForeignStep(message.actor_id)
        return message

    def holding(self, message: StepMessage) -> AbstractContextManager[None]:
        """Hold the message's ring slot while it is ingested (:meth:`StepReceiver.holding`)."""
        return self.receiver.holding(message)
