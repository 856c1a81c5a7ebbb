"""The actor-side API of an :class:`~oakemu_core.policy.models.ActorCritic`: numpy observations in,
a :class:`~oakemu_core.policy.action_bundle.PPOActionBundle` out (:meth:`ActorAPI.act`,
:meth:`ActorAPI.predict_values`), with an optional inference backend (numpy, ONNX Runtime, bfloat16)
standing in for the module's forward pass, and a recurrent policy's state passed in and out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.policy.distributions import Categorical, sample_categorical_numpy

__all__ = ["ActorAPI", "torch_dtype"]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype matching a numpy dtype (raises TypeError for dtypes torch lacks)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class ActorAPI:
    """Mixed into :class:`~oakemu_core.policy.models.ActorCritic`: what actors, evaluation and
    ``load_policy`` call, on numpy arrays, without gradients. It reads the model's
    ``observation_layout``, ``is_dict``, ``distribution``, ``device``, ``core`` and ``state_size`` and
    calls its ``forward``."""

    observation_layout: dict[str, tuple[tuple[int, ...], np.dtype]]
    is_dict: bool
    distribution: Any
    core: Any
    _torch_dtypes: dict[str, torch.dtype]

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
            self._check_keys(observations)
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

    def _state_to_tensor(self, state: Any, batch: int) -> torch.Tensor | None:
        """A recurrent model's numpy state ``(batch, state_size)`` float32 as a tensor; None for a
        feed-forward model (which takes none)."""
        if self.core is None:
            if state is not None:
                raise ValueError("state: this policy is feed-forward; it takes no recurrent state")
            return None
        if state is None:
            raise ValueError(
                f"state: this policy is recurrent; pass state=, ({batch}, {self.state_size}) float32 "
                f"(model.initial_state({batch}) at an episode's start)"
            )
        state = np.asarray(state)
        if state.shape != (batch, self.state_size) or state.dtype != np.float32:
            raise ValueError(
                f"state: expected shape ({batch}, {self.state_size}) float32, got {state.shape} {state.dtype}"
            )
        return torch.from_numpy(np.ascontiguousarray(state)).to(self.device)

    @torch.no_grad()
    def act(
        self,
        observations: Any,
        *,
        action_mask: np.ndarray | None = None,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        state: np.ndarray | None = None,
    ) -> PPOActionBundle:
        """Choose actions for a batch of observations (no gradients).

        Args:
            observations: ``(B, *shape)`` numpy array of the model's observation dtype, or a dict
                key -> such array.
            action_mask: ``(B, mask width)`` bool for a masked policy (required then), else None.
            greedy: take the most probable action (:meth:`Policy.mode`) instead of sampling.
            generator: torch generator for sampling (on any device), for reproducible actors.
                ``None`` uses torch's global RNG.
            state: a recurrent model's state before these observations, ``(B, state_size)`` float32
                (required then; :meth:`initial_state` at an episode's start); None for a feed-forward one.

        Returns:
            :class:`PPOActionBundle` of CPU numpy arrays: actions ``(B, *action_shape)`` in the
            distribution's dtype, log_probs ``(B,)`` float32 (log pi(action | observation),
            computed as in :meth:`evaluate_actions`), values ``(B,)`` float32, and the
            distribution's stored parameters (e.g. ``action_mean`` / ``action_std``); a recurrent
            model also gives ``policy_state`` (``state``) and ``next_state`` (the state after).

        Raises:
            ValueError: observations, mask or state of the wrong shape or dtype, or a state missing
                (recurrent) or given (feed-forward).
        """
        obs = self._observations_to_tensor(observations)
        batch = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
        mask = self._mask_to_tensor(action_mask, batch)
        state_tensor = self._state_to_tensor(state, batch)
        recurrent: dict[str, Any] = {}
        if state_tensor is not None:
            head, values, next_state = self._inference_forward(obs, state_tensor)
            recurrent = {
                "policy_state": np.asarray(state, dtype=np.float32),
                "next_state": next_state.to("cpu", torch.float32).numpy(),
            }
        else:
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
                **recurrent,
            )
        policy = self.distribution.policy(head, mask)
        actions = policy.mode() if greedy else policy.sample(generator)
        log_probs = policy.log_prob(actions)
        dtype = torch_dtype(self.distribution.action_dtype)
        return PPOActionBundle(
            actions=actions.to("cpu", dtype).numpy(),
            log_probs=log_probs.to("cpu", torch.float32).numpy(),
            values=values.to("cpu", torch.float32).numpy(),
            distribution_fields={
                name: tensor.to("cpu", torch.float32).numpy()
                for name, tensor in policy.stored().items()
            },
            **recurrent,
        )

    @torch.no_grad()
    def predict_values(self, observations: Any, state: np.ndarray | None = None) -> np.ndarray:
        """State values V(observation) for a batch, ``(B,)`` float32 CPU numpy (no gradients); a
        recurrent model takes its ``state`` before these observations, as :meth:`act`.

        Used for the bootstrap value after the last rollout step and for the true final
        observation of a truncated episode. Raises ValueError for a wrong shape or dtype.
        """
        obs = self._observations_to_tensor(observations)
        batch = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
        state_tensor = self._state_to_tensor(state, batch)
        _, values, *_ = self._inference_forward(obs, state_tensor)
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
        state = ()
        if (
            self.core is not None
        ):  # a recurrent model: a probe state too, and the state after compared
            generator = torch.Generator().manual_seed(1)
            state = (torch.randn((len(probe), self.state_size), generator=generator),)
        with torch.no_grad():
            expected = self(probe, *state)
        names = ("head outputs", "values", "next states")
        for name, got, want in zip(names, forward(probe, *state), expected):
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance):  # False on NaN too
                raise ValueError(
                    f"{what}: its {name} are off the model's by "
                    f"{float((got - want).abs().max()):.3g} on a probe batch"
                )

    def _inference_forward(self, observations: Any, state: torch.Tensor | None = None) -> Any:
        """``forward`` (the module, or its inference backend) on observations, and a recurrent
        model's state: ``(head, values)``, plus the state after for a recurrent model."""
        forward = self.__dict__.get("_inference_backend") or self
        return forward(observations) if state is None else forward(observations, state)

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
