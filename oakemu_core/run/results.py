"""What a finished run folder says about the run: :class:`Run` (the Python API's ``train`` returns one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oakemu_core.errors import CheckpointError
from oakemu_core.run.checkpoint_paths import CHECKPOINT_DIR_NAME, latest_checkpoint
from oakemu_core.run.metrics import (
    EPISODIC_RETURN,
    EVAL_EPISODIC_RETURN,
    METRICS_FILE_NAME,
    SPS,
    record_number,
)
from oakemu_core.run.run_folder import read_json_lines

if TYPE_CHECKING:
    from oakemu_core.run.loading import Policy

__all__ = ["Run", "read_run"]

BEST_CHECKPOINT_NAME = "best.pt"


@dataclass(frozen=True)
class Run:
    """A run folder's outcome, read from ``metrics.jsonl`` and ``checkpoints/``.

    Attributes:
        run_dir: the run folder.
        exit_status: ``oakemu train``'s exit status (0: the budget was trained).
        updates: PPO updates recorded (``charts/update`` of the last update record; 0 for none).
        global_step: env steps received by the last update record.
        final_evaluation: mean raw return of the last evaluation (the final weights' when it finished in
            time), None when the run was never evaluated.
        best_evaluation: the highest evaluation mean return of the run, None without evaluations.
        latest_checkpoint: the newest checkpoint, the one a resume starts from (never ``best.pt``), None when
            none was written.
        best_checkpoint: ``checkpoints/best.pt`` (the best evaluation's weights), None when absent.
        stopped_by_callback: a callback of ``train`` stopped the run before its budget was spent.
        episodic_return: mean training return (the episode window's) of the last update record, None
            without one or before any episode finished.
        sps: env steps per second since the learner started, of the last update record (None without one).
    """

    run_dir: Path
    exit_status: int
    updates: int
    global_step: int
    final_evaluation: float | None
    best_evaluation: float | None
    latest_checkpoint: Path | None
    best_checkpoint: Path | None
    stopped_by_callback: bool = False
    episodic_return: float | None = None
    sps: float | None = None

    def load_policy(self, *, best: bool = False) -> Policy:
        """The policy of the latest checkpoint, or of ``best.pt`` (``best=True``).

        Raises:
            oakemu_core.errors.CheckpointError: the run has no such checkpoint.
        """
        from oakemu_core.run.loading import load_policy

        if best and self.best_checkpoint is None:
            raise CheckpointError(
                f"{self.run_dir}: no {BEST_CHECKPOINT_NAME} (the run was never evaluated)"
            )
        return load_policy(self.best_checkpoint if best else self.run_dir)


def read_run(run_dir: str | Path, exit_status: int = 0) -> Run:
    """The :class:`Run` of ``run_dir`` (a missing ``metrics.jsonl`` reads as no records, a torn line is skipped)."""
    run_dir = Path(run_dir)
    updates: list[dict[str, Any]] = []
    evaluations: list[float] = []
    for record in read_json_lines(run_dir / METRICS_FILE_NAME):
        if "charts/update" in record:
            updates.append(record)
        value = record.get(EVAL_EPISODIC_RETURN)
        if isinstance(value, (int, float)):
            evaluations.append(float(value))
    best = run_dir / CHECKPOINT_DIR_NAME / BEST_CHECKPOINT_NAME
    return Run(
        run_dir=run_dir,
        exit_status=int(exit_status),
        updates=int(updates[-1]["charts/update"]) if updates else 0,
        global_step=int(updates[-1]["global_step"]) if updates else 0,
        final_evaluation=evaluations[-1] if evaluations else None,
        best_evaluation=max(evaluations) if evaluations else None,
        latest_checkpoint=latest_checkpoint(run_dir),
        best_checkpoint=best if best.is_file() else None,
        episodic_return=record_number(updates[-1], EPISODIC_RETURN) if updates else None,
        sps=record_number(updates[-1], SPS) if updates else None,
    )
