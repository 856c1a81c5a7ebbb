"""The control messages between actors and the learner, as values: join, heartbeat, leave, weights
and stop, and the limits their fields keep.

Their wire form (msgpack maps with a ``"type"`` tag, decoded from untrusted frames) is
:mod:`oakemu_core.transport.control`, which re-exports every name of this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oakemu_core.transport.steps import StepSpec

__all__ = [
    "ACTOR_ID_IN_USE",
    "HEARTBEAT_STATUSES",
    "INFERENCE_PRECISIONS",
    "MAX_HEARTBEAT_FIGURE",
    "MAX_RETRY_AFTER_S",
    "MAX_RING_SLOTS",
    "ControlMessage",
    "Heartbeat",
    "HeartbeatReply",
    "JoinReply",
    "JoinRequest",
    "Leave",
    "StepRingOffer",
    "StopNotice",
    "WeightsMessage",
    "WeightsRequest",
]

INFERENCE_PRECISIONS = ("float32", "bfloat16")
"""Precisions of an actor's forward passes a join request may name: float32 (torch, ONNX Runtime) or
bfloat16 (``actor_inference = "bfloat16"``; the learner then re-evaluates every rollout in float32)."""

HEARTBEAT_STATUSES = ("ok", "rejoin", "stop")
"""Allowed :attr:`HeartbeatReply.status` values."""

MAX_HEARTBEAT_FIGURE = 1e9
"""Largest ``env_steps_per_second`` (env steps / s) and ``policy_lag`` (versions) a heartbeat may
report: far above any real actor, and small enough for every figure the learner derives from them."""

ACTOR_ID_IN_USE = "actor id in use by another connection"
"""Start of the reason of a join refused because a live actor holds the id on another connection
(its own earlier process, until it times out, or someone else): the actor may ask again later."""

MAX_RETRY_AFTER_S = 3600.0
"""Longest ``retry_after_s`` (s) a join reply may carry."""

MAX_RING_SLOTS = 64
"""Most slots a join reply's step ring may have (:func:`oakemu_core.transport.step_ring.ring_slots` gives 1-16)."""


@dataclass(frozen=True)
class JoinRequest:
    """Actor -> learner (control socket): ask for env columns, the spec and current weights.

    Attributes:
        actor_id: stable name of the actor (e.g. ``"actor-0"``).
        incarnation: id unique to this start of the actor process (e.g. ``uuid4().hex``).
        num_envs: number of envs the actor steps (= columns it asks for).
        hostname: where the actor runs (diagnostics only).
        host_id: the actor's shared-memory host id
            (:func:`oakemu_core.transport.step_ring.shared_memory_host_id`) when it can take a step
            ring, ``""`` when it sends its arrays inline only.
        inference_precision: precision of the actor's forward passes, one of :data:`INFERENCE_PRECISIONS`:
            its log-probs and values are those of the learner's weights rounded to it.
        pid, pid_namespace: the actor's process id and PID namespace
            (:func:`oakemu_core.transport.liveness.process_identity`); a learner in the same namespace
            notices at once when the process exits (0 / ``""``: unknown).
    """

    actor_id: str
    incarnation: str
    num_envs: int
    hostname: str
    host_id: str = ""
    inference_precision: str = "float32"
    pid: int = 0
    pid_namespace: str = ""


@dataclass(frozen=True)
class StepRingOffer:
    """A step ring the learner made for one actor (:mod:`oakemu_core.transport.step_ring`).

    Attributes:
        name: shared-memory segment name (``oakemu_<pid>_<token>_stepring``).
        token: 16 hex digits written in the ring's header; the actor checks them after attaching.
        slots: message slots of the ring, in ``[1, MAX_RING_SLOTS]``.
    """

    name: str
    token: str
    slots: int


