"""Actor-critic networks, CPU inference for actors, and weights <-> numpy arrays.

Two torsos share one categorical policy head and one value head:

* frames ``(C, H, W)`` (Atari: ``(4, 84, 84)`` uint8): the Nature CNN of Mnih et al. 2015,
  "Human-level control through deep reinforcement learning" (conv 32x8 stride 4, conv 64x4
  stride 2, conv 64x3 stride 1, fully connected 512, ReLU), shared by actor and critic as in
  CleanRL ``ppo_atari.py``. uint8 frames are uploaded as uint8 and scaled to [0, 1] inside
  :meth:`ActorCritic.forward`, on the model's device;
* vectors ``(D,)`` (classic control): separate actor and critic MLPs, 64-64 tanh, as in CleanRL
  ``ppo.py``.

Initialisation follows CleanRL: orthogonal weights with gain sqrt(2) for hidden layers, 0.01 for
the policy logits and 1 for the value output, zero biases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from oakemu_core.actor_step_buffers import PPOActionBundle

__all__ = [
    "ActorCritic",
    "build_model",
    "load_weight_arrays",
    "weights_to_arrays",
]


def _layer_init(layer: nn.Module, std: float = math.sqrt(2.0), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weight init with gain ``std`` and constant bias (CleanRL ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype matching a numpy dtype (raises TypeError for dtypes torch lacks)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class ActorCritic(nn.Module):
    """Categorical actor-critic for frame or vector observations.

    Args:
        observation_shape: shape of one observation: ``(C, H, W)`` selects the Nature CNN,
            ``(D,)`` the MLP.
        observation_dtype: dtype of the observations fed to the model. ``uint8`` observations
            are scaled by 1/255 in :meth:`forward`; other dtypes are cast to float32 unscaled.
        num_actions: number of discrete actions (size of the categorical distribution).

    Raises:
        ValueError: ``observation_shape`` has a rank other than 1 or 3, a non-positive entry,
            frames smaller than the CNN's receptive field, or ``num_actions`` < 1.
    """

    def __init__(self, observation_shape: tuple[int, ...], observation_dtype: Any, num_actions: int) -> None:
        super().__init__()
        observation_shape = tuple(int(d) for d in observation_shape)
        if len(observation_shape) not in (1, 3) or any(d <= 0 for d in observation_shape):
            raise ValueError(
                f"observation_shape: expected (D,) for vectors or (C, H, W) for frames with positive "
                f"sizes, got {observation_shape}"
            )
        if int(num_actions) < 1:
            raise ValueError(f"num_actions: expected >= 1, got {num_actions}")
        self.observation_shape = observation_shape
        self.observation_dtype = np.dtype(observation_dtype)
        self.num_actions = int(num_actions)
        self._torch_observation_dtype = _torch_dtype(self.observation_dtype)
        self.scale_observations = self.observation_dtype == np.uint8
        self.is_cnn = len(observation_shape) == 3

        if self.is_cnn:
            channels, height, width = observation_shape
            torso = nn.Sequential(
                _layer_init(nn.Conv2d(channels, 32, 8, stride=4)),
                nn.ReLU(),
                _layer_init(nn.Conv2d(32, 64, 4, stride=2)),
                nn.ReLU(),
                _layer_init(nn.Conv2d(64, 64, 3, stride=1)),
                nn.ReLU(),
                nn.Flatten(),
            )
            # Conv output size for this frame size (3136 = 64*7*7 for 84x84).
            out_h = ((height - 8) // 4 + 1 - 4) // 2 + 1 - 2
            out_w = ((width - 8) // 4 + 1 - 4) // 2 + 1 - 2
            if out_h < 1 or out_w < 1:
                raise ValueError(
                    f"observation_shape: frames must be at least 36x36 for the Nature CNN, got {observation_shape}"
                )
            self.network = nn.Sequential(torso, _layer_init(nn.Linear(64 * out_h * out_w, 512)), nn.ReLU())
            self.actor = _layer_init(nn.Linear(512, self.num_actions), std=0.01)
            self.critic = _layer_init(nn.Linear(512, 1), std=1.0)
        else:
            (obs_dim,) = observation_shape
            self.network = nn.Identity()
            self.actor = nn.Sequential(
                _layer_init(nn.Linear(obs_dim, 64)),
                nn.Tanh(),
                _layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                _layer_init(nn.Linear(64, self.num_actions), std=0.01),
            )
            self.critic = nn.Sequential(
                _layer_init(nn.Linear(obs_dim, 64)),
                nn.Tanh(),
                _layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                _layer_init(nn.Linear(64, 1), std=1.0),
            )

    @classmethod
    def from_spec(cls, spec: Any) -> ActorCritic:
        """Build from anything with ``observation_shape``, ``observation_dtype``, ``num_actions``
        (an ``EnvSpec``); raises ValueError if its actions are not scalar integers."""
        action_shape = tuple(getattr(spec, "action_shape", ()))
        action_dtype = np.dtype(getattr(spec, "action_dtype", np.int64))
        if action_shape != () or action_dtype.kind not in "iu":
            raise ValueError(
                f"spec: a categorical policy needs scalar integer actions, got action_shape={action_shape} "
                f"action_dtype={action_dtype}"
            )
        return cls(spec.observation_shape, spec.observation_dtype, spec.num_actions)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.parameters()).device

    # ------------------------------------------------------------------ training-side API
    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy logits and state values.

        Args:
            observations: ``(B, *observation_shape)`` tensor of the model's observation dtype,
                on the model's device (uint8 frames stay uint8 until here).

        Returns:
            ``(logits (B, num_actions) float32, values (B,) float32)``.

        Raises:
            ValueError: wrong trailing shape or dtype.
        """
        trailing_shape = tuple(observations.shape[1:])
        if observations.dim() != len(self.observation_shape) + 1 or trailing_shape != self.observation_shape:
            raise ValueError(
                f"observations: expected shape (B, {', '.join(map(str, self.observation_shape))}), "
                f"got {tuple(observations.shape)}"
            )
        if observations.dtype != self._torch_observation_dtype:
            raise ValueError(
                f"observations: expected dtype {self._torch_observation_dtype}, got {observations.dtype}"
            )
        x = observations.to(torch.float32)
        if self.scale_observations:
            x = x / 255.0
        hidden = self.network(x)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def evaluate_actions(
        self, observations: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities and entropy of the categorical policy, and values, with gradients.

        Args:
            observations: ``(B, *observation_shape)`` as for :meth:`forward`.
            actions: ``(B,)`` integer action indices in ``[0, num_actions)``.

        Returns:
            ``(log_probs (B,), entropy (B,), values (B,))``, all float32.
        """
        logits, values = self(observations)
        log_probs_all = torch.log_softmax(logits, dim=-1)
        log_probs = log_probs_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)
        return log_probs, entropy, values

    # ------------------------------------------------------------------ actor-side API (numpy)
    def _observations_to_tensor(self, observations: np.ndarray) -> torch.Tensor:
        observations = np.asarray(observations)
        if observations.dtype != self.observation_dtype:
            raise ValueError(f"observations: expected dtype {self.observation_dtype}, got {observations.dtype}")
        if observations.ndim != len(self.observation_shape) + 1 or observations.shape[1:] != self.observation_shape:
            raise ValueError(
                f"observations: expected shape (B, {', '.join(map(str, self.observation_shape))}), "
                f"got {observations.shape}"
            )
        return torch.from_numpy(np.ascontiguousarray(observations)).to(self.device)

    @torch.no_grad()
    def act(
        self,
        observations: np.ndarray,
        *,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> PPOActionBundle:
        """Choose actions for a batch of observations (no gradients).

        Args:
            observations: ``(B, *observation_shape)`` numpy array of the model's observation dtype.
            greedy: take the most probable action instead of sampling.
            generator: torch generator for sampling (on any device; sampling happens there), for
                reproducible actors. ``None`` uses torch's global RNG.

        Returns:
            :class:`PPOActionBundle` of CPU numpy arrays: actions ``(B,)`` int64, log_probs ``(B,)``
            float32 (log pi(action | observation), computed as in :meth:`evaluate_actions`),
            values ``(B,)`` float32.

        Raises:
            ValueError: observations of the wrong shape or dtype.
        """
        obs = self._observations_to_tensor(observations)
        logits, values = self(obs)
        if greedy:
            actions = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)
            if generator is not None and generator.device != probs.device:
                probs = probs.to(generator.device)
            actions = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return PPOActionBundle(
            actions=actions.to("cpu", torch.int64).numpy(),
            log_probs=log_probs.to("cpu", torch.float32).numpy(),
            values=values.to("cpu", torch.float32).numpy(),
        )

    @torch.no_grad()
    def predict_values(self, observations: np.ndarray) -> np.ndarray:
        """State values V(observation) for a batch, ``(B,)`` float32 CPU numpy (no gradients).

        Used for the bootstrap value after the last rollout step and for the true final
        observation of a truncated episode. Raises ValueError for a wrong shape or dtype.
        """
        _, values = self(self._observations_to_tensor(observations))
        return values.to("cpu", torch.float32).numpy()


def build_model(observation_shape: tuple[int, ...], observation_dtype: Any, num_actions: int) -> ActorCritic:
    """Build the actor-critic for these observations: Nature CNN for ``(C, H, W)`` frames, MLP for
    ``(D,)`` vectors. See :class:`ActorCritic` for arguments and errors."""
    return ActorCritic(observation_shape, observation_dtype, num_actions)


def weights_to_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """Snapshot of every entry of ``model.state_dict()`` as CPU, C-contiguous float32 numpy arrays.

    The arrays are copies: later optimizer steps do not change them. Raises TypeError if an entry
    is not a floating-point tensor.
    """
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise TypeError(f"weights_to_arrays: {name} has non-float dtype {tensor.dtype}")
        arrays[name] = np.ascontiguousarray(tensor.detach().to("cpu", torch.float32, copy=True).numpy())
    return arrays


def load_weight_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy named float32 arrays (as from :func:`weights_to_arrays`) into ``model``'s parameters.

    Everything is validated before anything is written, so a rejected set of weights leaves the
    model unchanged.

    Raises:
        ValueError: names missing or unexpected, or an array with the wrong shape or a dtype other
            than float32; the message names the entry, the expected and the received value.
    """
    state = model.state_dict()
    missing = sorted(set(state) - set(arrays))
    extra = sorted(set(arrays) - set(state))
    if missing or extra:
        raise ValueError(f"weights: missing names {missing}, unexpected names {extra}")
    for name, tensor in state.items():
        array = arrays[name]
        if not isinstance(array, np.ndarray):
            raise ValueError(f"weights[{name!r}]: expected a numpy array, got {type(array).__name__}")
        if array.dtype != np.float32:
            raise ValueError(f"weights[{name!r}]: expected dtype float32, got {array.dtype}")
        if tuple(array.shape) != tuple(tensor.shape):
            raise ValueError(f"weights[{name!r}]: expected shape {tuple(tensor.shape)}, got {tuple(array.shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(torch.from_numpy(np.array(arrays[name], dtype=np.float32, copy=True)))
