"""``best.pt``: the checkpoint of a run's best evaluation, kept by the learner from the tester's reports.

:class:`BestCheckpointTracker` receives every :class:`oakemu_core.run.tester.EvaluationReport` (through
``oakemu_core.algo.health``) and writes ``run_dir/checkpoints/best.pt`` when the report's mean return is
finite and strictly above the best so far, with the *evaluated* weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BEST_NAME", "BestCheckpointTracker", "is_new_best"]

logger = logging.getLogger(__name__)

BEST_NAME = "best.pt"
"""File name of the best evaluated checkpoint, next to ``latest.pt`` in ``run_dir/checkpoints/``."""


def is_new_best(mean_return: float, best_return: float) -> bool:
    """The rule of ``best.pt`` (and of the tester's ``videos/best.mp4``): a finite mean return strictly
    above the best so far (``-inf`` before the first)."""
    return math.isfinite(mean_return) and mean_return > best_return


class BestCheckpointTracker:
    """Keeps ``run_dir/checkpoints/best.pt``: the checkpoint of the best evaluation so far.

    :meth:`consider` writes ``best.pt`` (atomically, :func:`oakemu_core.run.checkpoint.save_checkpoint`)
    only when a report's mean return is finite and strictly above the best so far. The file is the
    learner's usual checkpoint dict (``state_fn()``) with two changes: ``state["model"]`` holds the
    *evaluated* weights (the report's, cast to the dtypes of ``state["model"]``), not the newer ones
    the learner trained since, and ``state["best_evaluation"]`` records the evaluation (policy
    version, global step, mean/std return, mean length, episodes, greedy). The optimizer and
    counters in it are those of the moment of writing: best.pt is for ``oakemu evaluate`` and
    deployment, ``latest.pt`` for resuming. ``oakemu evaluate run/checkpoints/best.pt`` works.

    Args:
        run_dir: the run folder.
        best_return: the best mean return so far; None reads it from an existing ``best.pt``
            (its ``best_evaluation``), else starts at minus infinity.
    """

    def __init__(self, run_dir: Path, *, best_return: float | None = None) -> None:
        from oakemu_core.run.checkpoint import CHECKPOINT_DIR_NAME

        self.path = Path(run_dir) / CHECKPOINT_DIR_NAME / BEST_NAME
        """Where best.pt lives."""
        self.best_return = -math.inf if best_return is None else float(best_return)
        """Mean return of the evaluation in best.pt (-inf before the first)."""
        self.best_policy_version: int | None = None
        """Policy version of the weights in best.pt (None before the first, or unknown)."""
        if best_return is None and self.path.is_file():
            self._read_existing()

    def _read_existing(self) -> None:
        from oakemu_core.run.checkpoint import CheckpointError, load_checkpoint

        try:
            info = load_checkpoint(self.path).get("best_evaluation") or {}
        except (CheckpointError, OSError) as exc:
            logger.warning(
                "best checkpoint %s is unreadable (%s); the next evaluation replaces it",
                self.path,
                exc,
            )
            return
        value = info.get("return_mean")
        if isinstance(value, (int, float)) and math.isfinite(value):
            self.best_return = float(value)
            self.best_policy_version = info.get("policy_version")

    def consider(self, report: Any, state_fn: Callable[[], dict[str, Any]]) -> bool:
        """Write ``best.pt`` when ``report`` beats the best so far.

        Args:
            report: a finished evaluation (its ``weights`` replace ``state["model"]`` when present).
            state_fn: returns the learner's checkpoint dict (``model``, ``optimizer``, ``env``,
                ``config``, ...); called only when the report is better.

        Returns:
            True when best.pt was written.

        Raises:
            ValueError: the report's weights do not fit ``state["model"]`` (names or shapes); nothing
                is written. TypeError/OSError as :func:`oakemu_core.run.checkpoint.save_checkpoint`
                (the previous best.pt stays; the best so far is unchanged).
        """
        from oakemu_core.run.checkpoint import save_checkpoint

        mean = float(report.return_mean)
        if not is_new_best(mean, self.best_return):
            return False
        state = dict(state_fn())
        if report.weights is not None:
            state["model"] = _weights_as_state_dict(report.weights, state.get("model"))
        state["best_evaluation"] = {
            "policy_version": int(report.policy_version),
            "global_step": int(report.global_step),
            "return_mean": mean,
            "return_std": float(report.return_std),
            "length_mean": float(report.length_mean),
            "episodes": int(report.episodes),
            "greedy": bool(report.greedy),
            "finished_at": float(report.finished_at),
        }
        save_checkpoint(self.path, state)
        self.best_return = mean
        self.best_policy_version = int(report.policy_version)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the learner's checkpoint (``best_return`` is None before the first)."""
        return {
            "best_return": None if math.isinf(self.best_return) else self.best_return,
            "best_policy_version": self.best_policy_version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (a resumed run only replaces best.pt when it improves)."""
        value = state.get("best_return")
        self.best_return = -math.inf if value is None else float(value)
        self.best_policy_version = state.get("best_policy_version")


def _weights_as_state_dict(weights: Mapping[str, np.ndarray], model_state: Any) -> dict[str, Any]:
    import torch

    if isinstance(model_state, Mapping):
        missing, extra = (
            sorted(set(model_state) - set(weights)),
            sorted(set(weights) - set(model_state)),
        )
        if missing or extra:
            raise ValueError(
                f"best checkpoint: evaluated weights do not fit the model: missing {missing}, "
                f"unexpected {extra}"
            )
    result: dict[str, Any] = {}
    for name, array in weights.items():
        tensor = torch.from_numpy(np.array(array, copy=True))
        if isinstance(model_state, Mapping):
            reference = model_state[name]
            if tuple(reference.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"best checkpoint: weights[{name!r}] has shape {tuple(tensor.shape)}, the model "
                    f"{tuple(reference.shape)}"
                )
            tensor = tensor.to(reference.dtype)
        result[name] = tensor
    return result