@dataclass(frozen=True, eq=False)
class JoinReply:
    """Learner -> actor: accept (with spec, env config and current weights) or refuse a join.

    Attributes:
        accepted: whether the actor may start stepping.
        reason: why the join was refused ("" when accepted).
        actor_index: index the learner gave this actor (used e.g. for seeding); -1 when refused.
        spec: the :class:`~oakemu_core.transport.steps.StepSpec` every step message must follow;
            None when refused.
        env_config: scalars the actor builds its envs from (``env_id``, ``max_episode_steps``,
            ``clip_rewards``, ``seed``, ...); values are None, bool, int, float or str.
        policy_version: version of ``weights``.
        weights: parameter name -> array (model ``state_dict`` as numpy); empty when refused.
        step_ring: a shared-memory ring for the actor's step arrays, or None (send them inline).
        retry_after_s: None for a final answer; with ``accepted`` False, seconds (``[0,
            MAX_RETRY_AFTER_S]``) after which the actor asks again with the same request: the join is
            neither refused nor granted yet (``reason`` says why: a synchronous run waiting for its
            actors, or too many joins from the actor's host).
    """

    accepted: bool
    reason: str
    actor_index: int
    spec: StepSpec | None
    env_config: dict[str, Any]
    policy_version: int
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    step_ring: StepRingOffer | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Actor -> learner (control socket), periodically: liveness plus actor-side figures.

    Attributes:
        actor_id, incarnation: as in :class:`JoinRequest`.
        seq: seq of the next step message this incarnation will send (= step messages sent so far).
        policy_version: version of the weights the actor acts with now.
        env_steps_per_second: the actor's env steps per second (all its envs), in
            ``[0, MAX_HEARTBEAT_FIGURE]``.
        policy_lag: learner version minus acting version as last seen by the actor, in versions,
            in ``[0, MAX_HEARTBEAT_FIGURE]``.
        episodes: episodes finished by this incarnation so far.
    """

    actor_id: str
    incarnation: str
    seq: int
    policy_version: int
    env_steps_per_second: float
    policy_lag: float
    episodes: int


@dataclass(frozen=True)
class HeartbeatReply:
    """Learner -> actor: ``"ok"``, ``"rejoin"`` (learner forgot this incarnation: join again) or
    ``"stop"`` (shut down), plus the learner's current policy version (an actor whose weights channel
    has not delivered that version asks for it: :class:`WeightsRequest`) and ``held_rows``: vector
    steps of this actor that the learner holds for lack of free columns (an actor with held steps
    waits for newer weights instead of acting ahead: what it acted now would be thrown away)."""

    status: str
    policy_version: int
    held_rows: int = 0


@dataclass(frozen=True)
class Leave:
    """Actor -> learner: the actor is stopping; its incomplete segment may be discarded now."""

    actor_id: str
    incarnation: str


@dataclass(frozen=True)
class WeightsRequest:
    """Actor -> learner (control socket): send me your current weights. An actor asks when a heartbeat
    reply names a newer policy version than any its weights channel delivered (a PUB/SUB subscriber
    loses what is published while it is not connected or its queue is full). Answered with a
    :class:`WeightsMessage` of the learner's current version (revision 0), or a :class:`HeartbeatReply`
    ``"rejoin"`` / ``"stop"``."""

    actor_id: str
    incarnation: str


@dataclass(frozen=True, eq=False)
class WeightsMessage:
    """Learner PUB -> actors: new weights. ``weights``: parameter name -> array, in model order.

    ``revision``: 0 for the weights an update ends with (the new ``policy_version``); 1, 2, ... for
    the weights after each epoch of the update still running on ``policy_version`` (asynchronous
    mode, ``publish_every_epoch``). An actor loads weights whose ``(policy_version, revision)`` is
    newer than its own; the rows it acts keep ``policy_version``."""

    policy_version: int
    weights: dict[str, np.ndarray]
    revision: int = 0


@dataclass(frozen=True)
class StopNotice:
    """Learner PUB -> actors: the run is over (``reason``: why, for the actors' logs). Actors stop at
    once instead of at their next heartbeat, whose reply says the same up to a second later."""

    reason: str


ControlMessage = (
    JoinRequest
    | JoinReply
    | Heartbeat
    | HeartbeatReply
    | Leave
    | WeightsRequest
    | WeightsMessage
    | StopNotice
)
