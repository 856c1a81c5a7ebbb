"""Action distributions: every difference between action spaces lives here.

One :class:`ActionDistribution` describes the policy's output family for one action space
(Stable-Baselines3 ``common/distributions.py`` and Sample Factory ``action_distributions.py`` are
the models). It tells the rest of the system

* what the policy head outputs (:attr:`ActionDistribution.param_size` numbers per observation,
  plus any free parameter it owns, made by :meth:`ActionDistribution.make_head`),
* what an action looks like (:attr:`action_shape`, :attr:`action_dtype`) and which values are
  possible (:meth:`action_bounds`), what the env receives (:meth:`env_actions`),
* which extra per-step fields it stores (:meth:`stored_fields`: the Gaussian's ``action_mean``
  and ``action_std``), and the width of its action mask (:attr:`mask_width`, 0 = no mask),

and builds a :class:`Policy` for a batch (:meth:`ActionDistribution.policy`) with ``sample``,
``log_prob``, ``entropy``, ``mode`` (greedy evaluation) and ``kl_from`` (exact KL from stored
parameters where they exist). The model and the PPO loss call these and never ask which space
it is.

Families (``B`` = batch):

====================  ======================  =============  ==========================================
space                 distribution            actions        mask (bool, per row)
====================  ======================  =============  ==========================================
``Discrete(n)``       categorical             ``()`` int64   ``(n,)``: allowed actions
``MultiDiscrete(v)``  product of categoricals ``(k,)`` int64 ``(sum v,)``: per sub-action, concatenated
``MultiBinary(k)``    product of Bernoullis   ``(k,)`` int8  ``(2k,)``: per bit [may be 0, may be 1]
``Box((d,))``         diagonal Gaussian       ``(d,)`` f32   none
====================  ======================  =============  ==========================================

Masked actions get probability exactly 0 (their logits are replaced by the most negative float32,
whose softmax weight underflows to 0), so they are never sampled, their log-probability terms
never enter the entropy, and the entropy is over the valid actions only (Huang & Ontañón 2020,
"A Closer Look at Invalid Action Masking in Policy Gradient Algorithms"). A row whose mask allows
nothing is a caller error caught where masks enter the system (env adapter, wire decoder), not
here: checking would synchronise the device on every minibatch.

The Gaussian has a state-independent log standard deviation (CleanRL ``ppo_continuous_action.py``,
SB3): the log-probability is of the action as sampled; the env receives it clipped to the space's
bounds (:meth:`DiagGaussian.env_actions`), so no tanh correction is needed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "ActionDistribution",
    "Bernoulli",
    "Categorical",
    "DiagGaussian",
    "MultiCategorical",
    "Policy",
    "distribution_for_env",
    "distribution_for_space",
    "distribution_from_dict",
]

_MASKED_LOGIT = torch.finfo(torch.float32).min
"""Logit of a masked action: exp(min - max) underflows to exactly 0 in float32 (no inf, no NaN)."""
_FORCED_LOGIT = 1e9
"""Bernoulli logit of a bit forced by its mask: sigmoid(+-1e9) is exactly 1 or 0 in float32."""


def _layer_init(layer: nn.Linear, std: float) -> nn.Linear:
    """Orthogonal weights with gain ``std``, zero bias (CleanRL ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


# ---------------------------------------------------------------------------------------------
# Per-batch policies
# ---------------------------------------------------------------------------------------------
class Policy(ABC):
    """The action distribution for one batch of ``B`` observations (torch tensors, with gradients)."""

    @abstractmethod
    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Actions ``(B, *action_shape)`` drawn from the distribution (no gradient)."""

    @abstractmethod
    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        """``(B,)`` float32 log pi(actions), summed over sub-actions / dimensions."""

    @abstractmethod
    def entropy(self) -> torch.Tensor:
        """``(B,)`` float32 entropy, summed over sub-actions / dimensions (valid actions only)."""

    @abstractmethod
    def mode(self) -> torch.Tensor:
        """The most probable actions ``(B, *action_shape)`` (greedy evaluation)."""

    def stored(self) -> dict[str, torch.Tensor]:
        """Parameters stored with every step (see :meth:`ActionDistribution.stored_fields`)."""
        return {}

    def kl_from(self, stored: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``(B,)`` exact KL(old || self) from the stored parameters of the acting policy, or None
        when the family stores none (PPO then uses the ratio-based estimate)."""
        return None


def _categorical_terms(
    logits: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax (B, n), probabilities (B, n))`` with masked entries at probability 0."""
    if mask is not None:
        logits = torch.where(mask, logits, torch.full_like(logits, _MASKED_LOGIT))
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs, log_probs.exp()


def _categorical_entropy(log_probs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    # p * log p is 0 for p = 0 (a masked action); where() keeps 0 * (-3.4e38) out of the sum.
    return -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1)


def _sample_categorical(log_probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of ``(B, n)`` log-probabilities, by the Gumbel-max trick (see
    :func:`_gumbel_argmax`); the uniform noise is drawn on the generator's device. Cheaper than
    ``torch.multinomial`` for the small batches an actor samples every step."""
    noise_device = generator.device if generator is not None else log_probs.device
    uniform = torch.rand(log_probs.shape, generator=generator, device=noise_device)
    return _gumbel_argmax(log_probs, uniform.to(log_probs.device))


def _gumbel_argmax(log_probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``argmax(log p + G)`` with ``G = -log(-log U)`` for ``U`` in ``[0, 1)``: an exact sample of
    the categorical when ``U ~ Uniform[0, 1)`` (Gumbel 1954; Maddison et al. 2014, "A* Sampling").

    ``U`` is raised to the smallest normal float first: ``torch.rand`` returns exactly 0 about once
    in 2^24 draws, whose noise ``-inf`` would push a legal action below a masked one. With the raise
    the noise lies in about [-4.5, 16.6], so a masked entry (log p about -3.4e38) never wins.
    NaN log-probabilities (broken weights) give an arbitrary index with a NaN log-prob; the learner
    rejects and counts such a step message (floats are checked finite on the wire), where
    ``torch.multinomial`` made the actor raise."""
    uniform = uniform.clamp(min=torch.finfo(uniform.dtype).tiny)
    gumbel = -torch.log(-torch.log(uniform))
    return (log_probs + gumbel).argmax(dim=-1)


def sample_categorical_numpy(
    logits: np.ndarray, mask: np.ndarray | None, uniform: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:class:`CategoricalPolicy`'s ``sample`` and ``log_prob`` in numpy, for actors whose forward
    pass runs in numpy (:class:`oakemu_core.policy.numpy_inference.NumpyForward`).

    Args:
        logits: ``(B, n)`` float32.
        mask: ``(B, n)`` bool (True: allowed) or None.
        uniform: ``(B, n)`` float32 noise in ``[0, 1)``: the torch path's draws
            (:func:`_sample_categorical`), so the same generator gives the same actions.

    Returns:
        ``(actions (B,) int64, log_probs (B,) float32)``: the Gumbel-max sample of
        :func:`_gumbel_argmax` and its log-probability by log-softmax, equal to the torch path's up
        to float32 rounding.
    """
    if mask is not None:
        logits = np.where(mask, logits, np.float32(_MASKED_LOGIT))
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    uniform = np.maximum(uniform, np.finfo(uniform.dtype).tiny)
    actions = (log_probs - np.log(-np.log(uniform))).argmax(axis=-1)
    return actions, log_probs[np.arange(len(actions)), actions]


class CategoricalPolicy(Policy):
    """Categorical over ``n`` actions; ``mask`` ``(B, n)`` bool or None."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self.log_probs_all, self.probs = _categorical_terms(logits, mask)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return _sample_categorical(self.log_probs_all, generator)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        return self.log_probs_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        return _categorical_entropy(self.log_probs_all, self.probs)

    def mode(self) -> torch.Tensor:
        return self.probs.argmax(dim=-1)


class MultiCategoricalPolicy(Policy):
    """Independent categoricals, one per sub-action of sizes ``nvec``; logits and mask are the
    sub-actions' concatenated along the last dimension."""

    def __init__(
        self, logits: torch.Tensor, nvec: tuple[int, ...], mask: torch.Tensor | None = None
    ) -> None:
        split_logits = torch.split(logits, list(nvec), dim=-1)
        split_masks = (
            torch.split(mask, list(nvec), dim=-1) if mask is not None else [None] * len(nvec)
        )
        self.parts = [
            CategoricalPolicy(lg, m) for lg, m in zip(split_logits, split_masks, strict=True)
        ]

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.stack([part.sample(generator) for part in self.parts], dim=-1)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [part.log_prob(actions[..., i]) for i, part in enumerate(self.parts)], dim=-1
        ).sum(-1)

    def entropy(self) -> torch.Tensor:
        return torch.stack([part.entropy() for part in self.parts], dim=-1).sum(-1)

    def mode(self) -> torch.Tensor:
        return torch.stack([part.mode() for part in self.parts], dim=-1)


class BernoulliPolicy(Policy):
    """Independent Bernoullis, one per bit; ``mask`` ``(B, 2k)`` holds [may be 0, may be 1] per bit."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        if mask is not None:
            allowed = mask.reshape(*mask.shape[:-1], -1, 2)
            forced = torch.full_like(logits, _FORCED_LOGIT)
            logits = torch.where(allowed[..., 1], logits, -forced)  # 1 not allowed: always 0
            logits = torch.where(allowed[..., 0], logits, forced)  # 0 not allowed: always 1
        self.logits = logits
        self.log_p1 = torch.nn.functional.logsigmoid(logits)
        self.log_p0 = torch.nn.functional.logsigmoid(-logits)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        p1 = self.log_p1.exp()
        if generator is not None and generator.device != p1.device:
            draws = torch.rand(p1.shape, generator=generator, device=generator.device).to(p1.device)
        else:
            draws = torch.rand(p1.shape, generator=generator, device=p1.device)
        return (draws < p1).to(torch.int8)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        ones = actions.to(torch.bool)
        return torch.where(ones, self.log_p1, self.log_p0).sum(-1)

    def entropy(self) -> torch.Tensor:
        p1, p0 = self.log_p1.exp(), self.log_p0.exp()
        zero = torch.zeros_like(p1)
        terms = torch.where(p1 > 0, p1 * self.log_p1, zero) + torch.where(
            p0 > 0, p0 * self.log_p0, zero
        )
        return -terms.sum(-1)

    def mode(self) -> torch.Tensor:
        return (self.logits > 0).to(torch.int8)


class DiagGaussianPolicy(Policy):
    """Diagonal Gaussian ``N(mean, diag(std^2))``; ``mean`` ``(B, d)``, ``log_std`` ``(d,)`` or ``(B, d)``."""

    def __init__(self, mean: torch.Tensor, log_std: torch.Tensor) -> None:
        self.mean = mean
        self.log_std = log_std.expand_as(mean)
        self.std = self.log_std.exp()

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        device = self.mean.device
        if generator is not None and generator.device != device:
            noise = torch.randn(self.mean.shape, generator=generator, device=generator.device).to(
                device
            )
        else:
            noise = torch.randn(self.mean.shape, generator=generator, device=device)
        return (self.mean + self.std * noise).detach()

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        # log N(a; mu, sigma) = -(a - mu)^2 / (2 sigma^2) - log sigma - log(2 pi) / 2, summed over d.
        z = (actions - self.mean) / self.std
        return (-0.5 * z * z - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self) -> torch.Tensor:
        # H = log sigma + (1 + log(2 pi)) / 2 per dimension.
        return (self.log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum(-1)

    def mode(self) -> torch.Tensor:
        return self.mean.detach()

    def stored(self) -> dict[str, torch.Tensor]:
        return {"action_mean": self.mean.detach(), "action_std": self.std.detach()}

    def kl_from(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """KL(N_old || N_new) = sum_d log(s_new / s_old) + (s_old^2 + (m_old - m_new)^2) / (2 s_new^2) - 1/2."""
        old_mean, old_std = stored["action_mean"], stored["action_std"]
        var_ratio = (old_std / self.std) ** 2
        mean_term = ((old_mean - self.mean) / self.std) ** 2
        return (0.5 * (var_ratio + mean_term - 1.0) - torch.log(old_std) + self.log_std).sum(-1)


# ---------------------------------------------------------------------------------------------
# Distribution families (one per action space)
# ---------------------------------------------------------------------------------------------
class ActionDistribution(ABC):
    """The policy's output family for one action space (see the module docstring).

    Attributes:
        kind: stable name (``"categorical"``, ``"multi_categorical"``, ``"bernoulli"``,
            ``"diag_gaussian"``), used in :meth:`to_dict` and checkpoints.
        action_shape: shape of one action. action_dtype: numpy dtype of stored actions.
        param_size: width of the policy head's output per observation.
        mask_width: width of one row's action mask, 0 when the env gives no masks.
    """

    kind: str
    action_shape: tuple[int, ...]
    action_dtype: np.dtype
    param_size: int
    mask_width: int = 0

    @abstractmethod
    def policy(self, head_output: torch.Tensor, mask: torch.Tensor | None = None) -> Policy:
        """The :class:`Policy` for a batch, from the head's ``(B, param_size)`` output."""

    def make_head(self, in_features: int) -> nn.Module:
        """The policy head: ``(B, in_features)`` float32 -> ``(B, param_size)``; small initial
        weights (gain 0.01, CleanRL) so the first policy is close to uniform / zero-mean."""
        return _layer_init(nn.Linear(in_features, self.param_size), std=0.01)

    def stored_fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Extra per-step fields this family stores (name -> (per-env shape, dtype))."""
        return {}

    @abstractmethod
    def action_bounds(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(low, high)`` inclusive per action element for integer actions, or ``(None, None)``
        for continuous actions (only finiteness is checked; the env boundary clips)."""

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """The actions as the env receives them (identity except where a family says otherwise)."""
        return actions

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack / checkpoint): ``kind``, its parameters, ``mask_width``."""
        return {"kind": self.kind, "mask_width": self.mask_width, **self._parameters()}

    @abstractmethod
    def _parameters(self) -> dict[str, Any]: ...

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActionDistribution) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.to_dict().items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._parameters()}, mask_width={self.mask_width})"


class Categorical(ActionDistribution):
    """``Discrete(n)``: categorical over ``n`` actions, optionally masked (mask width ``n``)."""

    kind = "categorical"

    def __init__(self, num_actions: int, *, masked: bool = False) -> None:
        if int(num_actions) < 1:
            raise ValueError(f"num_actions: expected >= 1, received {num_actions}")
        self.num_actions = int(num_actions)
        self.action_shape = ()
        self.action_dtype = np.dtype(np.int64)
        self.param_size = self.num_actions
        self.mask_width = self.num_actions if masked else 0

    def policy(self, head_output: torch.Tensor, mask: torch.Tensor | None = None) -> Policy:
        return CategoricalPolicy(head_output, mask)

    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(0, dtype=np.int64), np.array(self.num_actions - 1, dtype=np.int64)

    def _parameters(self) -> dict[str, Any]:
        return {"num_actions": self.num_actions}


class MultiCategorical(ActionDistribution):
    """``MultiDiscrete(nvec)``: one categorical per sub-action; masks concatenated (width sum(nvec))."""

    kind = "multi_categorical"

    def __init__(self, nvec: tuple[int, ...] | list[int], *, masked: bool = False) -> None:
        nvec = tuple(int(n) for n in nvec)
        if not nvec or min(nvec) < 1:
            raise ValueError(
                f"nvec: expected a non-empty list of sizes >= 1, received {list(nvec)}"
            )
        self.nvec = nvec
        self.action_shape = (len(nvec),)
        self.action_dtype = np.dtype(np.int64)
        self.param_size = sum(nvec)
        self.mask_width = self.param_size if masked else 0

    def policy(self, head_output: torch.Tensor, mask: torch.Tensor | None = None) -> Policy:
        return MultiCategoricalPolicy(head_output, self.nvec, mask)

    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(self.nvec), dtype=np.int64), np.array(self.nvec, dtype=np.int64) - 1

    def _parameters(self) -> dict[str, Any]:
        return {"nvec": list(self.nvec)}


class Bernoulli(ActionDistribution):
    """``MultiBinary(k)``: one Bernoulli per bit; mask width ``2k`` ([may be 0, may be 1] per bit)."""

    kind = "bernoulli"

    def __init__(self, num_bits: int, *, masked: bool = False) -> None:
        if int(num_bits) < 1:
            raise ValueError(f"num_bits: expected >= 1, received {num_bits}")
        self.num_bits = int(num_bits)
        self.action_shape = (self.num_bits,)
        self.action_dtype = np.dtype(np.int8)
        self.param_size = self.num_bits
        self.mask_width = 2 * self.num_bits if masked else 0

    def policy(self, head_output: torch.Tensor, mask: torch.Tensor | None = None) -> Policy:
        return BernoulliPolicy(head_output, mask)

    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self.num_bits, dtype=np.int64), np.ones(self.num_bits, dtype=np.int64)

    def _parameters(self) -> dict[str, Any]:
        return {"num_bits": self.num_bits}


class _GaussianHead(nn.Module):
    """Mean layer plus a state-independent ``log_std`` parameter (initial std 1, as CleanRL)."""

    def __init__(self, in_features: int, action_dim: int) -> None:
        super().__init__()
        self.mean = _layer_init(nn.Linear(in_features, action_dim), std=0.01)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        mean = self.mean(features)
        return torch.cat([mean, self.log_std.expand_as(mean)], dim=-1)


class DiagGaussian(ActionDistribution):
    """``Box((d,))``: diagonal Gaussian with state-independent log std; stores ``action_mean`` and
    ``action_std`` ``(d,)`` float32 per step; the env receives actions clipped to ``[low, high]``.

    Args:
        low, high: the Box's bounds, ``(d,)`` (``-inf`` / ``inf`` where unbounded).
    """

    kind = "diag_gaussian"
    LOG_STD_BOUNDS = (-20.0, 2.0)
    """log std is clamped to this range (SB3's bounds) so a runaway parameter cannot make log
    probabilities infinite."""

    def __init__(self, low: np.ndarray | list[float], high: np.ndarray | list[float]) -> None:
        low = np.asarray(low, dtype=np.float32).reshape(-1)
        high = np.asarray(high, dtype=np.float32).reshape(-1)
        if (
            low.shape != high.shape
            or low.size < 1
            or np.any(low > high)
            or np.isnan(low).any()
            or np.isnan(high).any()
        ):
            raise ValueError(
                f"low/high: expected two equal-length vectors with low <= high, received {low} and {high}"
            )
        self.low, self.high = low, high
        self.action_shape = (int(low.size),)
        self.action_dtype = np.dtype(np.float32)
        self.param_size = 2 * int(low.size)  # mean, then log std
        self.mask_width = 0

    def make_head(self, in_features: int) -> nn.Module:
        return _GaussianHead(in_features, self.action_shape[0])

    def policy(self, head_output: torch.Tensor, mask: torch.Tensor | None = None) -> Policy:
        mean, log_std = torch.chunk(head_output, 2, dim=-1)
        return DiagGaussianPolicy(mean, log_std.clamp(*self.LOG_STD_BOUNDS))

    def stored_fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {
            "action_mean": (self.action_shape, np.dtype(np.float32)),
            "action_std": (self.action_shape, np.dtype(np.float32)),
        }

    def action_bounds(self) -> tuple[None, None]:
        return None, None

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Actions clipped to the Box (the stored action and its log prob stay as sampled).

        Raises:
            ValueError: a non-finite action (it must never reach an env).
        """
        if not np.isfinite(actions).all():
            raise ValueError("actions: expected finite values, received NaN or inf")
        return np.clip(actions, self.low, self.high)

    def _parameters(self) -> dict[str, Any]:
        return {"low": self.low.tolist(), "high": self.high.tolist()}


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------
def distribution_for_space(action_space: Any, *, mask_width: int = 0) -> ActionDistribution:
    """The distribution family for a Gymnasium action space.

    Args:
        action_space: ``Discrete``, ``MultiDiscrete`` (1-D), ``MultiBinary`` (1-D) or ``Box`` (1-D).
        mask_width: width of the env's action masks (0 = none); must equal the family's.

    Raises:
        ValueError: an unsupported space (named), or a mask width that does not fit it.
    """
    from gymnasium import spaces

    masked = mask_width > 0
    if isinstance(action_space, spaces.Discrete):
        distribution: ActionDistribution = Categorical(int(action_space.n), masked=masked)
    elif isinstance(action_space, spaces.MultiDiscrete) and len(action_space.nvec.shape) == 1:
        distribution = MultiCategorical(tuple(int(n) for n in action_space.nvec), masked=masked)
    elif isinstance(action_space, spaces.MultiBinary) and np.ndim(action_space.n) in (0, 1):
        distribution = Bernoulli(int(np.prod(action_space.n)), masked=masked)
    elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
        if masked:
            raise ValueError(f"action masks: a Box action space {action_space} cannot be masked")
        distribution = DiagGaussian(action_space.low, action_space.high)
    else:
        raise ValueError(
            f"action_space: expected Discrete, 1-D MultiDiscrete, MultiBinary or 1-D Box, received {action_space}"
        )
    if masked and distribution.mask_width != mask_width:
        raise ValueError(
            f"action masks: expected width {distribution.mask_width} for {action_space}, received {mask_width}"
        )
    return distribution


def distribution_from_dict(value: dict[str, Any]) -> ActionDistribution:
    """Inverse of :meth:`ActionDistribution.to_dict`.

    Raises:
        ValueError: unknown ``kind`` or missing / invalid parameters (named).
    """
    try:
        kind, masked = value["kind"], int(value.get("mask_width", 0)) > 0
        if kind == Categorical.kind:
            return Categorical(int(value["num_actions"]), masked=masked)
        if kind == MultiCategorical.kind:
            return MultiCategorical(value["nvec"], masked=masked)
        if kind == Bernoulli.kind:
            return Bernoulli(int(value["num_bits"]), masked=masked)
        if kind == DiagGaussian.kind:
            return DiagGaussian(value["low"], value["high"])
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"action distribution: missing or invalid parameter in {value!r} ({error})"
        ) from None
    raise ValueError(f"action distribution: unknown kind {value.get('kind')!r}")


def distribution_for_env(spec: Any) -> ActionDistribution:
    """The distribution for an :class:`oakemu_core.envs.EnvSpec` (its ``action_space`` and
    ``action_mask_width``). Raises ValueError as :func:`distribution_for_space`."""
    return distribution_for_space(spec.action_space, mask_width=spec.action_mask_width)
