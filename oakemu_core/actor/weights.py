"""Which weights an actor acts with, which it keeps for later, and how far behind the learner it is.

The policy version and revision of the weights loaded have one owner on an actor: its
:class:`~oakemu_core.actor.stepper.PolicyStepper` (``policy_version``, ``weights_revision``), which
labels every row it acts. :class:`ActorWeights` writes them there when it loads weights and reads
them there for everything else (which weights are newer, the policy lag heartbeats report), so step
messages and heartbeats cannot disagree. Weights are ordered by ``(policy_version, revision)``: a
revision is a publication within the update that makes the next version.

Weights arrive on the weights channel or, when it missed them, on the control socket (the socket
work is the actor service's; :data:`~oakemu_core.actor.client.WEIGHTS_MISSED_S` and
:meth:`ActorWeights.fetch_due`). A synchronous actor acts a whole segment with one version: newer
weights read inside the segment are held (:meth:`ActorWeights.take` with ``hold``) and loaded at its
end (:meth:`ActorWeights.load_held`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np

from oakemu_core.transport.control import WeightsMessage

__all__ = ["ActorWeights", "VersionOwner"]

log = logging.getLogger("oakemu.actor")


class VersionOwner(Protocol):
    """What labels the rows an actor acts (:class:`~oakemu_core.actor.stepper.PolicyStepper`): the
    version and revision of the weights loaded."""

    policy_version: int
    weights_revision: int


class ActorWeights:
    """The weights side of one actor, without sockets.

    Args:
        stepper: the owner of the loaded weights' ``(policy_version, weights_revision)``.
        load_arrays: loads weight arrays (name -> array) into the acting model and its inference
            backend (:meth:`~oakemu_core.actor.join_setup.ActorPolicy.load`).

    Attributes:
        held: weights read within a synchronous segment, loaded at its end (None: none).
        learner_version: the newest policy version the actor has heard of (loaded, held, or named
            by a heartbeat reply); never goes down.
        behind_since: ``time.monotonic()`` when the actor was first seen behind ``learner_version``
            with the weights channel read (None: not behind).
        fetched: weights asked for on the control socket (the weights channel missed them).
        revisions_loaded: weights published within an update loaded.
    """

    def __init__(
        self, stepper: VersionOwner, load_arrays: Callable[[dict[str, np.ndarray]], None]
    ) -> None:
        self.stepper = stepper
        self._load_arrays = load_arrays
        self.held: WeightsMessage | None = None
        self.learner_version = stepper.policy_version
        self.behind_since: float | None = None
        self.fetched = 0
        self.revisions_loaded = 0

    @property
    def policy_version(self) -> int:
        """Version of the weights loaded (the stepper's)."""
        return self.stepper.policy_version

    @property
    def loaded(self) -> tuple[int, int]:
        """``(policy_version, revision)`` of the weights loaded (the stepper's)."""
        return self.stepper.policy_version, self.stepper.weights_revision

    @property
    def policy_lag(self) -> float:
        """Policy versions between the newest one heard of and the one loaded (heartbeats report it)."""
        return float(self.learner_version - self.stepper.policy_version)

    def newest_version(self) -> int:
        """The newest policy version this actor has: loaded, or held for its segment's end."""
        return max(self.policy_version, -1 if self.held is None else self.held.policy_version)

    def heard(self, learner_version: int) -> None:
        """A heartbeat reply named the learner's current ``learner_version``."""
        self.learner_version = max(self.learner_version, learner_version)

    def load(self, version: int, weights: dict[str, np.ndarray], revision: int = 0) -> None:
        """Load ``weights`` as revision ``revision`` of policy version ``version`` (the stepper's
        record follows)."""
        self._load_arrays(weights)
        self.stepper.policy_version, self.stepper.weights_revision = version, revision
        self.revisions_loaded += revision > 0
        self.heard(version)

    def is_newer(self, message: WeightsMessage) -> bool:
        """Whether ``message`` holds weights newer than those loaded."""
        return (message.policy_version, message.revision) > self.loaded

    def take(self, message: WeightsMessage, *, hold: bool) -> bool:
        """Load ``message`` if newer than the weights loaded (True), or with ``hold`` keep it for
        :meth:`load_held` if newer than those and than any held already (False)."""
        if not self.is_newer(message):
            return False
        if hold:
            held = self.held
            if held is None or (message.policy_version, message.revision) > (
                held.policy_version,
                held.revision,
            ):
                self.held = message
            self.heard(message.policy_version)  # the lag heartbeats report counts it
            return False
        self.load(message.policy_version, message.weights, message.revision)
        return True

    def load_held(self) -> bool:
        """Load the weights held during a synchronous segment, if still newer (True when loaded)."""
        message, self.held = self.held, None
        if message is None or not self.is_newer(message):
            return False
        self.load(message.policy_version, message.weights, message.revision)
        return True

    def rejoined(self, version: int, weights: dict[str, np.ndarray]) -> None:
        """A join's weights: loaded, whatever was held (perhaps from a learner that restarted since)
        dropped, and the actor not behind."""
        self.load(version, weights)
        self.held = None
        self.behind_since = None

    def fetch_due(self, learner_version: int, now: float, missed_s: float) -> bool:
        """After a heartbeat reply naming ``learner_version`` (the weights channel read first):
        whether the actor has been behind it for ``missed_s`` seconds, so its weights are to be
        asked for on the control socket. True starts the wait over (a request that fails is made
        again ``missed_s`` later)."""
        if learner_version <= self.newest_version():
            self.behind_since = None
            return False
        if self.behind_since is None:
            self.behind_since = now
        if now - self.behind_since < missed_s:
            return False
        self.behind_since = None
        return True

    def took_fetched(self, message: WeightsMessage, *, hold: bool, actor_id: str) -> bool:
        """Weights fetched on the control socket: counted, logged (a warning the first time), then
        :meth:`take`-n; True when loaded."""
        self.fetched += 1
        log.log(
            logging.WARNING if self.fetched == 1 else logging.DEBUG,
            "actor %s: the weights channel missed policy version %d (acting with %d): fetched on "
            "the control socket",
            actor_id,
            message.policy_version,
            self.policy_version,
        )
        return self.take(message, hold=hold)

    def log_summary(self, actor_id: str) -> None:
        """Log what the actor's weights counters say at its end (nothing when there is nothing to say)."""
        if self.revisions_loaded:
            log.info(
                "actor %s loaded %d weight revisions published within updates",
                actor_id,
                self.revisions_loaded,
            )
        if self.fetched:
            log.info(
                "actor %s fetched the weights %d times on the control socket (the weights channel "
                "missed them)",
                actor_id,
                self.fetched,
            )
