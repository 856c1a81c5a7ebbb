"""The synchronous mode's joins: who fills the first rollout, and when a later join is answered.

The first rollout waits until ``num_actors`` actors have asked to join (or :data:`START_GRACE_S`
after the first asked), then they join with indices in actor-id order (columns and env seeds do not
depend on who connected first). Later a join is answered while the filling rollout has no row yet
(the actor is one of its members) and held otherwise, until the next rollout opens (it then acts
with the weights that rollout is acted by). A returning actor takes its old index (its *rank*,
kept across its incarnations), a new one the lowest free index; the buffer's room (``max_actors``)
bounds the actors. A held join is answered within :data:`JOIN_WAIT_NOTICE_S` either way: granted, or
told why it waits ("waiting for N more actors (up to 30 s)", ``retry_after_s`` 0), and the actor
asks again at once.

:class:`SyncJoins` is the :class:`~oakemu_core.transport.control_server.ControlServer`'s: it grants
through the server (:meth:`ControlServer.grant_join`), which registers the actor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oakemu_core.transport.control import JoinReply, JoinRequest, encode_join_reply

if TYPE_CHECKING:
    from oakemu_core.transport.control_server import ControlServer, Reply

__all__ = ["JOIN_WAIT_NOTICE_S", "START_GRACE_S", "HeldJoin", "SyncJoins"]

START_GRACE_S = 30.0
"""Synchronous mode: the first rollout starts with the actors that asked to join this many seconds
after the first one, when fewer than ``num_actors`` did."""

JOIN_WAIT_NOTICE_S = 0.5
"""Synchronous mode: longest time (s) a held join goes unanswered; then it is told why it waits (a join
reply with ``retry_after_s`` 0) and the actor asks again at once. Well below the actor's request timeout
(``oakemu_core.actor.client.REQUEST_TIMEOUT_S``, 2 s), so a held actor hears from the learner instead of
counting it silent."""


class SyncJoins:
    """The held joins and the actors' ranks of the synchronous mode (see the module docstring).

    Args:
        server: the control server that answers the requests and registers the actors.
    """

    def __init__(self, server: ControlServer) -> None:
        self.server = server
        self._held: dict[str, HeldJoin] = {}
        self._first_held_at: float | None = None
        self._started = False  # the first rollout's members have joined
        self._ranks: dict[str, int] = {}
        """Actor id -> its index, kept when it leaves: a returning actor fills the same columns."""

    def holds(self, message: JoinRequest) -> bool:
        """Whether the join of ``message``'s incarnation is held (a join asked again)."""
        held = self._held.get(message.actor_id)
        return held is not None and held.request.incarnation == message.incarnation

    def join(self, message: JoinRequest, now: float, identity: Any) -> list[Reply]:
        """Synchronous mode: answer the join now when the filling rollout has no row yet, else hold
        it for :meth:`tick` (see the module docstring). The request passed the common checks
        (:meth:`ControlServer.reply`)."""
        config = self.server.config
        if message.num_envs != config.envs_per_actor:
            reason = (
                f"mode='sync': every actor steps envs_per_actor={config.envs_per_actor} envs, "
                f"received num_envs={message.num_envs}"
            )
            return [(identity, self._refuse(message, reason))]
        self.server.counters.accepted["join"] += (
            1  # a held join counts when it arrives (each retry too)
        )
        if (
            self.server.answered_before(message) is not None
        ):  # its reply was not taken: answered again, at once
            return [(identity, self.server.grant_join(message, now, index=None))]
        previous = self.server.registry.actors.get(message.actor_id)
        if previous is not None:
            # The actor restarted: its old incarnation acts no more, its unfinished segment goes now.
            self.server.assembler.leave(previous.actor_id, previous.incarnation)
            self.server.notices.event(
                "restart",
                f"actor {message.actor_id} restarted: its previous incarnation left",
                level=logging.INFO,
            )
        first_ask = message.actor_id not in self._held
        self._held[message.actor_id] = HeldJoin(
            identity, message, now
        )  # a retry replaces the held one
        if self._first_held_at is None:
            self._first_held_at = now
        replies = self.tick(now)
        if first_ask and message.actor_id in self._held:
            self.server.notices.event(
                "sync_wait",
                f"actor {message.actor_id}: {self._wait_reason(now)}",
                level=logging.INFO,
            )
        return replies

    def _wait_reason(self, now: float) -> str:
        """Why the held joins wait (what the learner logs and the held actors are told)."""
        if self._started:
            return "mode='sync': joins at the next rollout (the current one is under way)"
        first = self._first_held_at if self._first_held_at is not None else now
        return (
            f"mode='sync': waiting for {self.server.config.num_actors - len(self._held)} more actor(s) to join "
            f"(up to {START_GRACE_S:.0f} s, {math.ceil(max(0.0, START_GRACE_S - (now - first)))} s left)"
        )

    def tick(self, now: float) -> list[Reply]:
        """The replies to the held joins (to send): grants to those that may join now
        (the first rollout's actors once ``num_actors`` asked or :data:`START_GRACE_S` passed, later
        ones while the filling rollout has no row yet), else a wait notice to each held
        :data:`JOIN_WAIT_NOTICE_S`. A join granted while its actor asks again gets its grant then (a
        join asked again). Call it every loop turn (and after a buffer is released)."""
        if not self._held:
            return []
        if not self._started:
            waited = now - (self._first_held_at if self._first_held_at is not None else now)
            if len(self._held) < self.server.config.num_actors and waited < START_GRACE_S:
                return self._wait_notices(now)
            if len(self._held) < self.server.config.num_actors:
                self.server.notices.event(
                    "sync_start",
                    f"mode='sync': the first rollout starts with "
                    f"{len(self._held)} of {self.server.config.num_actors} planned actors "
                    f"({START_GRACE_S:.0f} s passed)",
                    level=logging.WARNING,
                )
        elif not self.server.assembler.round.is_open:
            return self._wait_notices(now)
        self._started = True
        pending, self._held, self._first_held_at = self._held, {}, None
        replies = []
        for actor_id in sorted(pending):
            held = pending[actor_id]
            reply = self._grant(held.request, now)
            if not held.answered:
                replies.append((held.identity, reply))
        return replies

    def _wait_notices(self, now: float) -> list[Reply]:
        """A wait notice to each held join unanswered for :data:`JOIN_WAIT_NOTICE_S` (then it is answered)."""
        replies = []
        for held in self._held.values():
            if not held.answered and now - held.asked_at >= JOIN_WAIT_NOTICE_S:
                replies.append(
                    (
                        held.identity,
                        encode_join_reply(
                            JoinReply(
                                False,
                                self._wait_reason(now),
                                -1,
                                None,
                                {},
                                self.server.policy_version,
                                retry_after_s=0.0,
                            )
                        ),
                    )
                )
                held.answered = True
        return replies

    @property
    def held_joins(self) -> set[str]:
        """Ids of the actors whose join is held (their peer bindings stay)."""
        return set(self._held)

    def _grant(self, message: JoinRequest, now: float) -> bytes:
        """Join a held actor with its old index (or the lowest free one), if the buffer has room."""
        if not self.server.assembler.has_room_for(message.num_envs):
            self.server.counters.accepted["join"] -= 1
            reason = (
                f"mode='sync': the rollout buffer holds max_actors={self.server.config.resolved_max_actors} "
                f"actors of {self.server.config.envs_per_actor} envs, all joined (raise max_actors)"
            )
            return self._refuse(message, reason)
        held = {r.index for r in self.server.registry.actors.values()}
        rank = self._ranks.get(message.actor_id)
        if rank is None or rank in held:
            rank = next(i for i in range(len(held) + 1) if i not in held)
        self._ranks[message.actor_id] = rank
        return self.server.grant_join(message, now, index=rank)

    def _refuse(self, message: JoinRequest, reason: str) -> bytes:
        """Count and log a refused join, and its reply naming ``reason``."""
        self.server.counters.accepted["join_refused"] += 1
        self.server.notices.event(
            "join_refused", f"refused actor {message.actor_id}: {reason}", level=logging.WARNING
        )
        return self.server.refuse_join(reason)


@dataclass
class HeldJoin:
    """A synchronous-mode join waiting (:meth:`SyncJoins.tick`): its request, asked at monotonic
    ``asked_at``, and where to answer it (``identity``, the requester's ZeroMQ identity; None in tests
    that call :meth:`ControlServer.reply` directly). ``answered``: a wait notice answered this request
    already (the actor asks again; its retry replaces this record)."""

    identity: Any
    request: JoinRequest
    asked_at: float
    answered: bool = False
