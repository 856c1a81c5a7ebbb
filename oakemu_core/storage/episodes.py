"""The learner's one count of finished episodes: the episodes step messages report, taken once.

The asynchronous mode takes a message's episodes when the message is ingested. The synchronous mode
holds them with their rollout and releases them when it is full, sorted by (actor index, seq), so a
seed's run does not depend on the order in which messages arrived; a non-member actor's episodes
are not taken, as its rows are not written.
"""

from __future__ import annotations

from dataclasses import dataclass

from oakemu_core.transport.steps import StepMessage

__all__ = ["EpisodeBook", "FinishedEpisode", "finished_episodes"]


@dataclass(frozen=True)
class FinishedEpisode:
    """One episode a step message reports: the actor and policy version that acted its last step,
    its raw game score (``episodic_return``) and length in agent steps (``episodic_length``)."""

    actor_id: str
    policy_version: int
    episodic_return: float
    episodic_length: int


def finished_episodes(message: StepMessage) -> list[FinishedEpisode]:
    """The episodes a step message reports, as :class:`FinishedEpisode` records."""
    return [
        FinishedEpisode(message.actor_id, message.policy_version, float(ret), int(length))
        for ret, length in zip(message.episode_returns, message.episode_lengths)
    ]


class EpisodeBook:
    """The episodes taken and not yet handed out, and (synchronous mode) those of the filling
    rollout."""

    def __init__(self) -> None:
        self._taken: list[FinishedEpisode] = []
        self._round: list[tuple[int, int, list[FinishedEpisode]]] = []

    def take(self, message: StepMessage) -> None:
        """Take the episodes of an ingested message now (asynchronous mode)."""
        if message.episode_returns:
            self._taken.extend(finished_episodes(message))

    def hold(self, index: int, message: StepMessage) -> None:
        """Hold the episodes of a message of the actor of ``index`` for :meth:`release_round`."""
        if message.episode_returns:
            self._round.append((index, message.seq, finished_episodes(message)))

    def release_round(self) -> None:
        """The filling rollout is full: take its held episodes, in (actor index, seq) order."""
        for _, _, episodes in sorted(self._round, key=lambda item: item[:2]):
            self._taken.extend(episodes)
        self._round = []

    def hand_out(self) -> list[FinishedEpisode]:
        """The episodes taken since the last call, in the order they were taken."""
        episodes, self._taken = self._taken, []
        return episodes
