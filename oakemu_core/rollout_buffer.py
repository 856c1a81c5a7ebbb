"""Rollout buffer (stub: being completed by the rollout-core work)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RolloutMinibatch(NamedTuple):
    """One PPO minibatch, every tensor on the requested device, first dimension = batch B.

    observations ``(B, *obs_shape)`` in the stored dtype (uint8 frames stay uint8), actions
    ``(B, *action_shape)``, log_probs/values/advantages/returns ``(B,)`` float32.
    """

    observations: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
