"""What the learner process allocates and logs, decided from its configuration (no sockets).

Its rollout buffers (:func:`num_rollout_buffers`, :func:`rollout_buffer_bytes`), its step rings
within the ``/dev/shm`` budget (:func:`make_step_rings`, :func:`ring_offerer`), its torch threads
(:func:`learner_torch_threads`) and the rate-limited logs of what peers cause (:func:`peer_logs`).
The service (``oakemu_services.learner``) calls these while it builds; nothing here holds state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.storage.memory import step_ring_budget
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.step_ring import StepRings

if TYPE_CHECKING:
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.step_schema import StepSchema
    from oakemu_core.storage.assembler import RolloutAssembler
    from oakemu_core.transport.control import JoinRequest, StepRingOffer
    from oakemu_core.transport.steps import StepSpec

__all__ = [
    "NOTICE_BURST",
    "NUM_ROLLOUT_BUFFERS",
    "learner_torch_threads",
    "log_ingest_summary",
    "make_step_rings",
    "num_rollout_buffers",
    "peer_logs",
    "ring_offerer",
    "rollout_buffer_bytes",
]

log = logging.getLogger("oakemu.learner")

NUM_ROLLOUT_BUFFERS = 2
"""One buffer fills while the other trains (asynchronous mode; the synchronous mode has one)."""
NOTICE_BURST = 64
"""Lines of actors joining, leaving or timing out logged in full per 5 s (then one summary line)."""


def peer_logs() -> dict[str, RateLimitedLog]:
    """The rate-limited logs of every line a peer can cause: rejected step (``data``) and control
    (``control``) messages, counted exactly elsewhere, log the first of each reason and a summary
    every 5 s; joins, leaves, timeouts and refused step rings (``notices``) up to :data:`NOTICE_BURST`
    lines per 5 s in full, then a summary."""
    return {
        "data": RateLimitedLog(log, "step messages", first_prefix="rejected step message"),
        "control": RateLimitedLog(log, "control messages", first_prefix="rejected control message"),
        "notices": RateLimitedLog(
            log,
            "actor events",
            first_prefix="",
            verb="skipped the lines of",
            level=logging.INFO,
            burst=NOTICE_BURST,
        ),
    }


def ring_offerer(
    rings: StepRings, rollout_length: int, notices: RateLimitedLog, *, synchronous: bool
) -> Callable[[JoinRequest, StepSpec], StepRingOffer | None]:
    """The ``offer_ring`` of the :class:`ControlServer`: a step ring for an actor on this machine,
    else None (its arrays go inline; the reason goes to ``notices``)."""

    def offer(message: JoinRequest, spec: StepSpec) -> StepRingOffer | None:
        try:
            return rings.offer(
                message.actor_id, message.incarnation, spec, rollout_length, synchronous=synchronous
            )
        except (
            OSError
        ) as error:  # e.g. /dev/shm full, or the rings' memory limits: the sockets carry the arrays
            notices.event(
                "no_ring",
                f"no step ring for actor {message.actor_id} ({error}): its step arrays go inline",
                level=logging.WARNING,
            )
            return None

    return offer


def make_step_rings(config: OakEmuConfig, *, reserved_bytes: int) -> StepRings:
    """The learner's step rings, within ``step_ring_max_mib`` and what ``/dev/shm`` holds beside
    ``reserved_bytes`` (the rollout buffers): :func:`~oakemu_core.storage.memory.step_ring_budget`,
    whose note (a setting lowered to fit) is logged."""
    ring_bytes, note = step_ring_budget(config.step_ring_max_mib, reserved_bytes=reserved_bytes)
    if note:
        log.warning("%s", note)
    return StepRings(
        max_bytes=ring_bytes, max_bytes_per_actor=int(config.step_ring_max_mib_per_actor * 2**20)
    )


def num_rollout_buffers(config: OakEmuConfig) -> int:
    """Rollout buffers the learner allocates: two (double buffering) in the asynchronous mode, one in
    the synchronous mode (its actors wait while the only rollout in flight trains)."""
    return 1 if config.mode == "sync" else NUM_ROLLOUT_BUFFERS


def rollout_buffer_bytes(config: OakEmuConfig, schema: StepSchema) -> int:
    """Shared-memory bytes of one rollout buffer for ``config`` (every stored field of ``schema``)."""
    return RolloutBuffer.estimate_memory_bytes(
        config.rollout_length, config.allocated_num_envs, schema
    )


def log_ingest_summary(assembler: RolloutAssembler) -> None:
    """One line to compare runs: env steps written, rows held, dropped steps, buffer states."""
    counters = assembler.counters
    buffers = ", ".join(
        f"{state.value} {int(buffer.column_steps.sum())} rows"
        for state, buffer in zip(assembler.states, assembler.buffers)
    )
    log.info(
        "ingest: %d env steps written, %d vector steps held, dropped %s; buffers: %s",
        counters.env_steps,
        assembler.pending_rows,
        dict(counters.dropped),
        buffers,
    )


def learner_torch_threads(learner_threads: int | None, has_convolutions: bool) -> int | None:
    """The learner process's torch intra-op threads: ``learner_threads`` when given; else 1 for a model
    without convolutions, None (torch's default, one per core) for one with.

    An MLP's ops at PPO's minibatch sizes are too small for torch to split across threads, and the
    idle threads only contend with the learner's own; convolutions gain from more (measured in
    docs/benchmarks.md, "The learner's torch threads").
    """
    if learner_threads is not None:
        return learner_threads
    return None if has_convolutions else 1
