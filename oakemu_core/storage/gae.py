"""Generalized Advantage Estimation, vectorised over environments.

Source: Schulman, Moritz, Levine, Jordan, Abbeel, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", ICLR 2016, eq. (16), extended with a bootstrap term for
episodes cut by a time limit (Pardo et al., "Time Limits in Reinforcement Learning", ICML 2018;
Stable-Baselines3 issue #633)::

    delta_t = r_t + gamma * ((1 - d_t) * V_{t+1} + b_t) - V_t
    A_t     = delta_t + gamma * lambda * (1 - d_t) * A_{t+1}          (A_T = 0)
    R_t     = A_t + V_t                                               (TD(lambda) return)

with ``V_T = last_values``. ``d_t`` is true when the episode ended on step ``t``, terminated or
truncated, so nothing flows across an episode boundary; ``b_t`` is the value of the true final
observation when the episode was truncated on step ``t`` (0 otherwise), so a truncated step still
bootstraps while a terminated one does not.
"""

from __future__ import annotations

import numpy as np


def _check_array(field: str, array: object, shape: tuple[int, ...], *, kind: str) -> np.ndarray:
    """Validate one input; ``kind`` is ``"float"`` (any float dtype) or ``"bool"``."""
    if not isinstance(array, np.ndarray):
        raise ValueError(
            f"{field}: expected a numpy array of shape {shape}, received {type(array).__name__}"
        )
    if array.shape != shape:
        raise ValueError(f"{field}: expected shape {shape}, received {array.shape}")
    if kind == "bool" and array.dtype != np.bool_:
        raise ValueError(f"{field}: expected dtype bool, received {array.dtype}")
    if kind == "float" and not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{field}: expected a floating dtype (float32), received {array.dtype}")
    return array


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    bootstrap_values: np.ndarray,
    last_values: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Compute GAE advantages and TD(lambda) returns for a rollout of ``T`` steps x ``N`` envs.

    The work is vectorised over envs (and over time for the TD errors); only the backward
    recursion loops over the ``T`` steps. Computed in float64, returned as float32.

    Args:
        rewards: ``(T, N)`` floating, reward received on step ``t``.
        values: ``(T, N)`` floating, V(observation at step ``t``) of the acting policy.
        dones: ``(T, N)`` bool, the episode ended on step ``t`` (terminated OR truncated).
        bootstrap_values: ``(T, N)`` floating, V(true final observation) where the episode was
            truncated on step ``t``, 0 elsewhere. Must be 0 where ``dones`` is false.
        last_values: ``(N,)`` floating, V(observation after the last step), i.e. ``V_T``.
        gamma: discount factor in ``[0, 1]``.
        gae_lambda: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, each ``(T, N)`` float32, unnormalised.

    Raises:
        ValueError: for a wrong shape or dtype (naming the field, expected and received),
            a non-zero bootstrap value on a step that is not done, or gamma / lambda outside
            ``[0, 1]``.
    """
    if not isinstance(rewards, np.ndarray) or rewards.ndim != 2:
        received = getattr(rewards, "shape", type(rewards).__name__)
        raise ValueError(f"rewards: expected a numpy array of shape (T, N), received {received}")
    shape = rewards.shape
    _check_array("rewards", rewards, shape, kind="float")
    _check_array("values", values, shape, kind="float")
    _check_array("dones", dones, shape, kind="bool")
    _check_array("bootstrap_values", bootstrap_values, shape, kind="float")
    _check_array("last_values", last_values, shape[1:], kind="float")
    for name, factor in (("gamma", gamma), ("gae_lambda", gae_lambda)):
        if not 0.0 <= float(factor) <= 1.0:
            raise ValueError(f"{name}: expected a value in [0, 1], received {factor}")
    if np.any(bootstrap_values[~dones] != 0):
        raise ValueError(
            "bootstrap_values: expected 0 on every step that is not done, received non-zero values"
        )

    num_steps = shape[0]
    values64 = values.astype(np.float64)
    not_done = (~dones).astype(np.float64)
    next_values = np.empty_like(values64)
    next_values[:-1] = values64[1:]
    next_values[-1:] = last_values
    deltas = rewards + gamma * (not_done * next_values + bootstrap_values) - values64
    decay = (gamma * gae_lambda) * not_done

    advantages = np.empty_like(values64)
    if num_steps:
        advantages[-1] = deltas[-1]
    for t in range(num_steps - 2, -1, -1):
        np.multiply(decay[t], advantages[t + 1], out=advantages[t])
        advantages[t] += deltas[t]
    returns = advantages + values64
    return advantages.astype(np.float32), returns.astype(np.float32)
