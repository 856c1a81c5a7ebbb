"""The learner's ingest thread without its sockets: the books of each step message after decode,
actor expiry, the env-step budget and the stop, and the run's progress.

The learner service (``oakemu_services.learner``) owns the sockets and the poll loop; each turn it
hands what its :class:`~oakemu_core.transport.step_source.SocketStepSource` read to
:meth:`IngestLoop.take_step` / :meth:`IngestLoop.refuse_step`, asks :meth:`IngestLoop.wants_steps`
whether to read step messages at all, and passes each training result to
:meth:`IngestLoop.record_result`. Every message read is counted once: accepted, rejected (by reason)
or late (a departed incarnation's message in flight), so the books of
:class:`~oakemu_core.storage.actors.IngestCounters` balance.

The run stops when a signal asks for it or when the env-step budget is spent: by the update whose
trained env steps reach ``total_env_steps`` (rows received, discarded and stale rows never count),
or, for a run resumed with its budget spent, as soon as nothing is in flight.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from oakemu_core.algo.handshake import RunProgress, TrainResult
from oakemu_core.storage.assembler import RolloutAssembler, SlotState, StepRejected
from oakemu_core.storage.episodes import FinishedEpisode
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.step_source import ForeignStep

if TYPE_CHECKING:
    from oakemu_core.transport.control_server import ControlServer
    from oakemu_core.transport.peer_limits import PeerLimits
    from oakemu_core.transport.steps import StepMessage

__all__ = ["EXPIRY_PERIOD_S", "IngestLoop"]

log = logging.getLogger("oakemu.learner")

EXPIRY_PERIOD_S = 0.5
"""How often (s) the loop looks for actors whose process ended or that went silent."""


class IngestLoop:
    """The ingest thread's books (see the module docstring).

    Args:
        assembler: writes the step messages (its registry holds the joined actors and counters).
        control_server: answers the actors' requests (watches their processes, holds sync joins).
        peer_limits: the run's limits on a step message's values.
        total_env_steps: the env-step budget (trained env steps).
        rejections: logs a rejected step message, ``event(reason, text)`` (rate limited).
        notices: logs an actor dropped, ``event(reason, text, level=...)`` (rate limited).
        progress: the run's counters restored from its checkpoint (env steps, episodes).
        trained_env_steps: env steps trained on so far (restored from the checkpoint).
    """

    def __init__(
        self,
        assembler: RolloutAssembler,
        control_server: ControlServer,
        *,
        peer_limits: PeerLimits,
        total_env_steps: int,
        rejections: Any,
        notices: Any,
        progress: RunProgress,
        trained_env_steps: int = 0,
    ) -> None:
        self.assembler = assembler
        self.registry = assembler.registry
        self.counters = assembler.counters
        self.control_server = control_server
        self.peer_limits = peer_limits
        self.total_env_steps = total_env_steps
        self.rejections = rejections
        self.notices = notices
        self.counters.env_steps = progress.global_step
        self.episodes = progress.episodes
        """Episodes finished since the run started (those the assembler took)."""
        self.trained_env_steps = trained_env_steps
        """Env steps the rollouts trained on held (the budget's count), as the last result said."""
        self.stopping_reason = ""
        self._next_expiry = float("-inf")

    # -- step messages ---------------------------------------------------------------------------
    def take_step(self, message: StepMessage, now: float) -> None:
        """Ingest a decoded step message from its actor's own peer at monotonic time ``now``: checked
        against the run's limits, written (or held) by the assembler, counted as accepted or
        rejected; a departed incarnation's message is counted late (by the assembler)."""
        self.counters.received["data"] += 1
        try:
            problem = self.peer_limits.check_step(message)  # values no actor of this run can send
            if problem is not None:
                raise StepRejected(
                    "value_range", f"value_range: actor {message.actor_id}: {problem}"
                )
            self.assembler.ingest(message, now=now)
        except StepRejected as error:
            if error.reason != "departed_actor":  # late steps are counted as dropped, not rejected
                self._reject(error.reason, str(error))
            return
        except MessageRejected as error:
            self._reject(error.reason, str(error))
            return
        self.counters.accepted["step"] += 1

    def refuse_step(self, received: MessageRejected | ForeignStep) -> None:
        """Count a step message that is not ingested: rejected at decode (late when its sender is a
        departed incarnation), or sent from another peer than its actor's (``impersonation``)."""
        self.counters.received["data"] += 1
        if isinstance(received, ForeignStep):
            self._reject(
                "impersonation",
                f"impersonation: a step for actor {received.actor_id} from another peer",
            )
        elif received.sender is None or not self.registry.count_late(*received.sender[:2]):
            self._reject(received.reason, str(received))

    def _reject(self, reason: str, text: str) -> None:
        self.counters.rejected[reason] += 1
        self.rejections.event(reason, text)

    def take_episodes(self) -> list[FinishedEpisode]:
        """The episodes the assembler took since the last call, counted in :attr:`episodes`."""
        episodes = self.assembler.take_episodes()
        self.episodes += len(episodes)
        return episodes

    def progress(self) -> RunProgress:
        """The run's counters now: every env step received, trained or not, and every episode."""
        return RunProgress(self.counters.env_steps, self.episodes)

    # -- actors ----------------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """At most every :data:`EXPIRY_PERIOD_S`: forget the actors whose watched process ended and
        those silent for ``actor_timeout_s`` (:meth:`~oakemu_core.storage.actors.ActorRegistry.forget`
        releases what the learner held for them), and what refused or failed joins left
        (:meth:`~oakemu_core.storage.actors.ActorRegistry.sweep`)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_PERIOD_S
        for actor_id, why in self.control_server.drop_gone_actors():
            self.notices.event(
                "gone",
                f"actor {actor_id} {why} (its process): dropped, its unfinished segment discarded",
                level=logging.WARNING,
            )
        for actor_id in self.assembler.expire_silent_actors(now):
            self.notices.event(
                "timeout",
                f"actor {actor_id} silent for {self.assembler.actor_timeout_s:.1f}"
                " s: dropped, its unfinished segment discarded",
                level=logging.WARNING,
            )
        self.registry.sweep(keep_bindings=self.control_server.held_joins)

    # -- budget and stop -------------------------------------------------------------------------
    @property
    def budget_spent(self) -> bool:
        """True once the rollouts trained on held ``total_env_steps`` env steps."""
        return self.trained_env_steps >= self.total_env_steps

    def nothing_in_flight(self, training: bool) -> bool:
        """No rollout in training (``training``: the trainer holds one), none full, and no row
        written in a filling buffer."""
        return (
            not training
            and all(state is SlotState.FILLING for state in self.assembler.states)
            and not any(int(buffer.column_steps.sum()) for buffer in self.assembler.buffers)
        )

    def check_stop(self, *, stop_requested: bool, training: bool) -> None:
        """Set :attr:`stopping_reason` when a signal asked to stop (``stop_requested``) or the budget
        was spent before this run trained (a resume) and nothing is in flight."""
        if self.stopping_reason:
            return
        if stop_requested or (self.budget_spent and self.nothing_in_flight(training)):
            self.stopping_reason = "signal" if stop_requested else "env-step budget reached"
            log.info("stopping: %s", self.stopping_reason)

    def wants_steps(self, training: bool) -> bool:
        """Whether to read step messages now: a buffer is filling with room (the assembler accepts),
        the run is not stopping, and the budget is not spent while its last rollout trains."""
        return (
            self.assembler.accepting
            and not self.stopping_reason
            and not (self.budget_spent and training)
        )

    def record_result(self, result: TrainResult) -> None:
        """Book a trained rollout's result: its stale rows, the env steps trained so far, and the
        stop when they reach the budget."""
        self.counters.dropped["stale_rows"] += result.stale_rows
        self.trained_env_steps = result.trained_env_steps
        if self.budget_spent and not self.stopping_reason:
            self.stopping_reason = "env-step budget reached"
            log.info(
                "stopping: %s: %d env steps trained (%d received), update %d",
                self.stopping_reason,
                self.trained_env_steps,
                self.counters.env_steps,
                result.iterations,
            )
