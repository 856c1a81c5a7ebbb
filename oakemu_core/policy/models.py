"""Actor-critic networks for any observation layout and action distribution, CPU inference for
actors, and weights <-> numpy arrays.

An :class:`ActorCritic` is built from an observation layout (key -> per-env shape and dtype; key
``""`` for a plain observation) and an :class:`~oakemu_core.policy.distributions.ActionDistribution`.
It never asks which action space it serves: the distribution makes the policy head and turns its
output into a :class:`~oakemu_core.policy.distributions.Policy`.

A *picture* is a channel-first ``(C, H, W)`` key with H and W at least ``SMALL_CNN_MIN_SIZE`` (5);
a CNN encodes it. Torsos:

* one plain observation that is not a picture (a vector ``(D,)`` as in classic control, or any
  other shape, flattened: MiniGrid's ``(7, 7, 3)`` symbolic grid, a ``(1, 4, 4)`` frame): separate
  actor and critic MLPs, 64-64 tanh, as CleanRL ``ppo.py`` / ``ppo_continuous_action.py`` and SB3's
  ``MlpPolicy``;
* otherwise one encoder per key, concatenated (SB3's ``CombinedExtractor``): pictures get the Nature
  CNN of Mnih et al. 2015 (conv 32x8/4, 64x4/2, 64x3/1, fc 512, ReLU; CleanRL ``ppo_atari.py``) when
  at least 36 x 36, and a small 3x3 CNN (fc 256) when smaller (SB3 fails there with a conv2d size
  error); other keys are flattened. With more than one key a 256-unit ReLU layer mixes the
  concatenated features. Actor and critic share the torso.

Scaling. uint8 pictures travel as uint8 and are scaled to [0, 1] on the model's device. uint8 keys
that are not pictures (symbolic grids, RAM bytes) are always normalised by running statistics
(:class:`RunningNormalizer`, as SB3's ``VecNormalize``): their ``Box(0, 255)`` bounds say nothing
about their scale, and ``/ 255`` would shrink MiniGrid's indices 0..10 to 0..0.04, which a 64-64 tanh
MLP learns from several times slower (``docs/benchmarks.md``). Float keys are normalised the same way
under ``normalize_observations``; other keys reach the network as their float values. The
statistics are buffers of the model, so they travel to the actors with the weights, are saved in
checkpoints and are used by ``oakemu evaluate``; only the learner updates them (after each update:
the first rollout sees the raw values).

Initialisation follows CleanRL: orthogonal weights with gain sqrt(2) for hidden layers, 0.01 for
the policy head and 1 for the value output, zero biases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.policy.distributions import (
    ActionDistribution,
    Categorical,
    Policy,
    sample_categorical_numpy,
)

__all__ = [
    "ActorCritic",
    "RunningNormalizer",
    "build_model",
    "has_separate_mlps",
    "load_weight_arrays",
    "weights_to_arrays",
]

NATURE_CNN_MIN_SIZE = 36
"""Smallest frame side the Nature CNN's three convolutions fit."""
SMALL_CNN_MIN_SIZE = 5


