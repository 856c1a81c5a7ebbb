"""The periodic evaluation's settings, declared once: :class:`oakemu_core.config.OakEmuConfig` inherits
them (command-line flags, ``OAKEMU_*`` variables and TOML keys like every other setting), and
:func:`oakemu_core.run.tester.tester_from_config` reads them.

The defaults keep the tester cheap next to training: periodic evaluations are paced to a tenth of the
wall time (``eval_max_share``) and only the best, the final and every tenth evaluation are recorded as
video (``eval_video_every``). This module imports neither torch nor numpy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EvaluationSettings"]


class EvaluationSettings(BaseModel):
    """When the tester (oakemu_core/run/tester.py: a process of its own, envs that never feed the buffer)
    evaluates, how, and which evaluations it records as video (one line each; validated when built)."""

    model_config = ConfigDict(extra="forbid")

    eval_every_updates: int = Field(
        10,
        ge=0,
        description="Evaluate the newest weights every N PPO updates (paced by eval_max_share) and at "
        "the end (0: never).",
    )
    eval_max_share: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Pace periodic evaluations so the tester is busy at most this share of the "
        "wall time: one that took s seconds lets the next start s / share seconds after it started (1: no pacing).",
    )
    eval_episodes: int = Field(
        5, ge=1, description="Episodes per evaluation (raw, unclipped episodic return)."
    )
    eval_greedy: bool | Literal["auto"] = Field(
        "auto",
        description="Evaluate with the policy's mode (greedy) instead of sampling; auto: greedy except for Atari "
        "ids, whose early greedy policies may never serve the ball (rl-zoo's choice).",
    )
    eval_video: bool = Field(
        True,
        description="Record evaluation videos (an episode's full-colour frames) in run_dir/videos/ and "
        "TensorBoard: best.mp4 of the best evaluation so far, final.mp4 of the last, update_<N>.mp4 of every "
        "eval_video_every-th (needs the video extra: pip install 'oakemu-rl[video]').",
    )
    eval_video_every: int = Field(
        10,
        ge=0,
        description="Also record every N-th evaluation, the first included, as update_<N>.mp4 (0: only "
        "best.mp4 and final.mp4).",
    )
