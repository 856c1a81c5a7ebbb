"""How far an actor acts before it waits for newer weights: segments, allowances, counts.

Asynchronous mode: an actor acts at most :data:`AHEAD_SEGMENTS` segments (``rollout_length`` vector
steps each) with one policy version, then waits (at most :data:`AHEAD_WAIT_S` while the learner holds
none of its steps) for newer weights, so it does not compute steps the learner could not store.
Synchronous mode (``env_config["mode"] == "sync"``): the last row of each segment of
``rollout_length`` rows ends the segment; the actor then waits for weights newer than the policy that
acted it (policy lag 0 for every row), saying so every :data:`WEIGHTS_WAIT_WARNING_S`.

:class:`Pacing` holds the counts and answers the questions; the waiting itself (sockets, heartbeats)
is the actor service's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["AHEAD_SEGMENTS", "AHEAD_WAIT_S", "WEIGHTS_WAIT_WARNING_S", "Pacing"]

log = logging.getLogger("oakemu.actor")

AHEAD_SEGMENTS = 2
"""Asynchronous mode: segments (``rollout_length`` vector steps each) an actor acts with one policy
version before it waits for newer weights. A new version comes with each released buffer, into which
the actor's held segment is written; it fills one segment and holds the next while the other buffer
trains."""
AHEAD_WAIT_S = 1.0
"""Longest wait for newer weights once :data:`AHEAD_SEGMENTS` are used up; then the actor goes on
(a fresh allowance). A run where every actor waits and no buffer can fill is thereby never stuck."""
WEIGHTS_WAIT_WARNING_S = 30.0
"""Say so when the weights of a finished segment (synchronous mode) take longer than this."""


class Pacing:
    """One actor's pacing state (see the module docstring).

    Attributes:
        sync_rollout_length: rows per segment in synchronous mode; 0: asynchronous.
        segment_rows: rows of the current synchronous segment sent.
        ahead_rows: asynchronous allowance of vector steps per policy version (0: none).
        rows_acted: vector steps acted since the weights of ``acted_version`` were loaded.
        acted_version: the policy version ``rows_acted`` counts for.
        ahead_waits: waits for newer weights after using up the allowance.
        ahead_waits_timed_out: those that gave up after :data:`AHEAD_WAIT_S`.
    """

    def __init__(self) -> None:
        self.sync_rollout_length = 0
        self.segment_rows = 0
        self.ahead_rows = 0
        self.rows_acted = 0
        self.acted_version = 0
        self.ahead_waits = 0
        self.ahead_waits_timed_out = 0

    @property
    def synchronous(self) -> bool:
        return bool(self.sync_rollout_length)

    def joined(
        self, env_config: Mapping[str, Any], policy_version: int, *, version_changed: bool
    ) -> None:
        """A join's settings (``mode``, ``rollout_length``) and the version its weights loaded
        (``version_changed``: another than the one loaded before, which starts the count over). A new
        incarnation starts a new segment."""
        rollout_length = int(env_config.get("rollout_length") or 0)
        self.sync_rollout_length = rollout_length if env_config.get("mode") == "sync" else 0
        self.ahead_rows = 0 if self.sync_rollout_length else AHEAD_SEGMENTS * rollout_length
        self.segment_rows = 0
        if version_changed:
            self.acted_version, self.rows_acted = policy_version, 0

    def acted(self, policy_version: int, rows: int = 1) -> None:
        """``rows`` vector steps were acted; ``policy_version`` is the version loaded now (another
        than :attr:`acted_version` starts the count over: versions only grow between joins)."""
        if policy_version != self.acted_version:
            self.acted_version, self.rows_acted = policy_version, 0
        self.rows_acted += rows

    def too_far_ahead(self, policy_version: int) -> bool:
        """Asynchronous mode: whether the allowance of ``policy_version`` (the version loaded) is
        used up, so the actor is to wait for newer weights before acting on."""
        return (
            bool(self.ahead_rows)
            and policy_version == self.acted_version
            and self.rows_acted >= self.ahead_rows
        )

    def waited(self, got_newer: bool, *, stopped: bool, policy_version: int, actor_id: str) -> None:
        """After a wait for newer weights (:meth:`too_far_ahead`): counted; when it gave up (and the
        actor was not told to stop) the actor acts on with a fresh allowance."""
        self.ahead_waits += 1
        if got_newer or stopped:
            return
        self.ahead_waits_timed_out += 1
        log.debug(
            "actor %s: no weights after version %d within %.1f s; acting on",
            actor_id,
            policy_version,
            AHEAD_WAIT_S,
        )
        self.acted_version, self.rows_acted = policy_version, 0

    def ends_segment(self, steps: int) -> bool:
        """Synchronous mode: whether the next ``steps`` rows end the current segment."""
        return self.synchronous and self.segment_rows + steps == self.sync_rollout_length

    def sent(self, steps: int, segment_end: bool) -> None:
        """A message of ``steps`` rows was sent; ``segment_end``: its last row ended the segment."""
        self.segment_rows = 0 if segment_end else self.segment_rows + steps

    def log_summary(self, actor_id: str) -> None:
        """Log the waits for newer weights at the actor's end (nothing when there were none)."""
        if self.ahead_waits:
            log.info(
                "actor %s waited for newer weights %d times (%d gave up after %.1f s)",
                actor_id,
                self.ahead_waits,
                self.ahead_waits_timed_out,
                AHEAD_WAIT_S,
            )
