"""Actor inference with numpy (``actor_inference = "numpy"``, what ``"auto"`` picks for MLP models):
the same head output and values as the torch module, weights followed at every load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.actor.client import ActorSetupError
from oakemu_core.actor.join_setup import make_inference_backend
from oakemu_core.policy.distributions import Categorical, DiagGaussian
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.numpy_inference import NumpyForward, check_supported


def _model(
    shape: tuple[int, ...], dtype: type, distribution, *, normalize: bool = False
) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(
        {"": (shape, np.dtype(dtype))}, distribution, normalize_observations=normalize
    )


CASES = {
    "categorical": lambda: _model((4,), np.float32, Categorical(2)),
    "gaussian": lambda: _model((3,), np.float32, DiagGaussian(np.full(2, -1.0), np.full(2, 1.0))),
    "normalised": lambda: _model((5,), np.float32, Categorical(3), normalize=True),
    "uint8 grid": lambda: _model(
        (7, 7, 3), np.uint8, Categorical(7)
    ),  # MiniGrid: normalised either way
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_numpy_pass_gives_the_modules_outputs_and_follows_new_weights(case: str) -> None:
    """Outputs within float32 rounding of the module's, for every head kind and with observation
    statistics; after the weights (and statistics) change, ``load`` takes the new ones."""
    model = CASES[case]()
    shape, dtype = model.observation_layout[""]
    rng = np.random.default_rng(1)
    observations = (
        rng.integers(0, 11, (16, *shape))
        if dtype == np.uint8
        else 3 * rng.standard_normal((16, *shape))
    )
    batch = torch.from_numpy(observations.astype(dtype))
    forward = NumpyForward(model)
    with torch.no_grad():
        model.update_observation_statistics(
            observations.astype(dtype)
        )  # what a learner's update changes
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
        stale, _ = forward(batch)
        forward.load(model)
        expected = model(batch)
    got = forward(batch)
    assert not torch.allclose(stale, expected[0], atol=1e-3)  # the old weights' output was another
    for name, value, want in zip(("head", "values"), got, expected):
        assert value.dtype == torch.float32 and value.shape == want.shape, name
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("masked", [False, True])
def test_act_through_the_numpy_pass_samples_what_torch_samples(masked: bool) -> None:
    """``act`` with the backend (sampling in numpy too): the same actions as torch's module with
    the same generator, never a masked one, and log-probs and values within float32 rounding."""
    torch.manual_seed(0)
    model = ActorCritic({"": ((4,), np.dtype(np.float32))}, Categorical(5, masked=masked))
    rng = np.random.default_rng(2)
    observations = rng.standard_normal((256, 4)).astype(np.float32)
    mask = None
    if masked:
        mask = rng.random((256, 5)) < 0.5
        mask[np.arange(256), rng.integers(0, 5, 256)] = True  # every row allows an action
    plain = model.act(observations, action_mask=mask, generator=torch.Generator().manual_seed(5))
    model.use_inference_backend(NumpyForward(model))
    assert model.__dict__["_samples_in_numpy"]
    fast = model.act(observations, action_mask=mask, generator=torch.Generator().manual_seed(5))
    assert (
        fast.actions.dtype == plain.actions.dtype == np.int64 and fast.log_probs.dtype == np.float32
    )
    assert len(np.unique(fast.actions)) > 1  # sampled, not one action everywhere
    if masked:
        assert mask[np.arange(256), fast.actions].all()
    np.testing.assert_array_equal(fast.actions, plain.actions)
    np.testing.assert_allclose(fast.log_probs, plain.log_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fast.values, plain.values, rtol=1e-5, atol=1e-6)


def test_auto_picks_numpy_for_mlps_and_torch_for_pictures() -> None:
    mlp = CASES["categorical"]()
    assert isinstance(make_inference_backend("auto", mlp, threads=1), NumpyForward)
    cnn = _model((4, 84, 84), np.uint8, Categorical(4))
    assert make_inference_backend("auto", cnn, threads=1) is None
    with pytest.raises(
        ValueError, match="only for one vector observation without a user's encoder"
    ):
        NumpyForward(cnn)
    with pytest.raises(
        ValueError, match=r"uint8 \(4, 84, 84\) pictures; use actor_inference='torch'"
    ):
        check_supported(cnn.observation_layout)
    check_supported(mlp.observation_layout)  # no error


def test_a_layer_the_pass_does_not_know_is_refused() -> None:
    model = CASES["categorical"]()
    model.actor_torso[1] = torch.nn.ELU()
    with pytest.raises(ValueError, match=r"layers \['ELU'\]"):
        NumpyForward(model)


def test_a_pass_that_disagrees_with_the_module_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe batch at build time catches a numpy pass that drifted from the torch module."""
    model = CASES["gaussian"]()
    original = NumpyForward.__call__

    def off_by_a_little(
        self: NumpyForward, observations: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head, values = original(self, observations)
        return head, values + 1e-2

    monkeypatch.setattr(NumpyForward, "__call__", off_by_a_little)
    with pytest.raises(
        ValueError, match=r"actor_inference='numpy': its values are off the model's by 0.01"
    ):
        NumpyForward(model)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_a_recurrent_vector_policy_acts_in_numpy_as_in_torch(kind: str, activation: str) -> None:
    from oakemu_core.policy.network import NetworkSpec

    torch.manual_seed(2)
    network = NetworkSpec(
        recurrent=kind, recurrent_hidden=16, activation=activation, net_arch="pi=32 vf=8"
    )
    model = build_model(
        {"": ((4,), np.float32)}, Categorical(3), normalize_observations=True, network=network
    )
    model.normalizers["obs_"].update(torch.randn(64, 4) * 2 + 1)
    model.eval()
    backend = make_inference_backend("auto", model, threads=1)
    assert isinstance(backend, NumpyForward)
    rng = np.random.default_rng(0)
    torch_state = numpy_state = rng.normal(size=(16, model.state_size)).astype(np.float32)
    for _ in range(5):  # a few steps: the state carries
        observations = rng.normal(size=(16, 4)).astype(np.float32)
        model.use_inference_backend(None)
        plain = model.act(
            observations, state=torch_state, generator=torch.Generator().manual_seed(3)
        )
        model.use_inference_backend(backend)
        fast = model.act(
            observations, state=numpy_state, generator=torch.Generator().manual_seed(3)
        )
        np.testing.assert_allclose(fast.next_state, plain.next_state, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(fast.values, plain.values, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(fast.actions, plain.actions)
        torch_state, numpy_state = plain.next_state, fast.next_state
    with pytest.raises(ActorSetupError, match="serves feed-forward policies only"):
        make_inference_backend("onnxruntime", model, threads=1)
