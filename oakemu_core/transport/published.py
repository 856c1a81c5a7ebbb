"""The weights the learner has published to its actors: the learner's one owner of the policy version.

The learner publishes a new policy version after each PPO update (and after behaviour cloning). The
control server answers joins, heartbeats and weights requests with it, and the rollout assembler
checks and ages step messages against it (``future_version``, arrival lag, ``max_policy_lag``):
both read the one :class:`PublishedWeights` the learner service sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PublishedWeights"]


@dataclass
class PublishedWeights:
    """The newest published weights.

    Attributes:
        version: the policy version (updates since the run started, >= 0; only grows).
        weights: the model's weights of that version, parameter name -> array (what a join reply
            and a weights reply carry); empty where nobody serves weights (tests of step ingest).
    """

    version: int = 0
    weights: dict[str, np.ndarray] = field(default_factory=dict)

    def publish(self, version: int, weights: dict[str, np.ndarray]) -> None:
        """Make ``weights`` of ``version`` the published ones.

        Raises:
            ValueError: ``version`` is older than the published one (versions only grow).
        """
        if version < self.version:
            raise ValueError(
                f"policy version {version} is older than the published version {self.version}"
            )
        self.version = int(version)
        self.weights = weights

    def advance(self, version: int) -> None:
        """Raise the version to ``version`` when that is newer, the weights unchanged: for a caller
        that tells the assembler the current version itself (a test, a benchmark) instead of
        publishing weights."""
        self.version = max(self.version, int(version))
