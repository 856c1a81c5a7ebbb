"""Actor inference with numpy: the forward pass of an actor-critic with separate MLP torsos (one
vector observation: CleanRL's classic-control networks) as numpy matrix products instead of torch
modules (``actor_inference = "numpy"``; ``"auto"`` picks it for such models).

A forward pass of a few rows through two 64-64 tanh MLPs is a dozen small products: torch spends
most of it on per-module and per-op overhead (8 CartPole rows: 63 us through the modules, 15 us in
numpy; ``docs/benchmarks.md``). The weights are copied out of the model at every load. A
categorical policy then samples in numpy too (same draws, same actions); other distributions sample
in torch (:meth:`oakemu_core.policy.models.ActorCritic.act`). The products
round differently from torch's kernels, as the learner's batched kernels do: the actors' log-probs
differ from the learner's by float32 rounding (a first-minibatch ratio within about 1e-6 of 1, as
with torch actors).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["NumpyForward", "PROBE_TOLERANCE", "check_supported"]

PROBE_TOLERANCE = 1e-4
"""Relative and absolute tolerance between numpy and torch on a probe batch when the backend is
built."""


def check_supported(observation_layout: dict[str, tuple[tuple[int, ...], Any]]) -> None:
    """Before anything starts: raise ValueError (one line) when ``observation_layout`` (key -> (shape,
    dtype), e.g. an env spec's) is not one vector observation."""
    only = observation_layout.get("")
    if only is None or len(only[0]) == 3 and min(only[0][1:]) >= 5:
        raise ValueError(
            f"actor_inference='numpy': only for one vector observation (MLP torsos), this env "
            f"gives {_describe(observation_layout)}; use actor_inference='torch' or 'auto'"
        )


def _describe(observation_layout: dict[str, tuple[tuple[int, ...], Any]]) -> str:
    if set(observation_layout) != {""}:
        return f"the keys {sorted(observation_layout)}"
    shape, dtype = observation_layout[""]
    return f"{np.dtype(dtype).name} {tuple(shape)} pictures"


class NumpyForward:
    """``model.forward`` in numpy for an :class:`~oakemu_core.policy.models.ActorCritic` with separate
    MLP torsos, with the contract of :meth:`ActorCritic.forward` for one observation tensor: ``(B,
    *shape)`` CPU tensor of the model's observation dtype -> ``(head output (B, param_size) float32,
    values (B,) float32)`` CPU tensors.

    The pass: float32 observations, normalised by the model's running statistics when it keeps them
    (``clip((x - mean) / sqrt(var + eps), -clip, clip)``), flattened; each torso's Linear and Tanh
    layers in order; the policy head (a Linear, or the Gaussian head's mean Linear next to its state-
    independent ``log_std``) on the actor torso, the critic Linear on the critic torso.

    Args:
        model: the actor's model on the CPU with its current weights.

    Raises:
        ValueError: the model has no separate MLP torsos (pictures, dict observations), holds a layer
            this pass does not know, or its output differs from the model's on a probe batch by more
            than :data:`PROBE_TOLERANCE`.
    """

    numpy_outputs = True
    """The outputs are CPU tensors over numpy arrays (``ActorCritic.act`` then samples in numpy)."""

    def __init__(self, model: Any) -> None:
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(f"actor_inference='numpy': {reason}; use actor_inference='torch'")
        self.load(model)
        model.check_inference_backend(
            self, what="actor_inference='numpy'", tolerance=PROBE_TOLERANCE
        )

    @staticmethod
    def unsupported_reason(model: Any) -> str | None:
        """Why this pass cannot serve ``model``, or None when it can."""
        only = model.observation_layout.get("")
        if (
            only is None
            or len(only[0]) == 3
            and min(only[0][1:]) >= 5
            or model.network.policy_module
        ):
            return "only for one vector observation without a user's encoder"
        if model.device.type != "cpu":
            return f"only for a model on the CPU, this one is on {model.device}"
        for torso in (model.actor_torso, model.critic_torso):
            layers = list(torso) if isinstance(torso, nn.Sequential) else []
            unknown = [type(layer).__name__ for layer in layers if not isinstance(layer, _LAYERS)]
            if unknown:
                return f"a torso holds layers {unknown} (expected Linear, Tanh and ReLU)"
        head = model.actor
        if not isinstance(head, nn.Linear) and not (
            isinstance(getattr(head, "mean", None), nn.Linear)
            and isinstance(getattr(head, "log_std", None), nn.Parameter)
        ):
            return f"the policy head {type(head).__name__} is neither a Linear nor a Gaussian mean and log std"
        return None

    def load(self, model: Any) -> None:
        """Copy ``model``'s current weights and normaliser statistics (call after every weights update)."""

        def arrays(
            module: nn.Module,
        ) -> tuple[np.ndarray, np.ndarray]:  # (in, out) weight for x @ w, bias
            return (module.weight.detach().numpy().T.copy(), module.bias.detach().numpy().copy())

        self._torsos = [
            [arrays(layer) if isinstance(layer, nn.Linear) else type(layer) for layer in torso]
            if isinstance(torso, nn.Sequential)
            else []
            for torso in (model.actor_torso, model.critic_torso)
        ]
        head = model.actor
        self._head = arrays(head if isinstance(head, nn.Linear) else head.mean)
        self._log_std = (
            None if isinstance(head, nn.Linear) else head.log_std.detach().numpy().copy()
        )
        self._critic = arrays(model.critic)
        self._cores = [
            _core_arrays(core) for core in (model.core, model.critic_core) if core is not None
        ]
        key = model._module_key("")
        normalizer = model.normalizers[key] if key in model.normalizers else None
        self._normalizer = (
            None
            if normalizer is None
            else (
                normalizer.mean.numpy().copy(),
                np.sqrt(normalizer.var.numpy() + np.float32(normalizer.eps)),
                np.float32(normalizer.clip),
            )
        )

    def __call__(self, observations: torch.Tensor, state: torch.Tensor | None = None) -> Any:
        x = observations.numpy().astype(np.float32, copy=False)
        if self._normalizer is not None:
            mean, std, clip = self._normalizer
            x = np.clip((x - mean) / std, -clip, clip)
        x = x.reshape(len(x), -1)
        new_state, actor_in, critic_in = None, x, x
        if self._cores:
            if state is None:
                raise ValueError("state: this policy is recurrent; pass its state")
            states = np.split(state.numpy(), len(self._cores), axis=1)
            steps = [_core_step(core, x, part) for core, part in zip(self._cores, states)]
            actor_in = critic_in = steps[0][0]
            if len(steps) == 2:  # the critic's own core
                critic_in = steps[1][0]
            new_state = np.concatenate([step[1] for step in steps], axis=1)
        actor, critic = _mlp(actor_in, self._torsos[0]), _mlp(critic_in, self._torsos[1])
        head = actor @ self._head[0] + self._head[1]
        if self._log_std is not None:
            head = np.concatenate([head, np.broadcast_to(self._log_std, head.shape)], axis=1)
        values = critic @ self._critic[0] + self._critic[1]
        if new_state is None:
            return torch.from_numpy(head), torch.from_numpy(values[:, 0])
        return torch.from_numpy(head), torch.from_numpy(values[:, 0]), torch.from_numpy(new_state)


_LAYERS = (nn.Linear, nn.Tanh, nn.ReLU)
"""The torso layers this pass computes."""


def _core_arrays(core: Any) -> tuple[Any, ...]:
    """A :class:`~oakemu_core.policy.recurrent.RecurrentCore`'s kind, units and (in, out) weights and biases."""
    rnn = core.rnn
    weights = [
        getattr(rnn, name).detach().numpy().T.copy() for name in ("weight_ih_l0", "weight_hh_l0")
    ]
    biases = [getattr(rnn, name).detach().numpy().copy() for name in ("bias_ih_l0", "bias_hh_l0")]
    return (core.kind, core.hidden, *weights, *biases)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (np.tanh(0.5 * x) + 1.0)


def _core_step(
    core: tuple[Any, ...], x: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One step of an LSTM or GRU layer in numpy (PyTorch's equations and gate order: LSTM i, f, g, o;
    GRU r, z, n). Returns ``(output (B, H), new state (B, S))`` with the state packed as
    :class:`~oakemu_core.policy.recurrent.RecurrentCore` packs it."""
    kind, hidden, w_ih, w_hh, b_ih, b_hh = core
    if kind == "lstm":
        h, c = state[:, :hidden], state[:, hidden:]
        gates = x @ w_ih + b_ih + h @ w_hh + b_hh
        i, f, g, o = (gates[:, k * hidden : (k + 1) * hidden] for k in range(4))
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        return h, np.concatenate([h, c], axis=1).astype(np.float32, copy=False)
    gi, gh = x @ w_ih + b_ih, state @ w_hh + b_hh
    r = _sigmoid(gi[:, :hidden] + gh[:, :hidden])
    z = _sigmoid(gi[:, hidden : 2 * hidden] + gh[:, hidden : 2 * hidden])
    n = np.tanh(gi[:, 2 * hidden :] + r * gh[:, 2 * hidden :])
    h = ((1.0 - z) * n + z * state).astype(np.float32, copy=False)
    return h, h


def _mlp(x: np.ndarray, layers: list[Any]) -> np.ndarray:
    """``x`` through Linear layers (weight, bias) and activations (Tanh, ReLU classes) in order."""
    for layer in layers:
        if layer is nn.Tanh:
            x = np.tanh(x)
        elif layer is nn.ReLU:
            x = np.maximum(x, 0.0)
        else:
            x = x @ layer[0] + layer[1]
    return x