def _layer_init(
    layer: nn.Module, std: float = math.sqrt(2.0), bias_const: float = 0.0
) -> nn.Module:
    """Orthogonal weight init with gain ``std`` and constant bias (CleanRL ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype matching a numpy dtype (raises TypeError for dtypes torch lacks)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class RunningNormalizer(nn.Module):
    """Running mean / variance of an observation key; ``forward`` returns
    ``clip((x - mean) / sqrt(var + eps), -clip, clip)`` (SB3 ``VecNormalize``, clip 10).

    Statistics are buffers (``mean``, ``var``, ``count``), merged with each batch by the parallel
    algorithm of Chan et al. 1979 (as SB3's ``RunningMeanStd``).
    """

    def __init__(self, shape: tuple[int, ...], *, clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.tensor(1e-4))
        self.clip = clip
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp((x - self.mean) / torch.sqrt(self.var + self.eps), -self.clip, self.clip)

    @torch.no_grad()
    def update(self, batch: torch.Tensor) -> None:
        """Merge a ``(B, *shape)`` batch into the statistics."""
        batch = batch.to(self.mean.device, torch.float64)
        batch_mean, batch_var, batch_count = (
            batch.mean(0),
            batch.var(0, unbiased=False),
            batch.shape[0],
        )
        mean, var, count = self.mean.double(), self.var.double(), self.count.double()
        delta = batch_mean - mean
        total = count + batch_count
        new_mean = mean + delta * batch_count / total
        m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
        self.mean.copy_(new_mean.float())
        self.var.copy_((m2 / total).float())
        self.count.copy_(total.float())


def _nature_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    out_h = ((height - 8) // 4 + 1 - 4) // 2 + 1 - 2
    out_w = ((width - 8) // 4 + 1 - 4) // 2 + 1 - 2
    torso = nn.Sequential(
        _layer_init(nn.Conv2d(channels, 32, 8, stride=4)),
        nn.ReLU(),
        _layer_init(nn.Conv2d(32, 64, 4, stride=2)),
        nn.ReLU(),
        _layer_init(nn.Conv2d(64, 64, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
        _layer_init(nn.Linear(64 * out_h * out_w, 512)),
        nn.ReLU(),
    )
    return torso, 512


def _small_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    torso = nn.Sequential(
        _layer_init(nn.Conv2d(channels, 16, 3, stride=1)),
        nn.ReLU(),
        _layer_init(nn.Conv2d(16, 32, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
        _layer_init(nn.Linear(32 * (height - 4) * (width - 4), 256)),
        nn.ReLU(),
    )
    return torso, 256


def _is_picture(shape: tuple[int, ...]) -> bool:
    """A channel-first ``(C, H, W)`` key that a CNN encodes: both sides at least SMALL_CNN_MIN_SIZE.

    Anything else is flattened, e.g. MiniGrid's ``(7, 7, 3)`` channel-last grid of symbolic indices,
    read as C = 7, H = 7, W = 3.
    """
    return len(shape) == 3 and min(shape[1:]) >= SMALL_CNN_MIN_SIZE


def has_separate_mlps(observation_layout: Mapping[str, tuple[tuple[int, ...], Any]]) -> bool:
    """Whether the model of ``observation_layout`` (key -> (shape, dtype)) flattens one observation into
    separate actor and critic MLPs (CleanRL's classic-control networks): one key ``""``, not a picture."""
    only = observation_layout.get("")
    return only is not None and not _is_picture(tuple(only[0]))


def _normalized(shape: tuple[int, ...], dtype: np.dtype, normalize_observations: bool) -> bool:
    """Whether a key gets a :class:`RunningNormalizer`: float keys under ``normalize_observations``,
    and uint8 keys that are not pictures always (a uint8 grid of symbolic indices or a RAM dump has no
    pixel scale: MiniGrid declares ``Box(0, 255)`` for indices 0..10, which ``/ 255`` shrinks to
    0..0.04)."""
    if dtype == np.uint8:
        return not _is_picture(shape)
    return normalize_observations and dtype.kind == "f"


def _mlp(in_features: int) -> nn.Sequential:
    return nn.Sequential(
        _layer_init(nn.Linear(in_features, 64)),
        nn.Tanh(),
        _layer_init(nn.Linear(64, 64)),
        nn.Tanh(),
    )


class ActorCritic(nn.Module):
    """Actor-critic for any observation layout and action distribution (see module docstring).

    Args:
        observation_layout: key -> (per-env shape, dtype); key ``""`` for a plain observation.
        distribution: the action distribution (decides the policy head and the action space).
        normalize_observations: keep running statistics of float keys and normalise with them
            (uint8 keys that are not pictures are normalised either way).

    Raises:
        ValueError: an empty layout, or a key with a non-positive dimension.
    """

    def __init__(
        self,
        observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
        distribution: ActionDistribution,
        *,
        normalize_observations: bool = False,
    ) -> None:
        super().__init__()
        if not observation_layout:
            raise ValueError("observation_layout: expected at least one observation key")
        self.observation_layout = {
            key: (tuple(int(d) for d in shape), np.dtype(dtype))
            for key, (shape, dtype) in sorted(observation_layout.items())
        }
        for key, (shape, _) in self.observation_layout.items():
            if any(d <= 0 for d in shape):
                raise ValueError(
                    f"observation {key or 'observations'!r}: expected positive sizes, got {shape}"
                )
        self.distribution = distribution
        self.is_dict = "" not in self.observation_layout
        self._torch_dtypes = {
            key: _torch_dtype(dtype) for key, (_, dtype) in self.observation_layout.items()
        }
        self.normalizers = nn.ModuleDict()
        for key, (shape, dtype) in self.observation_layout.items():
            if _normalized(shape, dtype, normalize_observations):
                self.normalizers[self._module_key(key)] = RunningNormalizer(shape)

        self.separate_mlps = has_separate_mlps(self.observation_layout)
        if self.separate_mlps:  # CleanRL's classic-control networks, on the flattened observation
            dim = math.prod(self.observation_layout[""][0])
            self.actor_torso: nn.Module = _mlp(dim)
            self.critic_torso: nn.Module = _mlp(dim)
            features = 64
        else:
            self.encoders = nn.ModuleDict()
            total = 0
            for key, (shape, _) in self.observation_layout.items():
                encoder, size = self._encoder(shape)
                self.encoders[self._module_key(key)] = encoder
                total += size
            if len(self.observation_layout) > 1:
                self.mixer: nn.Module = nn.Sequential(_layer_init(nn.Linear(total, 256)), nn.ReLU())
                features = 256
            else:
                self.mixer = nn.Identity()
                features = total
            self.actor_torso = self.critic_torso = nn.Identity()
        self.actor = distribution.make_head(features)
        self.critic = _layer_init(nn.Linear(features, 1), std=1.0)
        self.channels_last = False  # see use_channels_last()

    @staticmethod
    def _module_key(key: str) -> str:
        # ModuleDict keys may not contain "."; "" is not allowed either.
        return "obs_" + key.replace(".", "__")

    @staticmethod
    def _encoder(shape: tuple[int, ...]) -> tuple[nn.Module, int]:
        if _is_picture(shape):
            channels, height, width = shape
            if min(height, width) >= NATURE_CNN_MIN_SIZE:
                return _nature_cnn(channels, height, width)
            return _small_cnn(channels, height, width)
        return nn.Flatten(), math.prod(shape)

    @property
    def has_convolutions(self) -> bool:
        """Some observation goes through a CNN encoder (images of at least SMALL_CNN_MIN_SIZE per side)."""
        return any(isinstance(module, nn.Conv2d) for module in self.modules())

    def use_channels_last(self) -> ActorCritic:
        """Store the convolution weights channels-last (NHWC) and feed image observations to them
        the same way; returns ``self``. Outputs and weights are the same (``state_dict`` holds the
        same values, in another memory layout), up to float rounding.

        Why: oneDNN's CPU convolutions are faster in this layout (``benchmarks/bench_learner_layout.py``;
        figures in ``docs/benchmarks.md``). Only worth it where the learner trains on the CPU.

        An optimizer over these parameters must keep its state in the same layout: load its state
        with :func:`load_optimizer_state` (fused Adam pairs elements by storage order).
        """
        self.channels_last = True
        return self.to(memory_format=torch.channels_last)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters (cached: walking the modules for it on every actor
        step is a measurable cost for small envs). Every way parameters move resets it: :meth:`_apply` (``.to()``,
        ``.cuda()``, ``to_empty``), :meth:`load_state_dict` (``assign=True`` swaps the
        parameters) and unpickling."""
        device = self.__dict__.get("_device")
        if device is None:
            device = self.__dict__["_device"] = next(self.parameters()).device
        return device

    def _apply(self, fn: Any, recurse: bool = True) -> ActorCritic:
        self.__dict__.pop("_device", None)
        return super()._apply(fn, recurse)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop("_device", None)
        return super().load_state_dict(*args, **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_device", None)
        super().__setstate__(state)

    # ------------------------------------------------------------------ training-side API
    def _prepare(self, key: str, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = self.observation_layout[key]
        if tuple(x.shape[1:]) != shape or x.dim() != len(shape) + 1:
            raise ValueError(
                f"observations{'[' + repr(key) + ']' if key else ''}: expected shape "
                f"(B, {', '.join(map(str, shape))}), got {tuple(x.shape)}"
            )
        if x.dtype != self._torch_dtypes[key]:
            raise ValueError(
                f"observations{'[' + repr(key) + ']' if key else ''}: expected dtype "
                f"{self._torch_dtypes[key]}, got {x.dtype}"
            )
        if self.channels_last and x.dim() == 4:  # (B, C, H, W) images; uint8 is the cheaper copy
            x = x.contiguous(memory_format=torch.channels_last)
        x = x.to(torch.float32)
        if dtype == np.uint8 and _is_picture(shape):
            return x / 255.0
        normalizer = (
            self.normalizers[self._module_key(key)]
            if self._module_key(key) in self.normalizers
            else None
        )
        return normalizer(x) if normalizer is not None else x

    def _inputs(self, observations: Any) -> dict[str, torch.Tensor]:
        if self.is_dict:
            if not isinstance(observations, Mapping) or set(observations) != set(
                self.observation_layout
            ):
                received = (
                    sorted(observations)
                    if isinstance(observations, Mapping)
                    else type(observations).__name__
                )
                raise ValueError(
                    f"observations: expected a dict with keys {sorted(self.observation_layout)}, "
                    f"got {received}"
                )
            return {key: self._prepare(key, observations[key]) for key in self.observation_layout}
        return {"": self._prepare("", observations)}

    def forward(self, observations: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy-head output and state values.

        Args:
            observations: ``(B, *shape)`` tensor of the model's observation dtype on the model's
                device (uint8 frames stay uint8 until here), or a dict key -> such tensor.

        Returns:
            ``(head output (B, distribution.param_size) float32, values (B,) float32)``.

        Raises:
            ValueError: wrong keys, trailing shape or dtype.
        """
        inputs = self._inputs(observations)
        if self.separate_mlps:
            x = inputs[""].flatten(1)
            return self._heads(self.actor_torso(x), self.critic_torso(x))
        features = torch.cat(
            [self.encoders[self._module_key(key)](x) for key, x in inputs.items()], dim=-1
        )
        hidden = self.mixer(features)
        return self._heads(hidden, hidden)

    def _heads(
        self, actor_input: torch.Tensor, critic_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy head and the critic, always in float32: under the learner's bfloat16 autocast
        (``learner_precision``) the torso computes in bfloat16, but the heads are tiny, and a value of
        a few hundred rounded to bfloat16 is off by about 1 (the re-evaluated values feed GAE)."""
        if torch.is_autocast_enabled(
            actor_input.device.type
        ):  # only then: the context costs 3 us a forward
            with torch.autocast(actor_input.device.type, enabled=False):
                return self._heads(actor_input.float(), critic_input.float())
        return self.actor(actor_input), self.critic(critic_input).squeeze(-1)

    def policy_and_values(
        self, observations: Any, action_mask: torch.Tensor | None = None
    ) -> tuple[Policy, torch.Tensor]:
        """The action :class:`Policy` (masked when ``action_mask`` ``(B, width)`` bool is given)
        and the values ``(B,)``, with gradients."""
        head, values = self(observations)
        return self.distribution.policy(head, action_mask), values

    def evaluate_actions(
        self, observations: Any, actions: torch.Tensor, action_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities, entropy and values of stored actions, with gradients.

        Returns:
            ``(log_probs (B,), entropy (B,), values (B,))``, all float32.
        """
        policy, values = self.policy_and_values(observations, action_mask)
        return policy.log_prob(actions), policy.entropy(), values

    @torch.no_grad()
    def update_observation_statistics(self, observations: Any) -> None:
        """Merge a batch of raw observations (numpy or torch, ``(B, *shape)`` or a dict) into the
        running statistics of the normalised keys (no-op without observation normalisation)."""
        if not len(self.normalizers):
            return
        batch = observations if self.is_dict else {"": observations}
        for key in self.observation_layout:
            module_key = self._module_key(key)
            if module_key in self.normalizers:
                values = torch.as_tensor(
                    np.asarray(batch[key])
                    if not isinstance(batch[key], torch.Tensor)
                    else batch[key]
                )
                self.normalizers[module_key].update(
                    values.reshape(-1, *self.observation_layout[key][0])
                )

    # ------------------------------------------------------------------ actor-side API (numpy)
    def _to_tensor(self, key: str, array: Any) -> torch.Tensor:
        shape, dtype = self.observation_layout[key]
        array = np.asarray(array)
        name = f"observations[{key!r}]" if key else "observations"
        if array.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {array.dtype}")
        if array.ndim != len(shape) + 1 or array.shape[1:] != shape:
            raise ValueError(
                f"{name}: expected shape (B, {', '.join(map(str, shape))}), got {array.shape}"
            )
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _observations_to_tensor(self, observations: Any) -> Any:
        if self.is_dict:
            if not isinstance(observations, Mapping) or set(observations) != set(
                self.observation_layout
            ):
                received = (
                    sorted(observations)
                    if isinstance(observations, Mapping)
                    else type(observations).__name__
                )
                raise ValueError(
                    f"observations: expected a dict with keys {sorted(self.observation_layout)}, "
                    f"got {received}"
                )
            return {key: self._to_tensor(key, observations[key]) for key in self.observation_layout}
        return self._to_tensor("", observations)

    def _mask_to_tensor(self, action_mask: np.ndarray | None, batch: int) -> torch.Tensor | None:
        width = self.distribution.mask_width
        if action_mask is None:
            if width:
                raise ValueError(
                    f"action_mask: this policy is masked (width {width}); pass the env's masks"
                )
            return None
        action_mask = np.asarray(action_mask)
        if action_mask.shape != (batch, width) or action_mask.dtype != np.bool_:
            raise ValueError(
                f"action_mask: expected shape ({batch}, {width}) bool, got {action_mask.shape} "
                f"{action_mask.dtype}"
            )
        return torch.from_numpy(np.ascontiguousarray(action_mask)).to(self.device)

    @torch.no_grad()
    def act(
        self,
        observations: Any,
        *,
        action_mask: np.ndarray | None = None,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> PPOActionBundle:
        """Choose actions for a batch of observations (no gradients).

        Args:
            observations: ``(B, *shape)`` numpy array of the model's observation dtype, or a dict
                key -> such array.
            action_mask: ``(B, mask width)`` bool for a masked policy (required then), else None.
            greedy: take the most probable action (:meth:`Policy.mode`) instead of sampling.
            generator: torch generator for sampling (on any device), for reproducible actors.
                ``None`` uses torch's global RNG.

        Returns:
            :class:`PPOActionBundle` of CPU numpy arrays: actions ``(B, *action_shape)`` in the
            distribution's dtype, log_probs ``(B,)`` float32 (log pi(action | observation),
            computed as in :meth:`evaluate_actions`), values ``(B,)`` float32, and the
            distribution's stored parameters (e.g. ``action_mean`` / ``action_std``).

        Raises:
            ValueError: observations or mask of the wrong shape or dtype.
        """
        obs = self._observations_to_tensor(observations)
        batch = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
        mask = self._mask_to_tensor(action_mask, batch)
        head, values = self._inference_forward(obs)
        if not greedy and self.__dict__.get(
            "_samples_in_numpy"
        ):  # the same draws, the rest in numpy
            uniform = torch.rand(
                head.shape,
                generator=generator,
                device=generator.device if generator is not None else head.device,
            )
            actions, log_probs = sample_categorical_numpy(
                head.numpy(), action_mask, uniform.cpu().numpy()
            )
            return PPOActionBundle(
                actions=actions.astype(self.distribution.action_dtype, copy=False),
                log_probs=log_probs.astype(np.float32, copy=False),
                values=values.numpy().astype(np.float32, copy=False),
                distribution_fields={},
            )
        policy = self.distribution.policy(head, mask)
        actions = policy.mode() if greedy else policy.sample(generator)
        log_probs = policy.log_prob(actions)
        dtype = _torch_dtype(self.distribution.action_dtype)
        return PPOActionBundle(
            actions=actions.to("cpu", dtype).numpy(),
            log_probs=log_probs.to("cpu", torch.float32).numpy(),
            values=values.to("cpu", torch.float32).numpy(),
            distribution_fields={
                name: tensor.to("cpu", torch.float32).numpy()
                for name, tensor in policy.stored().items()
            },
        )

    @torch.no_grad()
    def predict_values(self, observations: Any) -> np.ndarray:
        """State values V(observation) for a batch, ``(B,)`` float32 CPU numpy (no gradients).

        Used for the bootstrap value after the last rollout step and for the true final
        observation of a truncated episode. Raises ValueError for a wrong shape or dtype.
        """
        _, values = self._inference_forward(self._observations_to_tensor(observations))
        return values.to("cpu", torch.float32).numpy()

    def probe_observations(self, rows: int = 2) -> torch.Tensor:
        """``rows`` deterministic observations (seed 0) of the model's one observation key, in its
        shape and dtype: what an inference backend compares with this module when it is built."""
        shape, _ = self.observation_layout[""]
        dtype = self._torch_dtypes[""]
        generator = torch.Generator().manual_seed(0)
        if dtype.is_floating_point:
            return torch.randn((rows, *shape), generator=generator).to(dtype)
        return torch.randint(
            0, 2 if dtype == torch.bool else 100, (rows, *shape), generator=generator
        ).to(dtype)

    def check_inference_backend(self, forward: Any, *, what: str, tolerance: float) -> None:
        """Raise ValueError when ``forward`` (an inference backend: the contract of :meth:`forward`)
        gives a head output or values further than ``tolerance`` (relative and absolute) from this
        module's on :meth:`probe_observations`; ``what`` names the backend in the message."""
        probe = self.probe_observations()
        with torch.no_grad():
            expected = self(probe)
        for name, got, want in zip(("head outputs", "values"), forward(probe), expected):
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance):  # False on NaN too
                raise ValueError(
                    f"{what}: its {name} are off the model's by "
                    f"{float((got - want).abs().max()):.3g} on a probe batch"
                )

    def _inference_forward(self, observations: Any) -> tuple[torch.Tensor, torch.Tensor]:
        forward = self.__dict__.get("_inference_backend")
        return self(observations) if forward is None else forward(observations)

    def use_inference_backend(self, forward: Any | None) -> None:
        """Run :meth:`act` and :meth:`predict_values` through ``forward`` (the contract of
        :meth:`forward`, e.g. :class:`oakemu_core.policy.onnx_inference.OnnxForward`, which the caller
        keeps in step with the weights) instead of this module; None: this module again. Training
        (:meth:`policy_and_values`) always uses the module. A backend whose outputs are numpy arrays
        on the CPU (``numpy_outputs``) and a categorical policy: :meth:`act` samples in numpy too
        (:func:`~oakemu_core.policy.distributions.sample_categorical_numpy`: the same actions)."""
        self.__dict__["_inference_backend"] = forward
        self.__dict__["_samples_in_numpy"] = bool(
            getattr(forward, "numpy_outputs", False)
        ) and isinstance(self.distribution, Categorical)


def build_model(
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]] | tuple[int, ...],
    distribution: ActionDistribution | Any,
    num_actions: int | None = None,
    *,
    normalize_observations: bool = False,
) -> ActorCritic:
    """Build the actor-critic for these observations and this action distribution.

    Also accepts the plain form ``build_model(observation_shape, observation_dtype,
    num_actions)`` (one observation, a categorical policy). See :class:`ActorCritic`.
    """
    if num_actions is not None:
        return ActorCritic(
            {"": (tuple(observation_layout), distribution)},
            Categorical(num_actions),
            normalize_observations=normalize_observations,
        )
    return ActorCritic(
        observation_layout, distribution, normalize_observations=normalize_observations
    )


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, then each per-parameter state tensor (Adam's moments)
    re-laid in its parameter's memory layout, values unchanged.

    A checkpoint written by a learner whose convolutions were channels-last
    (:meth:`ActorCritic.use_channels_last`) holds moments in that layout, and one written without
    holds them contiguous; ``load_state_dict`` keeps the saved layout. Fused Adam pairs a parameter
    and its moments element by element in storage order, so mismatched layouts would update the
    wrong elements.

    Raises:
        ValueError: ``state`` belongs to an optimizer with other parameter groups (raised by
            ``load_state_dict``, before anything is loaded).
    """
    optimizer.load_state_dict(state)
    for parameter, parameter_state in optimizer.state.items():
        for name, value in parameter_state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == parameter.shape
                and value.stride() != parameter.stride()
            ):
                parameter_state[name] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)


def weights_to_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """Snapshot of every entry of ``model.state_dict()`` (parameters and normaliser statistics) as
    CPU, C-contiguous float32 numpy arrays.

    The arrays are copies: later optimizer steps do not change them. Raises TypeError if an entry
    is not a floating-point tensor.
    """
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise TypeError(f"weights_to_arrays: {name} has non-float dtype {tensor.dtype}")
        # A fresh contiguous copy; not np.ascontiguousarray, which turns 0-d entries into (1,).
        arrays[name] = tensor.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()
    return arrays


def load_weight_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy named float32 arrays (as from :func:`weights_to_arrays`) into ``model``'s state.

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
            raise ValueError(
                f"weights[{name!r}]: expected a numpy array, got {type(array).__name__}"
            )
        if array.dtype != np.float32:
            raise ValueError(f"weights[{name!r}]: expected dtype float32, got {array.dtype}")
        if tuple(array.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weights[{name!r}]: expected shape {tuple(tensor.shape)}, got {tuple(array.shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(torch.from_numpy(np.array(arrays[name], dtype=np.float32, copy=True)))
