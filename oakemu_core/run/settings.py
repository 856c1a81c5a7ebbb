"""What surrounds a run, as settings declared once: :class:`oakemu_core.config.OakEmuConfig` inherits
them (command-line flags, ``OAKEMU_*`` variables and TOML keys like every other setting).

:class:`RunSettings`: the run folder, its checkpoints, logging and experiment tracking.
:class:`RollbackSettings`: going back to the last good checkpoint when a run collapses
(:class:`oakemu_core.algo.health.HealthMonitor`). This module imports neither torch nor numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["RollbackSettings", "RunSettings"]


class RunSettings(BaseModel):
    """The run folder, checkpoints, logging and trackers (one line each; validated when built)."""

    model_config = ConfigDict(extra="forbid")

    # --- run folder and checkpoints ---
    runs_dir: Path = Field(Path("runs"), description="Folder holding run folders.")
    run_name: str | None = Field(
        None,
        min_length=1,
        description="Run folder name under runs_dir (default: <env>__<seed>__<YYYYmmdd-HHMMSS>). An existing "
        "run's name: oakemu train refuses it (--resume continues a run), oakemu learner resumes it.",
    )
    checkpoint_every_updates: int = Field(
        50, ge=0, description="Checkpoint every N updates (0: only at exit)."
    )
    checkpoint_every_seconds: float = Field(
        0.0, ge=0.0, description="Also checkpoint every N seconds of wall time (0: off)."
    )
    keep_checkpoints: int = Field(
        3, ge=1, description="Numbered checkpoints kept (the newest; best.pt and latest.pt apart)."
    )
    max_checkpoint_failures: int = Field(
        5,
        ge=1,
        description="Stop training after this many failed checkpoint writes in a row (full disk); "
        "fewer are logged, counted and retried at the next checkpoint.",
    )

    # --- logging ---
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="Python logging level."
    )
    log_format: Literal["auto", "rich", "plain", "json"] = Field(
        "auto",
        description="Log records: rich (terminal view), plain or json (one record per line); "
        "auto = rich when stderr is a terminal, else plain.",
    )

    # --- experiment tracking (oakemu_core/run/tracking.py; optional extras mlflow, wandb) ---
    track: Literal["none", "mlflow", "wandb"] = Field(
        "none",
        description="Also send the config, every scalar, the evaluation videos and the final checkpoint to "
        "MLflow or Weights & Biases (WANDB_MODE=offline works without a network).",
    )
    track_uri: str | None = Field(
        None,
        description="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the local file store ./mlruns).",
    )
    track_project: str = Field(
        "oakemu", min_length=1, description="MLflow experiment or W&B project name."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and ("/" in value or "\\" in value or value in (".", "..")):
            raise ValueError(
                f"expected a single folder name without path separators, received {value!r}"
            )
        return value


class RollbackSettings(BaseModel):
    """When a run counts as collapsed and how it rolls back (one line each; validated when built)."""

    model_config = ConfigDict(extra="forbid")

    # --- automatic rollback (see oakemu_core/algo/health.py HealthMonitor) ---
    rollback: bool = Field(
        True,
        description="Roll back to the last good checkpoint when the run collapses (non-finite loss or "
        "weights, approx KL above rollback_max_approx_kl, evaluation return collapsing), with the learning rate "
        "multiplied by rollback_lr_factor.",
    )
    rollback_max_approx_kl: float | None = Field(
        1.0, gt=0.0, description="approx KL of an update that counts as a collapse."
    )
    rollback_eval_fraction: float | None = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="An evaluation below this fraction of the best (from the worst) is low.",
    )
    rollback_eval_patience: int = Field(
        3, ge=1, description="Low evaluations in a row that count as a collapse."
    )
    rollback_lr_factor: float = Field(
        0.5, gt=0.0, le=1.0, description="Learning-rate multiplier per rollback."
    )
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks before the run stops with an error.")
