"""Actor inference with ONNX Runtime (oakemu_core/policy/onnx_inference.py): the same outputs as the torch
module, new weights after ``load``, ``act`` through the backend, refusals with a reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.config import ConfigError
from oakemu_core.policy.distributions import Categorical, DiagGaussian, MultiCategorical
from oakemu_core.policy.models import build_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
from oakemu_core.policy.onnx_inference import OnnxForward, check_available  # noqa: E402


def _outputs(model, observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        head, values = model(torch.from_numpy(observations))
    return head.numpy(), values.numpy()


@pytest.mark.parametrize(
    "layout, distribution",
    [
        ({"": ((4,), np.float32)}, Categorical(2)),  # CartPole: separate MLPs
        ({"": ((3,), np.float32)}, DiagGaussian([-2.0], [2.0])),  # Pendulum
        ({"": ((4, 84, 84), np.uint8)}, Categorical(4)),  # Atari: Nature CNN on uint8 frames
        ({"": ((5,), np.float32)}, MultiCategorical([3, 2])),
    ],
)
def test_the_session_gives_the_modules_outputs_and_follows_new_weights(
    layout, distribution
) -> None:
    torch.manual_seed(0)
    model = build_model(layout, distribution)
    shape, dtype = layout[""]
    rng = np.random.default_rng(0)
    observations = (
        rng.integers(0, 255, (5, *shape)) if dtype == np.uint8 else rng.normal(size=(5, *shape))
    ).astype(dtype)
    forward = OnnxForward(model)
    head, values = forward(torch.from_numpy(observations))
    expected_head, expected_values = _outputs(model, observations)
    assert head.shape == expected_head.shape and values.shape == expected_values.shape == (5,)
    np.testing.assert_allclose(head.numpy(), expected_head, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(values.numpy(), expected_values, rtol=1e-4, atol=1e-5)

    with torch.no_grad():  # a new policy version
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    new_head, _ = _outputs(model, observations)
    assert np.abs(new_head - expected_head).max() > 1e-3
    np.testing.assert_allclose(
        forward(torch.from_numpy(observations))[0].numpy(), expected_head, rtol=1e-4, atol=1e-5
    )
    forward.load(model)  # only now does the session act with the new weights
    np.testing.assert_allclose(
        forward(torch.from_numpy(observations))[0].numpy(), new_head, rtol=1e-4, atol=1e-5
    )
    one_head, one_value = forward(
        torch.from_numpy(observations[:1])
    )  # one row: a truncation's bootstrap
    np.testing.assert_allclose(one_head.numpy(), new_head[:1], rtol=1e-4, atol=1e-5)
    assert one_value.shape == (1,)


def test_act_and_predict_values_run_through_the_backend() -> None:
    torch.manual_seed(1)
    model = build_model({"": ((4,), np.float32)}, Categorical(2))
    observations = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    plain = model.act(observations, generator=torch.Generator().manual_seed(3))
    calls = []
    forward = OnnxForward(model)

    def counted(obs):
        calls.append(len(obs))
        return forward(obs)

    model.use_inference_backend(counted)
    backed = model.act(observations, generator=torch.Generator().manual_seed(3))
    values = model.predict_values(observations)
    assert calls == [8, 8]
    np.testing.assert_allclose(backed.log_probs, plain.log_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values, plain.values, rtol=1e-5, atol=1e-6)
    assert np.array_equal(
        model.act(observations, greedy=True).actions,
        (model.use_inference_backend(None), model.act(observations, greedy=True))[1].actions,
    )


def test_observation_statistics_reach_the_session_with_the_weights() -> None:
    model = build_model({"": ((4,), np.float32)}, Categorical(2), normalize_observations=True)
    forward = OnnxForward(model)
    observations = np.random.default_rng(2).normal(3.0, 2.0, size=(64, 4)).astype(np.float32)
    before = forward(torch.from_numpy(observations))[0].numpy()
    model.update_observation_statistics(observations)
    forward.load(model)
    after = forward(torch.from_numpy(observations))[0].numpy()
    assert np.abs(after - before).max() > 1e-4
    np.testing.assert_allclose(after, _outputs(model, observations)[0], rtol=1e-4, atol=1e-5)


def test_dict_observations_are_refused_with_the_reason() -> None:
    model = build_model(
        {"image": ((1, 8, 8), np.uint8), "vector": ((3,), np.float32)}, Categorical(2)
    )
    with pytest.raises(ValueError, match="dict observations are not supported"):
        OnnxForward(model)


def test_a_missing_package_is_named_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    check_available()  # both installed here
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnx" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"needs onnx: pip install 'oakemu-rl\[onnx\]'"):
        check_available()
