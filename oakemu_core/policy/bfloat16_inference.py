"""Actor inference in bfloat16 for image observations (``--actor-inference bfloat16``).

The image encoder (a Nature CNN for Atari) runs with bfloat16 weights in channels-last layout, which
oneDNN computes with AMX or AVX512-BF16 where the CPU has them; the mixer and the policy and value
heads stay float32 (they are tiny, and a value of a few hundred rounded to bfloat16 is off by about 1).
The ``/ 255`` scaling of uint8 frames is folded into the first convolution's weights, so a frame
becomes bfloat16 in one copy (integers up to 256 are exact in bfloat16).

Without native bfloat16 oneDNN emulates it and this is slower than float32 (the actor logs a
warning). Timings against torch and ONNX Runtime: ``docs/benchmarks.md``.

The policy that acts is the bfloat16 rounding of the learner's: its log-probs and values differ from
float32 ones by rounding (log-probs by up to about 0.01, values by about 2 %). The actor says so at join
(``JoinRequest.inference_precision``) and the learner then re-evaluates every rollout in float32
(``off_policy_correction = "decoupled"``): its values V(s_t) replace the actors' before GAE (the
bootstrap values after a segment's last row and at truncations stay the actors') and the rounding
becomes an importance weight of the decoupled objective.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from oakemu_core.policy.models import ActorCritic

__all__ = ["BFloat16Forward", "PROBE_RELATIVE_TOLERANCE", "check_supported"]

PROBE_RELATIVE_TOLERANCE = 0.05
"""Largest difference to the float32 model on a probe batch, relative to the largest float32 output
(bfloat16 keeps 8 significant bits, about 0.4 % per operation; a structural mistake, such as a missing
``/ 255``, is off by orders of magnitude)."""


def check_supported(observation_layout: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
    """Refuse observations the bfloat16 forward does not serve, before any process starts.

    Args:
        observation_layout: key -> ``(shape, dtype)`` (``EnvSpec.observation_layout``).

    Raises:
        ValueError: not exactly one observation, or not a uint8 image ``(C, H, W)``; the message
            names what the env gives and the setting to use instead.
    """
    if len(observation_layout) != 1 or "" not in observation_layout:
        raise ValueError(
            f"actor_inference='bfloat16': only for one image observation, this env gives the keys "
            f"{sorted(observation_layout)}; use actor_inference='torch'"
        )
    shape, dtype = observation_layout[""]
    if np.dtype(dtype) != np.uint8 or len(shape) != 3:
        raise ValueError(
            f"actor_inference='bfloat16': only for uint8 image observations (C, H, W), this env "
            f"gives {np.dtype(dtype).name} {tuple(shape)}; use actor_inference='torch'"
        )


class BFloat16Forward:
    """``model.forward`` with a bfloat16 image encoder, same contract: ``(B, C, H, W)`` uint8 tensor ->
    ``(head output (B, param_size) float32, values (B,) float32)`` CPU tensors.

    Args:
        model: an :class:`oakemu_core.policy.models.ActorCritic` on the CPU whose one observation is a
            uint8 image ``(C, H, W)`` and whose encoder starts with a convolution (the Nature CNN).
            Its mixer and heads are used as they are (float32, updated in place with the weights).

    Raises:
        ValueError: dict or non-image observations, an encoder that does not start with a
            convolution, or outputs off the float32 model's by more than
            :data:`PROBE_RELATIVE_TOLERANCE` on a probe batch.
    """

    def __init__(self, model: ActorCritic) -> None:
        import torch  # here, not at the top: `oakemu train` checks the setting before it imports torch

        check_supported(model.observation_layout)
        shape, _ = model.observation_layout[""]
        self._model = model
        self.load(model)
        probe = torch.randint(
            0, 256, (4, *shape), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
        )
        with torch.no_grad():
            expected = model(probe)
        for name, got, want in zip(("head", "values"), self(probe), expected):
            error = float((got - want).abs().max())
            scale = float(want.abs().max()) + 1e-6
            if not error <= PROBE_RELATIVE_TOLERANCE * scale:  # False on NaN too
                raise ValueError(
                    f"actor_inference='bfloat16': the {name} differs from the float32 model's by "
                    f"{error:.3g} (largest output {scale:.3g}) on a probe batch"
                )

    def load(self, model: ActorCritic) -> None:
        """Take ``model``'s current encoder weights (call after every weights update of ``model``; the
        mixer and heads are ``model``'s own modules, current already). Copies the encoder (a Nature
        CNN: 1.7 M parameters, a few ms), so the model's float32 weights stay as they are.

        Raises:
            ValueError: the image encoder does not start with a convolution (an image too small for
                one, or channel-last: ``build_model`` then flattens it).
        """
        import torch
        from torch import nn

        encoders = getattr(
            model, "encoders", None
        )  # None: a non-picture observation, flattened into MLPs
        encoder = copy.deepcopy(encoders[model._module_key("")]) if encoders is not None else None
        first = encoder[0] if isinstance(encoder, nn.Sequential) and len(encoder) else None
        if not isinstance(first, nn.Conv2d):
            raise ValueError(
                "actor_inference='bfloat16': the image encoder does not start with a convolution"
            )
        with torch.no_grad():
            first.weight.mul_(
                1.0 / 255.0
            )  # conv(x / 255, W) = conv(x, W / 255): frames stay integers
        self._encoder = encoder.to(torch.bfloat16).to(memory_format=torch.channels_last).eval()

    def __call__(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, C, H, W)`` uint8 frames -> ``(head output (B, param_size), values (B,))``, float32."""
        import torch

        with torch.no_grad():
            frames = observations.to(dtype=torch.bfloat16, memory_format=torch.channels_last)
            hidden = self._model.mixer(self._encoder(frames).float())
            return self._model._heads(hidden, hidden)
