"""Actor inference with a bfloat16 image encoder (oakemu_core/policy/bfloat16_inference.py): outputs within
bfloat16 rounding of the float32 model's, new weights only after ``load``, ``act`` through the
backend, refusals with a reason; and the emulator threads an actor asks for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.config import OakEmuConfig
from oakemu_core.policy.bfloat16_inference import BFloat16Forward
from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import build_model

ATARI = {"": ((4, 84, 84), np.uint8)}


def _frames(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, 4, 84, 84)).astype(np.uint8)


def _float32(model, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        head, values = model(torch.from_numpy(frames))
    return head.numpy(), values.numpy()


def _relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.abs(got.numpy() - want).max() / np.abs(want).max())


def test_outputs_are_the_float32_models_within_bfloat16_rounding_and_follow_new_weights() -> None:
    torch.manual_seed(0)
    model = build_model(ATARI, Categorical(4))
    frames = _frames(6)
    forward = BFloat16Forward(model)
    head, values = forward(torch.from_numpy(frames))
    want_head, want_values = _float32(model, frames)
    assert head.dtype == values.dtype == torch.float32  # the heads stay float32
    assert head.shape == (6, 4) and values.shape == (6,)
    # bfloat16 keeps 8 significant bits: about 1e-2 relative after three convolutions and a linear layer.
    assert _relative_error(head, want_head) < 0.02 and _relative_error(values, want_values) < 0.02
    assert not np.array_equal(head.numpy(), want_head)  # it really is another precision

    with torch.no_grad():  # a new policy version, large enough to move every output
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    new_head, _ = _float32(model, frames)
    assert np.abs(new_head - want_head).max() > 10 * np.abs(head.numpy() - want_head).max()
    # The encoder's weights are a copy: the heads follow at once (shared float32 modules), the encoder
    # only after load().
    forward.load(model)
    assert _relative_error(forward(torch.from_numpy(frames))[0], new_head) < 0.02
    one_head, one_value = forward(torch.from_numpy(frames[:1]))  # one row: a truncation's bootstrap
    assert _relative_error(one_head, new_head[:1]) < 0.02 and one_value.shape == (1,)


def test_the_255_scaling_is_folded_into_the_first_convolution_only_in_the_copy() -> None:
    torch.manual_seed(1)
    model = build_model(ATARI, Categorical(4))
    weight = model.encoders[model._module_key("")][0].weight.detach().clone()
    forward = BFloat16Forward(model)
    assert torch.equal(
        model.encoders[model._module_key("")][0].weight, weight
    )  # the model is untouched
    folded = forward._encoder[0].weight.float()
    torch.testing.assert_close(folded, (weight / 255.0).to(torch.bfloat16).float())
    # White and mid-grey frames: the top of the scaling (black frames give biases only).
    for value in (255, 128):
        frames = np.full((2, 4, 84, 84), value, np.uint8)
        assert (
            _relative_error(forward(torch.from_numpy(frames))[0], _float32(model, frames)[0]) < 0.02
        )


def test_act_and_predict_values_run_through_the_backend() -> None:
    torch.manual_seed(2)
    model = build_model(ATARI, Categorical(4))
    frames = _frames(8, seed=2)
    plain = model.act(frames, generator=torch.Generator().manual_seed(3))
    forward = BFloat16Forward(model)
    calls = []

    def counted(observations):
        calls.append(len(observations))
        return forward(observations)

    model.use_inference_backend(counted)
    backed = model.act(frames, generator=torch.Generator().manual_seed(3))
    values = model.predict_values(frames)
    assert calls == [8, 8]
    assert backed.actions.shape == (8,) and backed.actions.dtype == plain.actions.dtype
    np.testing.assert_allclose(backed.log_probs, plain.log_probs, atol=0.02)
    np.testing.assert_allclose(
        values, plain.values, rtol=0.02, atol=0.02 * np.abs(plain.values).max()
    )


@pytest.mark.parametrize(
    "layout, reason",
    [
        (
            {"": ((4,), np.float32)},
            r"only for uint8 image observations \(C, H, W\), this env gives float32 \(4,\)",
        ),
        ({"": ((8,), np.uint8)}, r"this env gives uint8 \(8,\)"),  # uint8, but an MLP's vector
        ({"": ((1, 8, 8), np.float32)}, r"this env gives float32 \(1, 8, 8\)"),
        (
            {"image": ((1, 8, 8), np.uint8), "vector": ((3,), np.float32)},
            r"only for one image observation, this env gives the keys \['image', 'vector'\]",
        ),
        (
            {"": ((1, 4, 4), np.uint8)},
            "does not start with a convolution",
        ),  # too small for one: flattened
    ],
)
def test_other_observations_are_refused_with_the_reason(layout, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        BFloat16Forward(build_model(layout, Categorical(2)))


def test_a_broken_copy_is_caught_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(ATARI, Categorical(4))
    original = BFloat16Forward.load

    def unscaled(self, model):  # as if the / 255 were not folded in: frames 255 x too bright
        original(self, model)
        with torch.no_grad():
            self._encoder[0].weight.mul_(255.0)

    monkeypatch.setattr(BFloat16Forward, "load", unscaled)
    with pytest.raises(ValueError, match="differs from the float32 model's"):
        BFloat16Forward(model)


@pytest.mark.parametrize(
    "setting, cpus, actors, groups, expected",
    [
        (None, 2, 2, 1, 1),  # the default on 2 cores: one emulator thread per actor
        (None, 2, 1, 1, 2),  # one actor takes both cores
        (None, 8, 3, 1, 2),
        (None, 1, 4, 1, 1),  # never below 1
        (None, 4, 1, 2, 2),  # shared by the env groups
        (3, 16, 2, 1, 3),  # set: kept
        (3, 16, 2, 2, 1),
    ],
)
def test_emulator_threads_per_actor(setting, cpus, actors, groups, expected) -> None:
    config = OakEmuConfig(emulator_threads=setting, num_actors=actors, env_groups=groups)
    assert config.resolved_emulator_threads(cpus=cpus) == expected


def test_actor_inference_bfloat16_is_a_setting() -> None:
    from oakemu_core.config import ConfigError, load_config

    assert load_config(["--actor-inference", "bfloat16"]).actor_inference == "bfloat16"
    with pytest.raises(
        ConfigError,
        match=r"--actor-inference: expected 'auto' or 'torch' or 'numpy' or 'onnxruntime' or 'bfloat16'",
    ):
        load_config(["--actor-inference", "float16"])


def test_the_actor_hands_every_weights_update_to_its_inference_backend() -> None:
    """``ActorWeights.load`` (join, rejoin, weights messages and revisions all go through it) loads
    the arrays into the model first, then the backend's ``load`` sees them: a bfloat16 encoder left
    with old weights would act an old policy."""
    from types import SimpleNamespace

    from oakemu_core.actor.join_setup import ActorPolicy
    from oakemu_core.actor.weights import ActorWeights
    from oakemu_core.policy.models import weights_to_arrays

    torch.manual_seed(3)
    model = build_model(ATARI, Categorical(4))
    seen = []

    class Recording:
        def load(self, loaded_model) -> None:
            seen.append(
                loaded_model.encoders[loaded_model._module_key("")][0].weight.detach().clone()
            )

    stepper = SimpleNamespace(policy_version=0, weights_revision=0)  # only what loads touch
    policy = ActorPolicy(env=None, model=model, inference_backend=Recording(), stepper=stepper)
    weights = ActorWeights(stepper, policy.load)
    for version, revision in ((1, 0), (1, 2), (2, 0)):
        arrays = weights_to_arrays(build_model(ATARI, Categorical(4)))
        weights.load(version, arrays, revision)
        assert torch.equal(
            seen[-1], torch.from_numpy(arrays[next(k for k in arrays if k.endswith("0.weight"))])
        )
        assert (stepper.policy_version, stepper.weights_revision) == (version, revision)
    assert len(seen) == 3
