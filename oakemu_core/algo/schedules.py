"""Values that change per PPO update: the :class:`Schedule` protocol the learner reads (the learning
rate) and :class:`LinearSchedule`, CleanRL's linear annealing."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["LinearSchedule", "Schedule"]


class Schedule(Protocol):
    """A value per update (e.g. :class:`LinearSchedule`)."""

    def value(self) -> float: ...

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LinearSchedule:
    """A value that moves linearly from ``start`` to ``end`` over ``total_updates`` updates, then
    stays at ``end``.

    ``value()`` at update ``k`` (``k`` = number of :meth:`step` calls so far) is
    ``start + (end - start) * min(k, total_updates) / total_updates``. CleanRL anneals the learning
    rate the same way (``frac = 1 - (iteration - 1) / num_iterations``) with ``end = 0``.

    Raises:
        ValueError: ``total_updates`` < 1.
    """

    def __init__(self, start: float, end: float, total_updates: int) -> None:
        if int(total_updates) < 1:
            raise ValueError(f"total_updates: expected >= 1, got {total_updates}")
        self.start = float(start)
        self.end = float(end)
        self.total_updates = int(total_updates)
        self.updates = 0

    def value(self) -> float:
        """The value for the next update."""
        fraction = min(self.updates, self.total_updates) / self.total_updates
        return self.start + (self.end - self.start) * fraction

    def step(self) -> None:
        """Advance by one update."""
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain-value state for a checkpoint."""
        return {
            "start": self.start,
            "end": self.end,
            "total_updates": self.total_updates,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raises ValueError naming a missing or invalid entry."""
        for key in ("start", "end", "total_updates", "updates"):
            if key not in state:
                raise ValueError(f"LinearSchedule state: missing {key!r}, got keys {sorted(state)}")
        if int(state["total_updates"]) < 1 or int(state["updates"]) < 0:
            raise ValueError(
                f"LinearSchedule state: expected total_updates >= 1 and updates >= 0, got "
                f"{state['total_updates']} and {state['updates']}"
            )
        self.start = float(state["start"])
        self.end = float(state["end"])
        self.total_updates = int(state["total_updates"])
        self.updates = int(state["updates"])
