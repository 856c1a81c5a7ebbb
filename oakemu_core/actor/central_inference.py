"""Central inference, the actor's side: its forward passes run by the inference server of ``oakemu
train`` (``actor_inference = "central"``; the server is ``oakemu_services.inference``).

SEED RL's central inference and Sample Factory's policy workers: the actors of the learner's machine
send their observations to ONE process, which runs the forward passes of all of them in batches (on
the GPU when there is one) and answers. :class:`CentralForward` is an inference backend like
:class:`~oakemu_core.policy.numpy_inference.NumpyForward` (it stands in for the model's ``forward``,
:meth:`~oakemu_core.policy.acting.ActorAPI.use_inference_backend`): sampling, log-probs, masks and
the step data stay the actor's.

Each request names the weights the actor acts with, ``(policy_version, revision)`` as its stepper
records them, and the server answers with exactly those weights' outputs, so the synchronous mode's
"act with the weights trained on your rollout" and the learner's first-minibatch ratio check hold as
with a local forward pass. The server follows the learner's weights channel like an actor and keeps
the newest few versions; weights it does not hold (those of the join, which the weights channel never
carries, or ones it missed) it answers ``missing`` for, and the actor sends them with the request
again (:attr:`CentralForward.uploads`).

A server that does not answer within the client's timeout (it crashed, or hangs) raises
:class:`CentralInferenceError`: the actor exits with one line and ``oakemu train`` restarts it. A
request unanswered for :data:`RESEND_S` is sent again, so a server restarted meanwhile answers it.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq

from oakemu_core.policy.weights import weights_to_arrays
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.inference_wire import (
    ForwardRequest,
    InferenceMessage,
    InferencePing,
    InferenceReply,
    decode_inference_message,
    encode_inference_message,
)

if TYPE_CHECKING:
    from oakemu_core.actor.weights import VersionOwner

__all__ = [
    "INFERENCE_ADDRESS_ENV",
    "PROBE_TOLERANCE",
    "READY_PATIENCE_S",
    "RESEND_S",
    "CentralForward",
    "CentralInferenceError",
    "InferenceClient",
]

INFERENCE_ADDRESS_ENV = "OAKEMU_INFERENCE_ADDRESS"
"""The variable ``oakemu train`` sets for its actors and its inference server: the server's address
(``ipc://`` in a private temporary folder)."""
READY_PATIENCE_S = 120.0
"""How long an actor waits for its inference server to come up (it loads torch and builds its model
while the learner starts)."""
RESEND_S = 2.5
"""A request unanswered for this long is sent again (a restarted server never got it)."""
PROBE_TOLERANCE = 1e-4
"""Relative and absolute tolerance between the server's outputs and the actor's own model on a probe
batch when the backend is built (float32 on either device; TF32 is off on the server)."""


class CentralInferenceError(RuntimeError):
    """The inference server did not answer in time, or refused a request (the message says which)."""


class InferenceClient:
    """One actor's DEALER socket to the inference server's ROUTER: a request, its reply.

    Args:
        context: the actor's ZeroMQ context.
        address: the server's address (``ipc://...``).
        name: the actor's id (the server's statistics name its clients by it).
        timeout_s: the longest wait for the answer to one request.
        max_bytes: the longest reply accepted.
        stop: the actor's stop event: a wait for a reply ends when it is set (the request then raises
            :class:`CentralInferenceError`); None: waits are not stopped.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        *,
        name: str,
        timeout_s: float,
        max_bytes: int,
        stop: threading.Event | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.stop = stop
        self._next_id = 0
        self.socket = context.socket(zmq.DEALER)
        self.socket.routing_id = f"{name}/{uuid.uuid4().hex[:8]}".encode()
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def request(
        self, message: ForwardRequest | InferencePing, timeout_s: float | None = None
    ) -> InferenceReply | None:
        """Send ``message`` (its ``request_id`` is this client's next one) and return the reply to it;
        sent again after each :data:`RESEND_S` without one; None after ``timeout_s`` (default: the
        client's). Replies to earlier requests are dropped; an ``error`` for a request the server
        could not read (too large, say) is the reply to this one.

        Raises:
            CentralInferenceError: the server's reply is malformed, or the stop event was set.
        """
        frame = encode_inference_message(message)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        resend_at = 0.0
        while (now := time.monotonic()) < deadline:
            if self.stop is not None and self.stop.is_set():
                raise CentralInferenceError("stopped while waiting for the inference server")
            if now >= resend_at:
                self.socket.send(frame, copy=False)
                resend_at = now + RESEND_S
            wait_s = min(deadline, resend_at, now + 0.1) - now  # the stop event is read every 0.1 s
            if not self.socket.poll(max(1, int(wait_s * 1000))):
                continue
            reply = self._receive()
            if isinstance(reply, InferenceReply) and reply.request_id in (message.request_id, 0):
                return reply  # 0: the server could not read a request (one at a time: this one)
        return None

    def _receive(self) -> InferenceMessage:
        try:
            return decode_inference_message(self.socket.recv(copy=False).buffer, self.max_bytes)
        except MessageRejected as error:
            raise CentralInferenceError(
                f"malformed reply from the inference server at {self.address}: {error}"
            ) from None

    def new_id(self) -> int:
        """The id of this client's next request."""
        self._next_id += 1
        return self._next_id

    def wait_ready(self, stop: threading.Event, patience_s: float = READY_PATIENCE_S) -> str:
        """Ping the server until it answers ``ready`` (its model is built): returns its device.

        Raises:
            CentralInferenceError: no answer within ``patience_s``, or ``stop`` was set meanwhile.
        """
        deadline = time.monotonic() + patience_s
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                reply = self.request(InferencePing(self.new_id()), timeout_s=1.0)
            except CentralInferenceError:
                if stop.is_set():
                    break
                raise
            if reply is not None and reply.status == "ready":
                return reply.detail
        what = (
            "stopped while waiting for"
            if stop.is_set()
            else f"no answer within {patience_s:.0f} s from"
        )
        raise CentralInferenceError(f"{what} the inference server at {self.address}")

    def close(self) -> None:
        self.socket.close(linger=0)


class CentralForward:
    """``model.forward`` run by the inference server, with the contract of
    :meth:`~oakemu_core.policy.models.ActorCritic.forward`: observations ``(B, *shape)`` CPU tensors (or
    a dict of them) and a recurrent model's state -> ``(head output (B, param_size) float32, values
    (B,) float32)`` CPU tensors, plus the next state ``(B, state_size)`` float32 for a recurrent model.

    The weights a request names are ``(policy_version, weights_revision)`` of the actor's stepper
    (:meth:`follow`: the one record of the weights loaded), before it exists ``policy_version`` given
    here (the join's weights, revision 0).

    Args:
        model: the actor's CPU model with the weights it acts with (sent when the server lacks them).
        client: the actor's connection to the server.
        policy_version: the version of ``model``'s weights (the join's).

    Raises:
        CentralInferenceError: the server did not answer, refused, or its outputs on a probe batch
            differ from ``model``'s by more than :data:`PROBE_TOLERANCE` (a model with one
            observation key is probed).
    """

    numpy_outputs = True
    """The outputs are CPU tensors over numpy arrays (``ActorCritic.act`` then samples in numpy)."""

    def __init__(self, model: Any, client: InferenceClient, *, policy_version: int) -> None:
        self._model = model
        self.client = client
        self._first_version = int(policy_version)
        self._owner: VersionOwner | None = None
        self.uploads = 0
        """Requests sent again with the weights (the server did not hold them)."""
        if not model.is_dict:
            try:
                model.check_inference_backend(
                    self, what="actor_inference='central'", tolerance=PROBE_TOLERANCE
                )
            except ValueError as error:
                raise CentralInferenceError(str(error)) from None

    def follow(self, owner: VersionOwner) -> None:
        """Name the weights of ``owner``'s ``(policy_version, weights_revision)`` from now on."""
        self._owner = owner

    @property
    def weights_key(self) -> tuple[int, int]:
        """``(policy_version, revision)`` of the weights the actor acts with."""
        owner = self._owner
        return (
            (self._first_version, 0)
            if owner is None
            else (owner.policy_version, owner.weights_revision)
        )

    def load(self, model: Any) -> None:
        """New weights were loaded into ``model``: nothing to copy (the server holds the weights;
        requests name them by version)."""
        self._model = model

    def __call__(
        self, observations: Any, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        arrays = (
            {key: tensor.numpy() for key, tensor in observations.items()}
            if isinstance(observations, dict)
            else {"": observations.numpy()}
        )
        state_array = None if state is None else state.numpy()
        reply = self._forward(arrays, state_array, weights=None)
        if reply.status == "missing":  # the server lacks these weights: send them with the request
            self.uploads += 1
            reply = self._forward(arrays, state_array, weights=weights_to_arrays(self._model))
        expected = 2 if state is None else 3
        if reply.status != "outputs" or len(reply.outputs) != expected:
            detail = reply.detail or f"{reply.status} with {len(reply.outputs)} outputs"
            raise CentralInferenceError(
                f"the inference server at {self.client.address} refused a forward pass of policy "
                f"version {self.weights_key[0]}: {detail}"
            )
        return tuple(torch.from_numpy(np.array(output)) for output in reply.outputs)

    def _forward(
        self,
        observations: dict[str, np.ndarray],
        state: np.ndarray | None,
        weights: dict[str, np.ndarray] | None,
    ) -> InferenceReply:
        version, revision = self.weights_key
        request = ForwardRequest(
            self.client.new_id(), version, revision, observations, state, weights
        )
        reply = self.client.request(request)
        if reply is None:
            raise CentralInferenceError(
                f"the inference server at {self.client.address} did not answer within "
                f"{self.client.timeout_s:.0f} s"
            )
        return reply
