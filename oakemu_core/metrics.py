"""Training metrics: a moving window of finished episodes, and a logger that writes every scalar
both to TensorBoard event files and to a JSON-lines file.

Scalar names follow CleanRL (``ppo_atari.py``) so TensorBoard charts look familiar:
``charts/episodic_return``, ``charts/episodic_length``, ``charts/learning_rate``, ``charts/SPS``,
``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy``, ``losses/approx_kl``,
``losses/clipfrac``, ``losses/explained_variance``.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from oakemu_core.ppo import PPOUpdateStats

__all__ = [
    "EPISODIC_LENGTH",
    "EPISODIC_RETURN",
    "LEARNING_RATE",
    "METRICS_FILE_NAME",
    "SPS",
    "EpisodeWindow",
    "MetricsLogger",
    "episode_scalars",
    "update_scalars",
]

METRICS_FILE_NAME = "metrics.jsonl"
EPISODIC_RETURN = "charts/episodic_return"
EPISODIC_LENGTH = "charts/episodic_length"
LEARNING_RATE = "charts/learning_rate"
SPS = "charts/SPS"


class EpisodeWindow:
    """The returns and lengths of the last ``maxlen`` finished episodes.

    Returns are the raw game score (undiscounted sum of unclipped rewards); lengths are in env
    steps (agent steps, after frame skip). ``mean``/``min``/``max`` are over the window's returns
    and are NaN while it is empty; ``total_episodes`` counts every episode ever added.

    Raises:
        ValueError: ``maxlen`` < 1.
    """

    def __init__(self, maxlen: int = 100) -> None:
        if int(maxlen) < 1:
            raise ValueError(f"maxlen: expected >= 1, got {maxlen}")
        self.maxlen = int(maxlen)
        self._returns: deque[float] = deque(maxlen=self.maxlen)
        self._lengths: deque[int] = deque(maxlen=self.maxlen)
        self.total_episodes = 0

    def add(self, returns: Iterable[float] | float, lengths: Iterable[int] | int) -> None:
        """Add finished episodes: ``returns`` and ``lengths`` are scalars or equal-length 1-D
        sequences (for example float32/int arrays from one step message).

        Raises:
            ValueError: the two have different lengths.
        """
        returns_array = np.atleast_1d(np.asarray(returns, dtype=np.float64))
        lengths_array = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
        if returns_array.shape != lengths_array.shape or returns_array.ndim != 1:
            raise ValueError(
                f"returns/lengths: expected equal-length 1-D sequences, got shapes {returns_array.shape} "
                f"and {lengths_array.shape}"
            )
        self._returns.extend(returns_array.tolist())
        self._lengths.extend(lengths_array.tolist())
        self.total_episodes += len(returns_array)

    @property
    def count(self) -> int:
        """Number of episodes in the window (at most ``maxlen``)."""
        return len(self._returns)

    @property
    def mean(self) -> float:
        """Mean return over the window (NaN if empty)."""
        return float(np.mean(self._returns)) if self._returns else math.nan

    @property
    def min(self) -> float:
        """Lowest return in the window (NaN if empty)."""
        return float(np.min(self._returns)) if self._returns else math.nan

    @property
    def max(self) -> float:
        """Highest return in the window (NaN if empty)."""
        return float(np.max(self._returns)) if self._returns else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the window's returns (NaN if empty)."""
        return float(np.std(self._returns)) if self._returns else math.nan

    @property
    def mean_length(self) -> float:
        """Mean episode length in env steps over the window (NaN if empty)."""
        return float(np.mean(self._lengths)) if self._lengths else math.nan

    def returns(self) -> list[float]:
        """The window's returns, oldest first."""
        return list(self._returns)


def episode_scalars(window: EpisodeWindow) -> dict[str, float]:
    """``charts/episodic_return`` and ``charts/episodic_length``: window means; {} while empty."""
    if window.count == 0:
        return {}
    return {EPISODIC_RETURN: window.mean, EPISODIC_LENGTH: window.mean_length}


def update_scalars(stats: PPOUpdateStats) -> dict[str, float]:
    """The scalars of one PPO update under CleanRL's names, plus our own ``diagnostics/*``
    (first-minibatch ratio deviation, epochs completed, update seconds, skipped non-finite
    minibatches)."""
    return {
        "losses/policy_loss": float(stats.policy_loss),
        "losses/value_loss": float(stats.value_loss),
        "losses/entropy": float(stats.entropy),
        "losses/approx_kl": float(stats.approx_kl),
        "losses/clipfrac": float(stats.clip_fraction),
        "losses/explained_variance": float(stats.explained_variance),
        LEARNING_RATE: float(stats.learning_rate),
        "diagnostics/first_minibatch_ratio_max_abs_dev": float(stats.first_minibatch_ratio_max_abs_dev),
        "diagnostics/epochs_completed": float(stats.epochs_completed),
        "diagnostics/update_seconds": float(stats.update_seconds),
        "diagnostics/nonfinite_minibatches": float(stats.nonfinite_minibatches),
    }


class StepRateMeter:
    """Env steps per second (SPS) over a sliding window of ``(time, total steps)`` samples.

    Call :meth:`sample` periodically with a monotonic time (s) and the running step count; :attr:`rate`
    is ``(steps_last - steps_first) / (time_last - time_first)`` over the window (0.0 until two
    samples span a positive time), never negative.
    """

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=window)

    def sample(self, now: float, total_steps: int) -> None:
        """Record the running step count at time ``now`` (seconds, monotonic)."""
        self._samples.append((now, int(total_steps)))

    @property
    def rate(self) -> float:
        """Steps per second over the window."""
        if len(self._samples) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return max(0.0, (s1 - s0) / (t1 - t0)) if t1 > t0 else 0.0


class MetricsLogger:
    """Writes scalars to TensorBoard event files in ``run_dir`` and to ``run_dir/metrics.jsonl``.

    Each :meth:`log` call appends one JSON object per line:
    ``{"global_step": int, "wall_time": float (Unix seconds), "<name>": value, ...}``; NaN and
    infinities are written as ``null`` so every line is strict JSON. The file is opened in append
    mode, so a resumed run continues the same log. Usable as a context manager.
    """

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard; only loggers need it

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / METRICS_FILE_NAME
        self._writer = SummaryWriter(log_dir=str(self.run_dir))
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._closed = False

    def log(self, global_step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` at ``global_step`` (env steps so far).

        Raises:
            TypeError: a name is not a str or a value is not a real number (names the entry).
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger: log() after close()")
        record: dict[str, Any] = {"global_step": int(global_step), "wall_time": time.time()}
        values: dict[str, float] = {}
        for name, value in scalars.items():
            if not isinstance(name, str):
                raise TypeError(f"scalars: name {name!r} must be a str, got {type(name).__name__}")
            if not isinstance(value, numbers.Real) and not (isinstance(value, np.ndarray) and value.size == 1):
                raise TypeError(f"scalars[{name!r}]: expected a real number, got {type(value).__name__}")
            values[name] = float(value)
        for name, value in values.items():
            self._writer.add_scalar(name, value, int(global_step))
            record[name] = value if math.isfinite(value) else None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def flush(self) -> None:
        """Push buffered TensorBoard events and JSON lines to disk."""
        self._writer.flush()
        self._jsonl.flush()

    def close(self) -> None:
        """Flush and close both outputs; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
