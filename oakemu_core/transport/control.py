"""Control messages between actors and the learner: join, heartbeat, leave, weights and stop.

Message types (``"type"`` tag: dataclass, direction, encoder):

- ``join``: :class:`JoinRequest`, actor REQ -> learner ROUTER, :func:`encode_join_request`
- ``join_reply``: :class:`JoinReply`, learner ROUTER -> actor REQ, :func:`encode_join_reply`
- ``heartbeat``: :class:`Heartbeat`, actor REQ -> learner ROUTER, :func:`encode_heartbeat`
- ``heartbeat_reply``: :class:`HeartbeatReply`, learner ROUTER -> actor REQ, :func:`encode_heartbeat_reply`
- ``leave``: :class:`Leave`, actor REQ -> learner ROUTER, :func:`encode_leave`
- ``weights_request``: :class:`WeightsRequest`, actor REQ -> learner ROUTER, :func:`encode_weights_request`
  (answered with a ``weights`` message on the control socket)
- ``weights``: :class:`WeightsMessage`, learner PUB -> actor SUB (or learner ROUTER -> actor REQ, the
  reply to a ``weights_request``), :func:`encode_weights`
- ``stop``: :class:`StopNotice`, learner PUB -> actor SUB, :func:`encode_stop`

The dataclasses and the limits of their fields are :mod:`oakemu_core.transport.control_messages`
(re-exported here); this module is their wire form (step messages:
:mod:`oakemu_core.transport.steps`). Messages an actor sends carry ``"actor_id"``
and ``"incarnation"`` (a fresh id on every actor start). Untrusted frames are decoded with
:func:`decode_message`, which raises only :class:`~oakemu_core.transport.codec.MessageRejected`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from oakemu_core.shared_memory import SEGMENT_PREFIX
from oakemu_core.transport.codec import (
    MAX_ID_LENGTH,
    MAX_TEXT_LENGTH,
    MessageRejected,
    check_local_id,
    check_local_int,
    decode_array,
    describe,
    encode_array,
    get_bool,
    get_float,
    get_int,
    get_str,
    header,
    pack,
    reject,
    require_fields,
    unpack,
)
from oakemu_core.transport.control_messages import (
    ACTOR_ID_IN_USE,
    HEARTBEAT_STATUSES,
    INFERENCE_PRECISIONS,
    MAX_HEARTBEAT_FIGURE,
    MAX_RETRY_AFTER_S,
    MAX_RING_SLOTS,
    ControlMessage,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    Leave,
    StepRingOffer,
    StopNotice,
    WeightsMessage,
    WeightsRequest,
)
from oakemu_core.transport.steps import TYPE_STEP, StepSpec

__all__ = [
    "INFERENCE_PRECISIONS",
    "HEARTBEAT_STATUSES",
    "MAX_RING_SLOTS",
    "MAX_HEARTBEAT_FIGURE",
    "MAX_RETRY_AFTER_S",
    "ACTOR_ID_IN_USE",
    "JoinRequest",
    "JoinReply",
    "StepRingOffer",
    "Heartbeat",
    "HeartbeatReply",
    "Leave",
    "WeightsRequest",
    "WeightsMessage",
    "StopNotice",
    "ControlMessage",
    "encode_join_request",
    "encode_join_reply",
    "encode_heartbeat",
    "encode_heartbeat_reply",
    "encode_leave",
    "encode_weights_request",
    "encode_weights",
    "encode_stop",
    "decode_message",
]

TYPE_JOIN = "join"
TYPE_JOIN_REPLY = "join_reply"
TYPE_HEARTBEAT = "heartbeat"
TYPE_HEARTBEAT_REPLY = "heartbeat_reply"
TYPE_LEAVE = "leave"
TYPE_WEIGHTS_REQUEST = "weights_request"
TYPE_WEIGHTS = "weights"
TYPE_STOP = "stop"


# ---------------------------------------------------------------------------------------------
# named arrays (weights) and scalar maps (env_config)
# ---------------------------------------------------------------------------------------------


def _encode_weights(weights: Mapping[str, np.ndarray], name: str) -> dict[str, Any]:
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{name}: expected a mapping str -> numpy.ndarray, received {type(weights).__name__}"
        )
    out: dict[str, Any] = {}
    for key, array in weights.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            raise TypeError(
                f"{name}: expected non-empty str keys of at most {MAX_ID_LENGTH} chars, received {key!r}"
            )
        out[key] = encode_array(array, f"{name}[{key!r}]")
    return out


def _decode_weights(value: Any, name: str) -> dict[str, np.ndarray]:
    if not isinstance(value, dict):
        reject("schema", f"{name}: expected a map str -> array, received {type(value).__name__}")
    weights: dict[str, np.ndarray] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            reject(
                "schema",
                f"{name}: expected non-empty str keys of at most {MAX_ID_LENGTH} chars, received {describe(key)}",
            )
        weights[key] = decode_array(item, f"{name}[{key!r}]")
    return weights


_SCALAR_TYPES = (type(None), bool, int, float, str)


def _encode_env_config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(
            f"env_config: expected a mapping str -> scalar, received {type(config).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            raise TypeError(f"env_config: expected non-empty str keys, received {key!r}")
        if not isinstance(value, _SCALAR_TYPES):
            raise TypeError(
                f"env_config[{key!r}]: expected None, bool, int, float or str, received {type(value).__name__}"
            )
        out[key] = value
    return out


def _decode_env_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        reject("schema", f"env_config: expected a map, received {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH:
            reject("schema", f"env_config: expected non-empty str keys, received {describe(key)}")
        if type(item) not in _SCALAR_TYPES:
            reject(
                "schema",
                f"env_config[{key!r}]: expected None, bool, int, float or str, received {type(item).__name__}",
            )
        if type(item) is float and not math.isfinite(item):
            reject("schema", f"env_config[{key!r}]: expected a finite float, received {item!r}")
        if type(item) is str and len(item) > MAX_TEXT_LENGTH:
            reject("schema", f"env_config[{key!r}]: string longer than {MAX_TEXT_LENGTH} chars")
    return value


# ---------------------------------------------------------------------------------------------
# encoders
# ---------------------------------------------------------------------------------------------


def encode_join_request(msg: JoinRequest) -> bytes:
    """Serialise a :class:`JoinRequest`. Raises ValueError naming a field with a bad value."""
    check_local_id(msg.actor_id, "actor_id")
    check_local_id(msg.incarnation, "incarnation")
    check_local_int(msg.num_envs, "num_envs", minimum=1)
    if msg.inference_precision not in INFERENCE_PRECISIONS:
        raise ValueError(
            f"inference_precision: expected one of {INFERENCE_PRECISIONS}, received "
            f"{msg.inference_precision!r}"
        )
    return pack(
        {
            **header(TYPE_JOIN),
            "actor_id": msg.actor_id,
            "incarnation": msg.incarnation,
            "num_envs": int(msg.num_envs),
            "hostname": str(msg.hostname),
            "host_id": str(msg.host_id),
            "inference_precision": msg.inference_precision,
            "pid": int(msg.pid),
            "pid_namespace": str(msg.pid_namespace),
        }
    )


def encode_join_reply(msg: JoinReply) -> bytes:
    """Serialise a :class:`JoinReply`; weights travel as wire arrays (no copy before msgpack).

    Raises:
        TypeError / ValueError: a field has the wrong type (e.g. object-dtype weight, non-scalar
            config value); the message names the field.
    """
    check_local_int(msg.actor_index, "actor_index", minimum=-1)
    check_local_int(msg.policy_version, "policy_version")
    if msg.retry_after_s is not None and (
        msg.accepted or not 0.0 <= msg.retry_after_s <= MAX_RETRY_AFTER_S
    ):
        raise ValueError(
            f"retry_after_s: expected None, or a float in [0, {MAX_RETRY_AFTER_S:g}] in a join reply "
            f"that is not accepted, received {msg.retry_after_s!r}"
        )
    return pack(
        {
            **header(TYPE_JOIN_REPLY),
            "accepted": bool(msg.accepted),
            "reason": str(msg.reason),
            "actor_index": int(msg.actor_index),
            "spec": None if msg.spec is None else msg.spec.to_dict(),
            "env_config": _encode_env_config(msg.env_config),
            "policy_version": int(msg.policy_version),
            "weights": _encode_weights(msg.weights, "weights"),
            "step_ring": None
            if msg.step_ring is None
            else {
                "name": msg.step_ring.name,
                "token": msg.step_ring.token,
                "slots": int(msg.step_ring.slots),
            },
            "retry_after_s": None if msg.retry_after_s is None else float(msg.retry_after_s),
        }
    )


def encode_heartbeat(msg: Heartbeat) -> bytes:
    """Serialise a :class:`Heartbeat`. Raises ValueError naming a field with a bad value."""
    check_local_id(msg.actor_id, "actor_id")
    check_local_id(msg.incarnation, "incarnation")
    check_local_int(msg.seq, "seq")
    check_local_int(msg.policy_version, "policy_version")
    check_local_int(msg.episodes, "episodes")
    for name in ("env_steps_per_second", "policy_lag"):
        value = getattr(msg, name)
        if not 0.0 <= value <= MAX_HEARTBEAT_FIGURE:  # also refuses NaN
            raise ValueError(
                f"{name}: expected a float in [0, {MAX_HEARTBEAT_FIGURE:g}], received {value!r}"
            )
    return pack(
        {
            **header(TYPE_HEARTBEAT),
            "actor_id": msg.actor_id,
            "incarnation": msg.incarnation,
            "seq": int(msg.seq),
            "policy_version": int(msg.policy_version),
            "env_steps_per_second": float(msg.env_steps_per_second),
            "policy_lag": float(msg.policy_lag),
            "episodes": int(msg.episodes),
        }
    )


def encode_heartbeat_reply(msg: HeartbeatReply) -> bytes:
    """Serialise a :class:`HeartbeatReply`. Raises ValueError for an unknown ``status``."""
    if msg.status not in HEARTBEAT_STATUSES:
        raise ValueError(f"status: expected one of {HEARTBEAT_STATUSES}, received {msg.status!r}")
    check_local_int(msg.policy_version, "policy_version")
    check_local_int(msg.held_rows, "held_rows")
    return pack(
        {
            **header(TYPE_HEARTBEAT_REPLY),
            "status": msg.status,
            "policy_version": int(msg.policy_version),
            "held_rows": int(msg.held_rows),
        }
    )


def encode_leave(msg: Leave) -> bytes:
    """Serialise a :class:`Leave`. Raises ValueError naming a field with a bad value."""
    check_local_id(msg.actor_id, "actor_id")
    check_local_id(msg.incarnation, "incarnation")
    return pack({**header(TYPE_LEAVE), "actor_id": msg.actor_id, "incarnation": msg.incarnation})


def encode_weights_request(msg: WeightsRequest) -> bytes:
    """Serialise a :class:`WeightsRequest`. Raises ValueError naming a field with a bad value."""
    check_local_id(msg.actor_id, "actor_id")
    check_local_id(msg.incarnation, "incarnation")
    return pack(
        {**header(TYPE_WEIGHTS_REQUEST), "actor_id": msg.actor_id, "incarnation": msg.incarnation}
    )


def encode_weights(msg: WeightsMessage) -> bytes:
    """Serialise a :class:`WeightsMessage` (arrays passed to msgpack as memoryviews)."""
    check_local_int(msg.policy_version, "policy_version")
    check_local_int(msg.revision, "revision")
    return pack(
        {
            **header(TYPE_WEIGHTS),
            "policy_version": int(msg.policy_version),
            "revision": int(msg.revision),
            "weights": _encode_weights(msg.weights, "weights"),
        }
    )


def encode_stop(msg: StopNotice) -> bytes:
    """Serialise a :class:`StopNotice`. Raises ValueError for a reason that is not short text."""
    if not isinstance(msg.reason, str) or len(msg.reason) > MAX_TEXT_LENGTH:
        raise ValueError(f"reason: expected a str of at most {MAX_TEXT_LENGTH} characters")
    return pack({**header(TYPE_STOP), "reason": msg.reason})


# ---------------------------------------------------------------------------------------------
# decoders
# ---------------------------------------------------------------------------------------------


def _decode_join(obj: dict[str, Any]) -> JoinRequest:
    require_fields(
        obj,
        (
            "actor_id",
            "incarnation",
            "num_envs",
            "hostname",
            "host_id",
            "inference_precision",
            "pid",
            "pid_namespace",
        ),
    )
    precision = get_str(obj, "inference_precision")
    if precision not in INFERENCE_PRECISIONS:
        raise MessageRejected(
            "value_range",
            f"inference_precision: expected one of {INFERENCE_PRECISIONS}, got {precision!r}",
        )
    return JoinRequest(
        actor_id=get_str(obj, "actor_id"),
        incarnation=get_str(obj, "incarnation"),
        num_envs=get_int(obj, "num_envs", minimum=1),
        hostname=get_str(obj, "hostname", max_len=MAX_TEXT_LENGTH, allow_empty=True),
        host_id=get_str(obj, "host_id", allow_empty=True),
        inference_precision=precision,
        pid=get_int(obj, "pid"),
        pid_namespace=get_str(obj, "pid_namespace", max_len=MAX_TEXT_LENGTH, allow_empty=True),
    )


_RING_KEYS = frozenset({"name", "token", "slots"})
_RING_TOKEN = re.compile(r"^[0-9a-f]{16}$")


def _decode_step_ring(value: Any) -> StepRingOffer | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.keys() != _RING_KEYS:
        reject("schema", f"step_ring: expected None or a map with keys {sorted(_RING_KEYS)}")
    name, token = get_str(value, "name"), get_str(value, "token")
    if not name.startswith(SEGMENT_PREFIX) or not _RING_TOKEN.match(token):
        reject(
            "schema",
            f"step_ring: expected an {SEGMENT_PREFIX}* segment and 16 hex digits, received "
            f"{describe(name)} / {describe(token)}",
        )
    slots = get_int(value, "slots", minimum=1)
    if slots > MAX_RING_SLOTS:
        reject("schema", f"step_ring.slots: expected at most {MAX_RING_SLOTS}, received {slots}")
    return StepRingOffer(name=name, token=token, slots=slots)


def _decode_join_reply(obj: dict[str, Any]) -> JoinReply:
    require_fields(
        obj,
        (
            "accepted",
            "reason",
            "actor_index",
            "spec",
            "env_config",
            "policy_version",
            "weights",
            "step_ring",
            "retry_after_s",
        ),
    )
    spec = obj["spec"]
    accepted = get_bool(obj, "accepted")
    if accepted and spec is None:
        reject("schema", "spec: expected a step spec in an accepted join reply, received None")
    retry_after_s = None if obj["retry_after_s"] is None else get_float(obj, "retry_after_s")
    if retry_after_s is not None and (accepted or not 0.0 <= retry_after_s <= MAX_RETRY_AFTER_S):
        reject(
            "schema",
            f"retry_after_s: expected nil, or a float in [0, {MAX_RETRY_AFTER_S:g}] in a join reply "
            f"that is not accepted, received {describe(obj['retry_after_s'])}",
        )
    return JoinReply(
        accepted=accepted,
        reason=get_str(obj, "reason", max_len=MAX_TEXT_LENGTH, allow_empty=True),
        actor_index=get_int(obj, "actor_index", minimum=-1),
        spec=None if spec is None else StepSpec.from_dict(spec),
        env_config=_decode_env_config(obj["env_config"]),
        policy_version=get_int(obj, "policy_version"),
        weights=_decode_weights(obj["weights"], "weights"),
        step_ring=_decode_step_ring(obj["step_ring"]),
        retry_after_s=retry_after_s,
    )


def _decode_heartbeat(obj: dict[str, Any]) -> Heartbeat:
    require_fields(
        obj,
        (
            "actor_id",
            "incarnation",
            "seq",
            "policy_version",
            "env_steps_per_second",
            "policy_lag",
            "episodes",
        ),
    )
    figures = {name: get_float(obj, name) for name in ("env_steps_per_second", "policy_lag")}
    for name, value in figures.items():  # telemetry and its schema take them as they are
        if not 0.0 <= value <= MAX_HEARTBEAT_FIGURE:
            reject(
                "value_range",
                f"{name}: expected a float in [0, {MAX_HEARTBEAT_FIGURE:g}], received {value!r}",
            )
    return Heartbeat(
        actor_id=get_str(obj, "actor_id"),
        incarnation=get_str(obj, "incarnation"),
        seq=get_int(obj, "seq"),
        policy_version=get_int(obj, "policy_version"),
        episodes=get_int(obj, "episodes"),
        **figures,
    )


def _decode_heartbeat_reply(obj: dict[str, Any]) -> HeartbeatReply:
    require_fields(obj, ("status", "policy_version", "held_rows"))
    status = obj["status"]
    if type(status) is not str or status not in HEARTBEAT_STATUSES:
        reject(
            "schema", f"status: expected one of {HEARTBEAT_STATUSES}, received {describe(status)}"
        )
    return HeartbeatReply(
        status=status,
        policy_version=get_int(obj, "policy_version"),
        held_rows=get_int(obj, "held_rows"),
    )


def _decode_leave(obj: dict[str, Any]) -> Leave:
    require_fields(obj, ("actor_id", "incarnation"))
    return Leave(actor_id=get_str(obj, "actor_id"), incarnation=get_str(obj, "incarnation"))


def _decode_weights_request(obj: dict[str, Any]) -> WeightsRequest:
    require_fields(obj, ("actor_id", "incarnation"))
    return WeightsRequest(
        actor_id=get_str(obj, "actor_id"), incarnation=get_str(obj, "incarnation")
    )


def _decode_stop(obj: dict[str, Any]) -> StopNotice:
    require_fields(obj, ("reason",))
    return StopNotice(reason=get_str(obj, "reason", max_len=MAX_TEXT_LENGTH, allow_empty=True))


def _decode_weights_message(obj: dict[str, Any]) -> WeightsMessage:
    require_fields(obj, ("policy_version", "revision", "weights"))
    return WeightsMessage(
        policy_version=get_int(obj, "policy_version"),
        weights=_decode_weights(obj["weights"], "weights"),
        revision=get_int(obj, "revision"),
    )


_CONTROL_DECODERS: dict[str, Callable[[dict[str, Any]], ControlMessage]] = {
    TYPE_JOIN: _decode_join,
    TYPE_JOIN_REPLY: _decode_join_reply,
    TYPE_HEARTBEAT: _decode_heartbeat,
    TYPE_HEARTBEAT_REPLY: _decode_heartbeat_reply,
    TYPE_LEAVE: _decode_leave,
    TYPE_WEIGHTS_REQUEST: _decode_weights_request,
    TYPE_WEIGHTS: _decode_weights_message,
    TYPE_STOP: _decode_stop,
}


def decode_message(frame: bytes | bytearray | memoryview, *, max_bytes: int) -> ControlMessage:
    """Decode and validate one control or weights frame (any type except ``"step"``).

    Args:
        frame: one ZeroMQ frame.
        max_bytes: frames longer than this are rejected before any decoding.

    Returns:
        A :class:`JoinRequest`, :class:`JoinReply`, :class:`Heartbeat`, :class:`HeartbeatReply`,
        :class:`Leave`, :class:`WeightsRequest`, :class:`WeightsMessage` or :class:`StopNotice`; arrays
        are read-only views.

    Raises:
        MessageRejected: for any malformed frame (``reason`` in
            :data:`~oakemu_core.transport.codec.REJECTION_REASONS`); a ``"step"`` frame is rejected
            with ``"schema"`` (use :func:`oakemu_core.transport.steps.decode_step`).
        TypeError: ``frame`` is not a bytes-like object (a caller bug, not wire input).
    """
    obj, message_type = unpack(frame, max_bytes)
    decoder = _CONTROL_DECODERS.get(message_type)
    if decoder is None:
        hint = " (step messages are decoded with decode_step)" if message_type == TYPE_STEP else ""
        reject(
            "schema",
            f"type: expected one of {sorted(_CONTROL_DECODERS)}, received {describe(message_type)}{hint}",
        )
    return decoder(obj)
