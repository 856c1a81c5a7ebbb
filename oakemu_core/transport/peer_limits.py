"""What the learner takes from a peer beyond what the wire's fields can hold: the run's own limits.

The decoders (:mod:`~oakemu_core.transport.control`, :mod:`~oakemu_core.transport.steps`) check
each value against its field: types, shapes, finite floats, the schema's bounds (``|reward| <=
1e6``, ...). :class:`PeerLimits` checks what only the run's settings can tell, before anything
uses the value:

* a join: ``num_envs`` at most ``max_envs_per_actor`` (never below ``envs_per_actor``), and a new
  actor id only while fewer than ``max_connected_actors`` actors are connected;
* a step message, where the run bounds one step's reward ``R``: by reward clipping (``[-1, 1]``),
  by ``reward_low`` / ``reward_high``, or both (then the declared range clipped):

  - every reward within the bound;
  - every value estimate (``values``, ``bootstrap_values``, ``next_values``) within
    ``VALUE_BOUND_FACTOR * max(|R|, 1) / (1 - gamma)``: a discounted return cannot exceed
    ``max|R| / (1 - gamma)`` (Sutton and Barto 2018, eq. 3.10), and a value network that has not
    learnt yet overshoots it by far less than the factor. Not checked with ``normalize_rewards``
    (the learner's scale, which the actor's values follow, is not bounded) or ``gamma = 1``;
  - every episode return of an episode of ``L`` steps within ``[L * low, L * high]`` (declared
    range only: the returns are raw game scores, not clipped);

* the episodes of a step message, always: no more than the message has done rows (an env ends one
  episode per done row), each at least one step long and at most ``max_episode_steps`` when set.

A value that fails is a ``"value_range"`` rejection of the whole message: counted and logged (rate
limited) by the caller, never written. What an authenticated actor is still trusted with (the
content of its rows within these bounds): ``deploy/README.md``.

:class:`JoinRate` bounds how fast joins come from one host (the connection's peer address): a
token bucket of :data:`JOIN_BURST_PER_HOST` joins refilled at :data:`JOINS_PER_SECOND_PER_HOST`.
Every join a host's actors ask beyond it is answered "too many joins, retry in X s" (the actor
waits and asks again); each join can make a step ring, so a flood of joins would otherwise take
shared memory faster than the departed actors' timeouts free it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from oakemu_core.step_schema import SMALL_ARRAY_SIZE

if TYPE_CHECKING:
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.transport.control import JoinRequest
    from oakemu_core.transport.steps import StepMessage

__all__ = [
    "JOINS_PER_SECOND_PER_HOST",
    "JOIN_BURST_PER_HOST",
    "VALUE_BOUND_FACTOR",
    "JoinRate",
    "PeerLimits",
]

VALUE_BOUND_FACTOR = 10.0
"""Slack of the value-estimate bound over the largest discounted return (see the module docstring)."""

JOINS_PER_SECOND_PER_HOST = 10.0
"""Joins per second one host's actors may ask for, once its burst is spent (:class:`JoinRate`)."""

JOIN_BURST_PER_HOST = 32
"""Joins one host's actors may ask for at once: a machine's worth of actors starting together, or
rejoining a restarted learner."""

MAX_TRACKED_HOSTS = 4096
"""Hosts whose join buckets :class:`JoinRate` keeps; beyond, the buckets that are full again go."""

_VALUE_FIELDS = ("values", "bootstrap_values", "next_values")
_RETURN_TOLERANCE = 1e-6
"""Relative slack of the episode-return bound: the actor sums float64 rewards, each rounding once."""


