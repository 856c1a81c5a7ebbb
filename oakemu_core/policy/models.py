"""Actor-critic networks for any observation layout and action distribution, CPU inference for
actors, and weights <-> numpy arrays.

An :class:`ActorCritic` is built from an observation layout (key -> per-env shape and dtype; key
``""`` for a plain observation) and an :class:`~oakemu_core.policy.distributions.ActionDistribution`.
It never asks which action space it serves: the distribution makes the policy head and turns its
output into a :class:`~oakemu_core.policy.distributions.Policy`.

The layers: ``encoders -> core -> torsos -> heads``, chosen by a
:class:`~oakemu_core.policy.network.NetworkSpec` (defaults below; ``network.py`` has the options).
A *picture* is a channel-first ``(C, H, W)`` key with H and W at least ``SMALL_CNN_MIN_SIZE`` (5).

* one plain observation that is not a picture (a vector ``(D,)`` as in classic control, or any
  other shape, flattened: MiniGrid's ``(7, 7, 3)`` symbolic grid, a ``(1, 4, 4)`` frame): separate
  actor and critic MLPs, 64-64 tanh, as CleanRL ``ppo.py`` / ``ppo_continuous_action.py`` and SB3's
  ``MlpPolicy``;
* otherwise one encoder per key, concatenated (SB3's ``CombinedExtractor``): pictures get the Nature
  CNN of Mnih et al. 2015 (CleanRL ``ppo_atari.py``) or the IMPALA ResNet (``cnn``) when at least
  36 x 36, and a small 3x3 CNN (fc 256) when smaller (SB3 fails there with a conv2d size error); other
  keys are flattened. With more than one key a 256-unit ReLU layer mixes the concatenated features.
  Actor and critic share the encoders; the heads read them directly (``net_arch`` auto).
* a recurrent core (:class:`~oakemu_core.policy.recurrent.RecurrentCore`, LSTM or GRU) between the
  encoders and the torsos makes the policy carry a state per env: :meth:`ActorCritic.act` takes and
  returns it, :meth:`ActorCritic.forward` runs sequences from stored states.
* a user's encoder (``policy_module``, :func:`~oakemu_core.policy.encoders.user_encoder`) replaces
  the encoders.

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

from oakemu_core.policy.acting import ActorAPI, torch_dtype
from oakemu_core.policy.distributions import ActionDistribution, Categorical, Policy
from oakemu_core.policy.encoders import (
    UserEncoderError,
    impala_cnn,
    layer_init,
    mlp,
    nature_cnn,
    small_cnn,
    user_encoder,
)
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.normalizer import RunningNormalizer
from oakemu_core.policy.recurrent import RecurrentCore
from oakemu_core.policy.weights import load_optimizer_state, load_weight_arrays, weights_to_arrays

__all__ = [
    "ActorCritic",
    "NetworkSpec",
    "load_optimizer_state",
    "RunningNormalizer",
    "build_model",
    "has_separate_mlps",
    "load_weight_arrays",
    "weights_to_arrays",
]

NATURE_CNN_MIN_SIZE = 36
"""Smallest frame side the Nature CNN's and the IMPALA ResNet's layers are used for."""
SMALL_CNN_MIN_SIZE = 5


def _is_picture(shape: tuple[int, ...]) -> bool:
    """A channel-first ``(C, H, W)`` key that a CNN encodes: both sides at least SMALL_CNN_MIN_SIZE.

    Anything else is flattened, e.g. MiniGrid's ``(7, 7, 3)`` channel-last grid of symbolic indices,
    read as C = 7, H = 7, W = 3.
    """
    return len(shape) == 3 and min(shape[1:]) >= SMALL_CNN_MIN_SIZE


def has_separate_mlps(
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
    network: NetworkSpec | None = None,
) -> bool:
    """Whether the model of ``observation_layout`` (key -> (shape, dtype)) and ``network`` is
    CleanRL's classic-control network: one key ``""`` that is not a picture, flattened into separate
    actor and critic MLPs (no core, no user encoder, no shared torso)."""
    network = network or NetworkSpec()
    only = observation_layout.get("")
    return (
        only is not None
        and not _is_picture(tuple(only[0]))
        and not network.is_recurrent
        and network.policy_module is None
        and not network.shared_torso
    )


def _normalized(shape: tuple[int, ...], dtype: np.dtype, normalize_observations: bool) -> bool:
    """Whether a key gets a :class:`RunningNormalizer`: float keys under ``normalize_observations``,
    and uint8 keys that are not pictures always (a uint8 grid of symbolic indices or a RAM dump has no
    pixel scale: MiniGrid declares ``Box(0, 255)`` for indices 0..10, which ``/ 255`` shrinks to
    0..0.04)."""
    if dtype == np.uint8:
        return not _is_picture(shape)
    return normalize_observations and dtype.kind == "f"


class ActorCritic(ActorAPI, nn.Module):
    """Actor-critic for any observation layout and action distribution (see module docstring).

    Args:
        observation_layout: key -> (per-env shape, dtype); key ``""`` for a plain observation.
        distribution: the action distribution (decides the policy head and the action space).
        normalize_observations: keep running statistics of float keys and normalise with them
            (uint8 keys that are not pictures are normalised either way).
        network: the architecture (:class:`~oakemu_core.policy.network.NetworkSpec`); None: the default.

    Raises:
        ValueError: an empty layout, or a key with a non-positive dimension.
        UserEncoderError: the user's encoder (``network.policy_module``) cannot be built.
    """

    def __init__(
        self,
        observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
        distribution: ActionDistribution,
        *,
        normalize_observations: bool = False,
        network: NetworkSpec | None = None,
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
        self.network = network = network or NetworkSpec()
        self.distribution = distribution
        self.is_dict = "" not in self.observation_layout
        self._torch_dtypes = {
            key: torch_dtype(dtype) for key, (_, dtype) in self.observation_layout.items()
        }
        self.normalizers = nn.ModuleDict()
        for key, (shape, dtype) in self.observation_layout.items():
            if _normalized(shape, dtype, normalize_observations):
                self.normalizers[self._module_key(key)] = RunningNormalizer(shape)

        self.separate_mlps = has_separate_mlps(self.observation_layout, network)
        features = self._build_encoders(network)
        self.encoder_features = features
        """Features per row out of the encoders (and the mixer): what the core or the torsos read."""
        self.core = (
            RecurrentCore(network.recurrent, features, network.recurrent_hidden)
            if network.is_recurrent
            else None
        )
        self.critic_core = (  # sb3-contrib RecurrentPPO's default: the critic's own LSTM
            RecurrentCore(network.recurrent, features, network.recurrent_hidden)
            if network.is_recurrent and not network.shared_core
            else None
        )
        if self.core is not None:
            features = network.recurrent_hidden
        vector = (
            not self.is_dict
            and not _is_picture(self.observation_layout[""][0])
            and network.policy_module is None
        )
        actor_sizes, critic_sizes = network.torso_sizes(vector_observation=vector)
        self.actor_torso, actor_features = mlp(features, actor_sizes, network.activation)
        if network.shared_torso:
            self.critic_torso, critic_features = self.actor_torso, actor_features
        else:
            self.critic_torso, critic_features = mlp(features, critic_sizes, network.activation)
        self.actor = distribution.make_head(actor_features)
        self.critic = layer_init(nn.Linear(critic_features, 1), std=1.0)
        self.channels_last = False  # see use_channels_last()
        if (
            not network.ortho_init
        ):  # PyTorch's own initialisation of every layer (a user's encoder's too)
            for module in self.modules():
                if module is not self and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        if network.policy_module is not None:
            self._check_user_encoder()

    def _build_encoders(self, network: NetworkSpec) -> int:
        """The encoders (one per key, or the user's) and the mixer of several keys' features; returns
        the features per row they give."""
        self.encoders = nn.ModuleDict()
        self.mixer: nn.Module = nn.Identity()
        if network.policy_module is not None:
            self.user_encoder, features = user_encoder(
                network.policy_module, self.observation_layout
            )
            return features
        features = 0
        for key, (shape, _) in self.observation_layout.items():
            encoder, size = self._encoder(shape, network)
            self.encoders[self._module_key(key)] = encoder
            features += size
        if len(self.observation_layout) > 1:
            self.mixer = nn.Sequential(layer_init(nn.Linear(features, 256)), nn.ReLU())
            features = 256
        return features

    @staticmethod
    def _module_key(key: str) -> str:
        # ModuleDict keys may not contain "."; "" is not allowed either.
        return "obs_" + key.replace(".", "__")

    @staticmethod
    def _encoder(shape: tuple[int, ...], network: NetworkSpec) -> tuple[nn.Module, int]:
        if _is_picture(shape):
            channels, height, width = shape
            if min(height, width) < NATURE_CNN_MIN_SIZE:
                return small_cnn(channels, height, width)
            if network.cnn == "impala":
                return impala_cnn(channels, height, width, network.impala_channels)
            return nature_cnn(channels, height, width)
        return nn.Flatten(), math.prod(shape)

    def _check_user_encoder(self) -> None:
        """Run the user's encoder on a probe batch of zeros; raise UserEncoderError (one line) when it
        fails or returns anything but ``(2, out_features)`` finite floats."""
        path = self.network.policy_module
        inputs = {
            key: torch.zeros((2, *shape), dtype=self._torch_dtypes[key])
            for key, (shape, _) in self.observation_layout.items()
        }
        try:
            with torch.no_grad():
                features = self._features(self._inputs(inputs if self.is_dict else inputs[""]))
        except Exception as error:  # noqa: BLE001 - a user's code: any error is reported in one line
            raise UserEncoderError(
                f"policy_module {path!r}: its forward failed on a probe batch "
                f"({type(error).__name__}: {error})"
            ) from None
        expected = (2, self.encoder_features)
        if not isinstance(features, torch.Tensor) or tuple(features.shape) != expected:
            got = (
                tuple(features.shape)
                if isinstance(features, torch.Tensor)
                else type(features).__name__
            )
            raise UserEncoderError(
                f"policy_module {path!r}: expected features of shape {expected} on a probe batch of 2 "
                f"rows (out_features), got {got}"
            )
        if features.dtype != torch.float32:
            raise UserEncoderError(
                f"policy_module {path!r}: expected float32 features, got {str(features.dtype)[6:]}"
            )
        if not bool(torch.isfinite(features).all()):
            raise UserEncoderError(
                f"policy_module {path!r}: its features of a probe batch of zeros are not finite "
                f"(NaN or inf)"
            )

    @property
    def recurrent(self) -> bool:
        """The model carries a state per env (a recurrent core)."""
        return self.core is not None

    @property
    def state_size(self) -> int:
        """Floats of one env's recurrent state (0 for a feed-forward model)."""
        if self.core is None:
            return 0
        return self.core.state_size * (1 if self.critic_core is None else 2)

    def initial_state(self, batch: int) -> np.ndarray:
        """The state of ``batch`` envs at an episode's start: ``(batch, state_size)`` float32 zeros."""
        return np.zeros((batch, self.state_size), dtype=np.float32)

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
        """The device of the parameters, cached (a module walk per actor step costs); reset by every
        way parameters move: :meth:`_apply` (``.to()``), :meth:`load_state_dict`, unpickling."""
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

    def _check_keys(self, observations: Any) -> None:
        """Raise ValueError unless ``observations`` is a dict with exactly the model's keys."""
        if not isinstance(observations, Mapping) or set(observations) != set(
            self.observation_layout
        ):
            got = (
                sorted(observations)
                if isinstance(observations, Mapping)
                else type(observations).__name__
            )
            raise ValueError(
                f"observations: expected a dict with keys {sorted(self.observation_layout)}, got {got}"
            )

    def _inputs(self, observations: Any) -> dict[str, torch.Tensor]:
        if self.is_dict:
            self._check_keys(observations)
            return {key: self._prepare(key, observations[key]) for key in self.observation_layout}
        return {"": self._prepare("", observations)}

    def _features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The encoders' features ``(B, encoder_features)`` of prepared inputs (scaled, normalised)."""
        if self.network.policy_module is not None:
            return self.user_encoder(inputs if self.is_dict else inputs[""])
        if len(inputs) == 1:
            ((key, x),) = inputs.items()
            return self.mixer(self.encoders[self._module_key(key)](x))
        return self.mixer(
            torch.cat(
                [self.encoders[self._module_key(key)](x) for key, x in inputs.items()], dim=-1
            )
        )

    def forward(
        self,
        observations: Any,
        state: torch.Tensor | None = None,
        resets: torch.Tensor | None = None,
    ) -> Any:
        """Policy-head output and state values (and, for a recurrent model, the state after).

        Args:
            observations: ``(B, *shape)`` tensor of the model's observation dtype on the model's
                device (uint8 frames stay uint8 until here), or a dict key -> such tensor. For a
                recurrent model ``B = L * E``: ``L`` steps of ``E`` sequences, time-major.
            state: recurrent models only (required): ``(E, state_size)`` float32, the state before
                each sequence's first step (:mod:`oakemu_core.policy.recurrent`).
            resets: recurrent models only: ``(L, E)`` bool, True where the state is zeroed before
                that step (the previous step ended an episode); None: none.

        Returns:
            ``(head output (B, distribution.param_size) float32, values (B,) float32)``; a recurrent
            model adds the state after the last step, ``(E, state_size)``.

        Raises:
            ValueError: wrong keys, trailing shape or dtype; a state given to a feed-forward model or
                missing for a recurrent one.
        """
        features = self._features(self._inputs(observations))
        if self.core is None:
            if state is not None:
                raise ValueError("state: this policy is feed-forward; it takes no recurrent state")
            return self._heads(self.actor_torso(features), self.critic_torso(features))
        if state is None:
            raise ValueError(
                f"state: this policy is recurrent; pass its state ({self.state_size} floats per env, "
                f"zeros at an episode's start)"
            )
        if self.critic_core is None:
            hidden, final = self.core.sequence(features, state, resets)
            head, values = self._heads(self.actor_torso(hidden), self.critic_torso(hidden))
            return head, values, final
        actor_state, critic_state = state.split(self.core.state_size, dim=-1)
        hidden, actor_final = self.core.sequence(features, actor_state, resets)
        critic_hidden, critic_final = self.critic_core.sequence(features, critic_state, resets)
        head, values = self._heads(self.actor_torso(hidden), self.critic_torso(critic_hidden))
        return head, values, torch.cat([actor_final, critic_final], dim=-1)

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
        self,
        observations: Any,
        action_mask: torch.Tensor | None = None,
        *,
        state: torch.Tensor | None = None,
        resets: torch.Tensor | None = None,
    ) -> tuple[Policy, torch.Tensor]:
        """The action :class:`Policy` (masked when ``action_mask`` ``(B, width)`` bool is given)
        and the values ``(B,)``, with gradients. A recurrent model takes ``state`` and ``resets`` as
        :meth:`forward` does (``B = L * E`` rows, time-major) and drops the final state."""
        head, values, *_ = self(observations, state, resets)
        return self.distribution.policy(head, action_mask), values

    def evaluate_actions(
        self,
        observations: Any,
        actions: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        *,
        state: torch.Tensor | None = None,
        resets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities, entropy and values of stored actions, with gradients (``state`` and
        ``resets``: as :meth:`policy_and_values`).

        Returns:
            ``(log_probs (B,), entropy (B,), values (B,))``, all float32.
        """
        policy, values = self.policy_and_values(
            observations, action_mask, state=state, resets=resets
        )
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


def build_model(
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]] | tuple[int, ...],
    distribution: ActionDistribution | Any,
    num_actions: int | None = None,
    *,
    normalize_observations: bool = False,
    network: NetworkSpec | None = None,
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
            network=network,
        )
    return ActorCritic(
        observation_layout,
        distribution,
        normalize_observations=normalize_observations,
        network=network,
    )
