"""How many vector steps travel in one step message: the ``steps_per_message = "auto"`` rule.

A message has a fixed cost on both sides (encode, syscalls, decode, validation, ingest) whatever its
size, so every env gains from sending K consecutive vector steps at once
(:class:`oakemu_core.transport.step_blocks.StepBlock`). K is bounded three ways: by bytes (the
memory one message holds in the queues, :data:`AUTO_MESSAGE_TARGET_BYTES`), by rows (the rows
held in one message wait for it and train later, :data:`AUTO_MESSAGE_TARGET_ROWS`), and by the
rollout (the queues between actor and learner count messages, so K steps per message multiply the
rows in flight by K: :data:`AUTO_MESSAGES_PER_SEGMENT`). The measurements behind the constants are
in ``docs/benchmarks.md``.
"""

from __future__ import annotations

__all__ = [
    "AUTO_MESSAGE_TARGET_BYTES",
    "AUTO_MAX_STEPS_PER_MESSAGE",
    "AUTO_MESSAGES_PER_SEGMENT",
    "AUTO_MESSAGE_TARGET_ROWS",
    "AUTO_MESSAGE_MIN_ROWS",
    "auto_steps_per_message",
]

AUTO_MESSAGE_TARGET_BYTES = 1024 * 1024
"""Bytes on the wire (:func:`oakemu_core.transport.frame_stacks.wire_bytes_per_env`: stacked frames
deduplicated) :func:`auto_steps_per_message` packs into one message at most, unless one vector step
of the actor's envs is already larger: a bound on the memory a message holds in the queues between
actor and learner, not on its fixed cost (which the rows bound amortises). An actor with a step ring
has no byte bound (its arrays do not travel in the message)."""

AUTO_MAX_STEPS_PER_MESSAGE = 32
"""Most steps :func:`auto_steps_per_message` puts in one message (caps how long an actor holds
steps before sending them)."""

AUTO_MESSAGES_PER_SEGMENT = 32
""":func:`auto_steps_per_message` keeps ``K <= rollout_length / 32``: the queues between an actor and
the learner hold a few messages (high-water marks) plus a few KiB (kernel buffers), so K steps per
message multiply the steps in flight, hence their policy lag, by K; 32 messages per segment keep
those steps a small part of a segment."""

AUTO_MESSAGE_TARGET_ROWS = 128
"""Env steps (K x num_envs) :func:`auto_steps_per_message` packs into one message at most: a
message's fixed cost is then a small part of each row's, and larger messages only add to the rows
acted while the learner's buffers are full (they train a version later)."""

AUTO_MESSAGE_MIN_ROWS = 32
"""Env steps (K x num_envs) :func:`auto_steps_per_message` allows in one message of an actor with a
step ring when the rollout is shorter than 64 steps (where ``rollout_length / 32`` allows one vector
step), as long as K stays within an eighth of the rollout (``min_rows``). The ring's slots, not the
socket queues, bound such an actor's rows in flight
(:func:`oakemu_core.transport.step_ring.ring_slots`), so K > 1 does not multiply them."""


def auto_steps_per_message(
    env_step_bytes: int,
    rollout_length: int,
    *,
    num_envs: int,
    target_bytes: int | None = AUTO_MESSAGE_TARGET_BYTES,
    target_rows: int = AUTO_MESSAGE_TARGET_ROWS,
    max_steps: int = AUTO_MAX_STEPS_PER_MESSAGE,
    min_rows: int = 0,
) -> int:
    """The ``steps_per_message`` the learner gives an actor by default (``steps_per_message =
    "auto"``): the largest divisor K of ``rollout_length`` with ``K <= max_steps``,
    ``K <= rollout_length / AUTO_MESSAGES_PER_SEGMENT`` (32) or, for a rollout shorter than 64
    steps (where that is 1), ``K * num_envs <= min_rows`` and ``K <= rollout_length / 8``, and always
    ``K * num_envs * env_step_bytes <= target_bytes`` and ``K * num_envs <= target_rows``; 1 when two
    vector steps already exceed ``target_bytes`` or ``target_rows`` (more than 64 envs), or the
    rollout is shorter than 64 steps and ``min_rows`` does not allow more.

    Examples: ALE/Breakout-v5, 8 envs: one vector step puts ~57 KB on the wire (newest frames) -> K = 4,
    as with a step ring (``target_bytes=None``); 8 envs of raw 210 x 160 RGB frames (~800 KB) -> K = 1;
    CartPole-v1, 8 envs: ~330 bytes -> K = 4 with rollout_length 128; with 32,
    4 for an actor with a step ring (``min_rows`` 32: :data:`AUTO_MESSAGE_MIN_ROWS`) and 1 through the
    sockets; LunarLander-v3, 16 envs, rollout 1024 -> 8 (128 rows).

    Args:
        env_step_bytes: bytes one env's step puts on the wire
            (:func:`~oakemu_core.transport.frame_stacks.wire_bytes_per_env`).
        rollout_length: rows per segment (T); K divides it.
        num_envs: envs of the actor (rows per vector step).
        target_bytes: the bound on a message's array bytes; None: none (an actor with a step ring,
            whose arrays do not travel in the message).
        target_rows: the bound on a message's rows ``K * num_envs``.
        max_steps: the bound on K.
        min_rows: up to how many rows (``K * num_envs``) a message may carry when the rollout is
            shorter than 64 steps (within an eighth of the rollout); 0: one vector step there. For
            actors with a step ring, whose slots bound the rows acted ahead; through the sockets,
            whose queues count messages, K steps per message would multiply those rows by K.

    Raises:
        ValueError: ``env_step_bytes``, ``rollout_length`` or ``num_envs`` < 1.
    """
    if env_step_bytes < 1 or rollout_length < 1 or num_envs < 1:
        raise ValueError(
            f"auto_steps_per_message: expected env_step_bytes, rollout_length and num_envs >= 1, "
            f"received {env_step_bytes}, {rollout_length}, {num_envs}"
        )
    step_bytes = num_envs * env_step_bytes  # one vector step of the actor
    most = rollout_length // AUTO_MESSAGES_PER_SEGMENT
    if (
        most <= 1
    ):  # a rollout under 64 steps: up to min_rows rows per message, within an eighth of it
        most = max(1, min(min_rows // num_envs, rollout_length // 8))
    best = 1
    for k in range(1, min(max_steps, most) + 1):
        if (
            rollout_length % k == 0
            and (target_bytes is None or k * step_bytes <= target_bytes)
            and k * num_envs <= target_rows
        ):
            best = k
    return best
