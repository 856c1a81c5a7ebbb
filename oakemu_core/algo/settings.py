"""The PPO hyperparameters, declared once (CleanRL ``ppo_atari.py`` defaults).

:class:`PPOSettings` is what the PPO learner reads. :class:`oakemu_core.config.OakEmuConfig` inherits
its fields (so they are command-line flags, ``OAKEMU_*`` variables and TOML keys like every other
setting); :class:`oakemu_core.algo.learner.PPOLearner` and :class:`oakemu_core.algo.ppo.PPOUpdater`
take it whole. This module imports neither torch nor numpy (configuration parsing stays fast).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["PRECISIONS", "PPOSettings", "finite_number"]

PRECISIONS = ("float32", "bfloat16")
"""The learner's update precisions (``learner_precision``): plain float32, or bfloat16 mixed
precision (autocast) of the model's forward and backward passes."""


def finite_number(value: float) -> float:
    """``value`` when it is finite. Raises ValueError (the message names the received value)."""
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, received {value!r}")
    return value


class PPOSettings(BaseModel):
    """The PPO learner's hyperparameters (one line each; validated when built).

    Raises:
        pydantic.ValidationError (a ValueError): a value out of range, naming the field, the
            expected and the received value.
    """

    model_config = ConfigDict(extra="forbid")

    ppo_epochs: int = Field(4, ge=1, description="Passes over each rollout per PPO update.")
    num_minibatches: int = Field(4, ge=1, description="Minibatches per epoch.")
    clip_coef: float = Field(0.1, gt=0.0, description="PPO surrogate clipping coefficient epsilon.")
    clip_value_range: float | Literal["auto"] | None = Field(
        "auto",
        description="Clip the value change per update to +-this, in value units (None/null: plain MSE, SB3's "
        "default; auto: clip_coef for Atari ids as CleanRL, off otherwise).",
    )
    ent_coef: float = Field(0.01, ge=0.0, description="Entropy bonus coefficient.")
    vf_coef: float = Field(0.5, ge=0.0, description="Value loss coefficient.")
    gamma: float = Field(0.99, ge=0.0, le=1.0, description="Discount factor.")
    gae_lambda: float = Field(
        0.95, ge=0.0, le=1.0, description="GAE lambda (Schulman et al. 2016)."
    )
    max_grad_norm: float = Field(0.5, gt=0.0, description="Global gradient norm clip.")
    target_kl: float | None = Field(
        None, gt=0.0, description="Stop the epochs early above this approx KL."
    )
    normalize_advantages: bool = Field(
        True, description="Normalise advantages per minibatch (trainable rows)."
    )
    normalize_rewards: bool = Field(
        False,
        description="Scale training rewards by the running std of the discounted return (as SB3 VecNormalize).",
    )
    sequence_length: int | None = Field(
        None,
        ge=1,
        description="Recurrent policies: rows per training sequence, each started from its stored state "
        "(None: whole rollout columns, as CleanRL's LSTM PPO).",
    )
    max_policy_lag: int = Field(
        2, ge=0, description="Drop rows acted by a policy this many versions old."
    )
    off_policy_correction: Literal["decoupled", "none"] = Field(
        "decoupled",
        description="Rows acted by an older policy version (async mode): decoupled = re-evaluate them with the "
        "current weights and use the decoupled objective (Hilton et al. 2022) with weights capped at "
        "importance_weight_cap; none = plain PPO on them.",
    )
    importance_weight_cap: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Truncation of the decoupled objective's weights pi_current / pi_acting (V-trace's rho-bar).",
    )
    seed: int = Field(1, ge=0, description="Seed for envs, torch and numpy.")
    learner_precision: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Precision of the PPO update: float32, or bfloat16 mixed precision (torch.autocast; weights, "
        "optimizer and losses stay float32). Native on CPUs with AVX512-BF16 or AMX and recent GPUs only.",
    )
    compile_update: Literal["none", "default", "reduce-overhead"] = Field(
        "none",
        description="Run each minibatch's forward pass and PPO loss (and so their backward) through "
        "torch.compile: default (generated kernels) or reduce-overhead (also CUDA graphs on a GPU, where a "
        "small model's update is bound by kernel launches); none: eager. Compiles take seconds to a minute "
        "at the first minibatches; recurrent policies train eagerly.",
    )
    bc_pretrain_updates: int = Field(
        0, ge=0, description="Replay-only BC updates (one epoch each) before PPO."
    )
    bc_batch_size: int = Field(
        256, ge=1, description="Demonstration rows per BC update / per minibatch BC term."
    )
    bc_coef: float = Field(
        0.0, ge=0.0, description="Weight of a BC term in the PPO loss (0: none)."
    )
    bc_coef_decay: float = Field(1.0, gt=0.0, le=1.0, description="bc_coef multiplier per update.")

    @field_validator("clip_coef", "ent_coef", "vf_coef", "max_grad_norm")
    @classmethod
    def _check_finite_coefficient(cls, value: float) -> float:
        return finite_number(value)

    @field_validator("clip_value_range")
    @classmethod
    def _check_clip_value_range(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not value >= 0:
            raise ValueError(f"expected 'auto', None or a number >= 0, received {value!r}")
        return value

    @property
    def value_clip(self) -> float | None:
        """``clip_value_range`` as the loss takes it: a range in value units, or None (no clipping).
        ``"auto"`` is resolved by :meth:`from_config` from the env id; left unresolved it is None."""
        return None if self.clip_value_range == "auto" else self.clip_value_range

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> Any:
        """These settings from ``config`` (an :class:`~oakemu_core.config.OakEmuConfig`, other
        settings, or anything with the same attributes), then ``overrides`` by field name.
        ``clip_value_range`` is taken resolved where ``config`` can resolve it
        (``resolved_clip_value_range``: ``"auto"`` depends on the env id)."""
        values = {name: getattr(config, name) for name in cls.model_fields if hasattr(config, name)}
        if hasattr(config, "resolved_clip_value_range"):
            values["clip_value_range"] = config.resolved_clip_value_range
        return cls(**{**values, **overrides})
