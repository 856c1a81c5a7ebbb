"""The PPO loss terms of one minibatch, and the one normalisation of its advantages.

References:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate, eq. 7;
    total objective with value and entropy terms, eq. 9).
    Huang et al. 2022, "The 37 Implementation Details of Proximal Policy Optimization" and CleanRL
    (value clipping as in OpenAI baselines, approximate KL ``mean((ratio - 1) - log ratio)``,
    the k3 estimator of http://joschu.net/blog/kl-approx.html; advantages normalised per
    minibatch).
"""

from __future__ import annotations

import torch

__all__ = ["normalize_advantages", "ppo_losses"]


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over one minibatch's ``(B,)`` advantages (population std,
    as SB3 and CleanRL): the only place advantages are normalised. Every row of a minibatch is
    trainable (the flat batch holds the trainable rows only), so no mask enters the statistics.
    Returns a new ``(B,)`` tensor of the input's dtype and device."""
    return (advantages - advantages.mean()) / (advantages.std(correction=0) + eps)


def ppo_losses(
    new_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    *,
    clip_coef: float,
    clip_value_range: float | None,
    importance_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The PPO loss terms for one minibatch. All inputs are ``(B,)`` float tensors.

    Args:
        new_log_probs: log pi_theta(a|s) under the policy being trained (with gradients).
        old_log_probs: log pi_theta_old(a|s): recorded by the actor, or with the decoupled
            objective the proximal policy's (the learner's weights before the update).
        advantages: advantage estimates (already normalised if wanted).
        new_values: V_theta(s) (with gradients). old_values: V recorded by the actor, or
            re-evaluated by the learner before the update (decoupled objective).
        returns: value targets (GAE advantages + old values).
        entropy: per-row entropy of the current policy.
        clip_coef: epsilon of the clipped surrogate; also the value clip range.
        clip_value_range: clip the value change to ``[-c, c]`` around the actor's value, in value
            units (OpenAI baselines / CleanRL use the policy's clip coefficient); None: plain
            MSE (SB3's default). A range tiny next to the returns freezes the critic on the
            clipped rows, so it is its own setting, not ``clip_coef``.
        importance_weights: ``(B,)`` weights ``pi_prox(a|s) / mu(a|s)`` (proximal over behaviour
            policy), without gradients, multiplying each row's clipped surrogate: the decoupled
            PPO objective of Hilton, Cobbe and Schulman 2022, "Batch size-invariance for policy
            optimization" (the clip keeps the update near the proximal policy; the weights correct
            for the behaviour policy). The caller may truncate them (V-trace's rho-bar). None:
            every weight 1 (plain PPO).

    Returns:
        A dict of scalar tensors ``policy_loss`` (to minimise: minus eq. 7 of Schulman et al.
        2017, ``mean(max(-A r, -A clip(r, 1-eps, 1+eps)))``), ``value_loss``
        (``0.5 * mean((V - R)^2)``, or with clipping
        ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2))``), ``entropy``
        (mean), and without gradients ``approx_kl`` (``mean((r - 1) - log r)``), ``clip_fraction``
        (share of rows with ``|r - 1| > eps``); plus ``ratio``, the ``(B,)`` ratios ``r``.
    """
    log_ratio = new_log_probs - old_log_probs
    ratio = log_ratio.exp()

    # Clipped surrogate objective (Schulman et al. 2017, eq. 7), negated to be minimised.
    policy_loss_unclipped = -advantages * ratio
    policy_loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    policy_loss_rows = torch.max(policy_loss_unclipped, policy_loss_clipped)
    if importance_weights is not None:
        policy_loss_rows = importance_weights * policy_loss_rows
    policy_loss = policy_loss_rows.mean()

    # Value loss, optionally clipped around the actor's value estimate.
    value_loss_unclipped = (new_values - returns) ** 2
    if clip_value_range is not None:
        values_clipped = old_values + torch.clamp(
            new_values - old_values, -clip_value_range, clip_value_range
        )
        value_loss_clipped = (values_clipped - returns) ** 2
        value_loss = 0.5 * torch.max(value_loss_unclipped, value_loss_clipped).mean()
    else:
        value_loss = 0.5 * value_loss_unclipped.mean()

    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()
        clip_fraction = ((ratio - 1.0).abs() > clip_coef).float().mean()

    return {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy.mean(),
        "approx_kl": approx_kl,
        "clip_fraction": clip_fraction,
        "ratio": ratio.detach(),
    }
