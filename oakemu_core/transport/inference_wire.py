"""Central inference's messages between an actor's forward passes and the inference server.

With ``actor_inference = "central"`` each actor of ``oakemu train`` sends its forward passes to one
inference server on the learner's machine (``oakemu_services.inference``) over a ZeroMQ DEALER ->
ROUTER pair on a private ``ipc://`` address; sampling, log-probs and masks stay in the actor.

Message types (``"type"`` tag: dataclass, direction):

- ``inference_ping``: :class:`InferencePing`, actor -> server: is the server up (its model built)?
- ``inference_forward``: :class:`ForwardRequest`, actor -> server: observations (and a recurrent
  policy's state) for the weights of ``(policy_version, revision)``; with ``weights`` when the server
  answered ``missing`` for them before;
- ``inference_reply``: :class:`InferenceReply`, server -> actor: the answer to one request, named by its
  ``request_id``: ``ready`` (a ping), ``outputs`` (the model's forward outputs), ``missing`` (the
  server does not hold those weights: send them) or ``error`` (``detail`` says why).

Arrays travel as the codec's array maps (:func:`~oakemu_core.transport.codec.encode_array`); frames
from the wire are decoded with :func:`decode_inference_message`, which raises only
:class:`~oakemu_core.transport.codec.MessageRejected`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oakemu_core.transport.codec import (
    MAX_ID_LENGTH,
    MAX_TEXT_LENGTH,
    check_local_int,
    decode_array,
    describe,
    encode_array,
    get_int,
    get_str,
    header,
    pack,
    reject,
    require_fields,
    unpack,
)

__all__ = [
    "REPLY_STATUSES",
    "ForwardRequest",
    "InferenceMessage",
    "InferencePing",
    "InferenceReply",
    "decode_inference_message",
    "encode_inference_message",
]

TYPE_PING = "inference_ping"
TYPE_FORWARD = "inference_forward"
TYPE_REPLY = "inference_reply"

REPLY_STATUSES = ("ready", "outputs", "missing", "error")
"""What an :class:`InferenceReply` says: the server is up; the outputs; it lacks the weights named;
the request failed."""

MAX_OUTPUTS = 3
"""A forward pass's outputs: head output and values, and a recurrent policy's next state."""


@dataclass(frozen=True)
class InferencePing:
    """Actor -> server: answered ``ready`` once the server serves forward passes."""

    request_id: int


@dataclass(frozen=True)
class ForwardRequest:
    """Actor -> server: one forward pass.

    Attributes:
        request_id: the client's number of this request (the reply carries it back).
        policy_version: the version of the weights the actor acts with.
        revision: their revision within that version (0: the version's own weights).
        observations: observation key (``""`` for a plain observation) -> ``(B, *shape)`` array in the
            model's dtype.
        state: a recurrent policy's state ``(B, state_size)`` float32, else None.
        weights: the weights of ``(policy_version, revision)`` (name -> float32 array, as published),
            sent after the server answered ``missing``; else None.
    """

    request_id: int
    policy_version: int
    revision: int
    observations: dict[str, np.ndarray]
    state: np.ndarray | None = None
    weights: dict[str, np.ndarray] | None = None

    @property
    def weights_key(self) -> tuple[int, int]:
        """``(policy_version, revision)``: which weights this request is for."""
        return self.policy_version, self.revision

    @property
    def rows(self) -> int:
        """Observations in the request (B)."""
        return len(next(iter(self.observations.values())))


@dataclass(frozen=True)
class InferenceReply:
    """Server -> actor: the answer to request ``request_id``.

    Attributes:
        status: one of :data:`REPLY_STATUSES`.
        outputs: ``outputs``: the forward outputs, head output ``(B, param_size)`` float32 and values
            ``(B,)`` float32, plus the next state ``(B, state_size)`` float32 of a recurrent policy;
            empty otherwise.
        detail: ``ready``: the server's device; ``error``: why; else empty.
    """

    request_id: int
    status: str
    outputs: tuple[np.ndarray, ...] = field(default=())
    detail: str = ""


InferenceMessage = InferencePing | ForwardRequest | InferenceReply


def _encode_arrays(arrays: Mapping[str, np.ndarray] | None, name: str) -> dict[str, Any] | None:
    if arrays is None:
        return None
    return {key: encode_array(array, f"{name}[{key!r}]") for key, array in arrays.items()}


def encode_inference_message(message: InferenceMessage) -> bytes:
    """The wire form of ``message``. Raises ValueError or TypeError for a field of our own process that
    cannot be sent (a caller bug)."""
    check_local_int(message.request_id, "request_id")
    if isinstance(message, InferencePing):
        return pack({**header(TYPE_PING), "request_id": int(message.request_id)})
    if isinstance(message, ForwardRequest):
        check_local_int(message.policy_version, "policy_version")
        check_local_int(message.revision, "revision")
        return pack(
            {
                **header(TYPE_FORWARD),
                "request_id": int(message.request_id),
                "policy_version": int(message.policy_version),
                "revision": int(message.revision),
                "observations": _encode_arrays(message.observations, "observations"),
                "state": None if message.state is None else encode_array(message.state, "state"),
                "weights": _encode_arrays(message.weights, "weights"),
            }
        )
    if message.status not in REPLY_STATUSES:
        raise ValueError(f"status: expected one of {REPLY_STATUSES}, received {message.status!r}")
    return pack(
        {
            **header(TYPE_REPLY),
            "request_id": int(message.request_id),
            "status": message.status,
            "outputs": [encode_array(array, "outputs") for array in message.outputs],
            "detail": message.detail[:MAX_TEXT_LENGTH],
        }
    )


def _decode_arrays(
    value: Any, name: str, *, optional: bool = False
) -> dict[str, np.ndarray] | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict) or (not value and not optional):
        reject(
            "schema", f"{name}: expected a non-empty map str -> array, received {describe(value)}"
        )
    arrays = {}
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_ID_LENGTH:
            reject("schema", f"{name}: expected str keys of at most {MAX_ID_LENGTH} chars")
        arrays[key] = decode_array(item, f"{name}[{key!r}]")
    return arrays


def _decode_forward(obj: dict[str, Any]) -> ForwardRequest:
    require_fields(
        obj, ("request_id", "policy_version", "revision", "observations", "state", "weights")
    )
    observations = _decode_arrays(obj["observations"], "observations")
    assert observations is not None
    rows = {len(array) if array.ndim else -1 for array in observations.values()}
    if len(rows) != 1 or min(rows) < 1:
        reject("shape", "observations: expected arrays of one batch size B >= 1")
    state = None if obj["state"] is None else decode_array(obj["state"], "state")
    return ForwardRequest(
        request_id=get_int(obj, "request_id"),
        policy_version=get_int(obj, "policy_version"),
        revision=get_int(obj, "revision"),
        observations=observations,
        state=state,
        weights=_decode_arrays(obj["weights"], "weights", optional=True),
    )


def _decode_reply(obj: dict[str, Any]) -> InferenceReply:
    require_fields(obj, ("request_id", "status", "outputs", "detail"))
    status = get_str(obj, "status")
    if status not in REPLY_STATUSES:
        reject("schema", f"status: expected one of {REPLY_STATUSES}, received {describe(status)}")
    outputs = obj["outputs"]
    if not isinstance(outputs, list) or len(outputs) > MAX_OUTPUTS:
        reject("schema", f"outputs: expected a list of at most {MAX_OUTPUTS} arrays")
    return InferenceReply(
        request_id=get_int(obj, "request_id"),
        status=status,
        outputs=tuple(decode_array(item, "outputs") for item in outputs),
        detail=get_str(obj, "detail", max_len=MAX_TEXT_LENGTH, allow_empty=True),
    )


def decode_inference_message(frame: bytes | memoryview, max_bytes: int) -> InferenceMessage:
    """Decode one frame of the central inference protocol.

    Raises:
        MessageRejected: the frame is oversized, not msgpack, of another protocol version or message
            type, or a field is missing, extra or malformed.
    """
    obj, message_type = unpack(frame, max_bytes)
    if message_type == TYPE_PING:
        require_fields(obj, ("request_id",))
        return InferencePing(get_int(obj, "request_id"))
    if message_type == TYPE_FORWARD:
        return _decode_forward(obj)
    if message_type == TYPE_REPLY:
        return _decode_reply(obj)
    reject("schema", f"type: expected an inference message, received {describe(message_type)}")