@dataclass(frozen=True)
class PeerLimits:
    """A run's limits on what its actors send (see the module docstring); build with :meth:`from_config`.

    Attributes:
        max_envs: most envs one actor may step.
        max_actors: most actors connected at once.
        reward_bound: ``(low, high)`` of one step's training reward, None when the run does not bound it.
        return_bound: ``(low, high)`` of one step's raw reward (the declared range), None when undeclared.
        value_bound: largest ``|value estimate|``, None when not checked.
        max_episode_steps: longest episode (agent steps), None when the env's own limit applies.
        field_bounds: ``(field, low, high)`` of each step field these bounds tighten (float32, as the
            fields): what :meth:`check_step` checks first, and what a decoder may check in its own
            pass over the fields instead.
    """

    max_envs: int
    max_actors: int
    reward_bound: tuple[float, float] | None = None
    return_bound: tuple[float, float] | None = None
    value_bound: float | None = None
    max_episode_steps: int | None = None
    field_bounds: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        bounds = [] if self.reward_bound is None else [("rewards", *self.reward_bound)]
        if self.value_bound is not None:
            bounds += [(name, -self.value_bound, self.value_bound) for name in _VALUE_FIELDS]
        object.__setattr__(
            self,
            "field_bounds",
            tuple(
                (name, float(np.float32(low)), float(np.float32(high)))
                for name, low, high in bounds
            ),
        )

    @classmethod
    def from_config(cls, config: OakEmuConfig) -> PeerLimits:
        """The limits of ``config`` (``max_envs_per_actor``, ``max_connected_actors``, ``reward_low`` /
        ``reward_high``, ``resolved_clip_rewards``, ``gamma``, ``normalize_rewards``, ``max_episode_steps``)."""
        declared = (
            None
            if config.reward_low is None
            else (float(config.reward_low), float(config.reward_high))
        )
        reward_bound = declared
        if config.resolved_clip_rewards:
            low, high = declared or (-1.0, 1.0)
            reward_bound = (min(max(low, -1.0), 1.0), min(max(high, -1.0), 1.0))
        value_bound = None
        if reward_bound is not None and not config.normalize_rewards and config.gamma < 1.0:
            largest = max(abs(reward_bound[0]), abs(reward_bound[1]), 1.0)
            value_bound = VALUE_BOUND_FACTOR * largest / (1.0 - config.gamma)
        return cls(
            max_envs=max(config.max_envs_per_actor, config.envs_per_actor),
            max_actors=config.max_connected_actors,
            reward_bound=reward_bound,
            return_bound=declared,
            value_bound=value_bound,
            max_episode_steps=config.max_episode_steps,
        )

    def check_join(self, request: JoinRequest, *, connected: int, known: bool) -> str | None:
        """Why ``request`` is refused, or None. ``connected``: actors connected now; ``known``:
        whether the request's actor id is one of them (its rejoin takes no further place)."""
        if request.num_envs > self.max_envs:
            return f"num_envs: expected at most max_envs_per_actor={self.max_envs}, received {request.num_envs}"
        if not known and connected >= self.max_actors:
            return f"max_connected_actors={self.max_actors} actors are connected"
        return None

    def check_step(self, message: StepMessage) -> str | None:
        """Why ``message`` (decoded: dtypes, shapes and the schema's bounds already checked) holds
        values no actor of this run can send, or None."""
        fields = message.fields
        for name, low, high in self.field_bounds:
            problem = _outside(fields[name], name, low, high) if name in fields else None
            if problem:
                return problem
        if message.episode_returns:
            return self._check_episodes(message)
        return None

    def _check_episodes(self, message: StepMessage) -> str | None:
        done_rows = (
            int(np.count_nonzero(message.fields["dones"])) if "dones" in message.fields else 0
        )
        if len(message.episode_returns) > done_rows:
            return (
                f"episode_returns: expected at most one episode per done row ({done_rows}), received "
                f"{len(message.episode_returns)}"
            )
        longest = self.max_episode_steps
        for episode_return, length in zip(message.episode_returns, message.episode_lengths):
            if length < 1 or (longest is not None and length > longest):
                return f"episode_lengths: expected 1..{longest or 'any'} steps, received {length}"
            if self.return_bound is not None:
                low, high = self.return_bound
                slack = _RETURN_TOLERANCE * length * max(abs(low), abs(high), 1.0)
                if not length * low - slack <= episode_return <= length * high + slack:
                    return (
                        f"episode_returns: an episode of {length} steps returns within "
                        f"[{length * low:g}, {length * high:g}] (reward_low / reward_high), received "
                        f"{episode_return:g}"
                    )
        return None


def _outside(array: np.ndarray, name: str, low: float, high: float) -> str | None:
    """A message naming ``name`` when an element of ``array`` lies outside ``[low, high]``, else None."""
    if (
        array.size <= SMALL_ARRAY_SIZE
    ):  # Python's min / max of a list beat numpy's fixed cost (as check_values)
        values = array.ravel().tolist()
        smallest, largest = min(values), max(values)
    else:
        flat = array.reshape(-1)
        smallest, largest = np.minimum.reduce(flat), np.maximum.reduce(flat)
    if smallest < low or largest > high:
        return f"{name}: expected values in [{low:g}, {high:g}] for this run, received [{smallest:g}, {largest:g}]"
    return None


class JoinRate:
    """A token bucket of joins per peer host: ``burst`` joins at once, then ``per_second``.

    Args:
        per_second: tokens (joins) a host's bucket gains per second, > 0.
        burst: tokens a bucket holds at most (a new host starts full), >= 1.
    """

    def __init__(
        self, per_second: float = JOINS_PER_SECOND_PER_HOST, burst: int = JOIN_BURST_PER_HOST
    ) -> None:
        if not per_second > 0 or burst < 1:
            raise ValueError(
                f"per_second > 0 and burst >= 1 expected, received {per_second!r} and {burst!r}"
            )
        self.per_second = float(per_second)
        self.burst = float(burst)
        self._buckets: dict[
            str, tuple[float, float]
        ] = {}  # host -> (tokens, monotonic time of that count)

    def take(self, host: str, now: float) -> float:
        """Take one join of ``host`` at monotonic time ``now`` (s): 0.0 when it may join now (a token
        taken), else the seconds until its bucket holds a token again (nothing taken)."""
        tokens, then = self._buckets.get(host, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - then) * self.per_second)
        if tokens >= 1.0:
            self._buckets[host] = (tokens - 1.0, now)
            if len(self._buckets) > MAX_TRACKED_HOSTS:
                self._forget_full(now)
            return 0.0
        self._buckets[host] = (tokens, now)
        return (1.0 - tokens) / self.per_second

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled (a host that comes back starts full all the same)."""
        for host, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * self.per_second >= self.burst:
                del self._buckets[host]
