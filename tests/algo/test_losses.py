"""The one advantage normalisation (``oakemu_core.algo.losses.normalize_advantages``): per
minibatch in the PPO update, nowhere else (the buffer and its flat batch serve GAE's advantages)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import oakemu_core.algo.compiled_update as loss_module
from oakemu_core.algo.losses import normalize_advantages
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from tests.algo.test_ppo import OBS_DIM, N, T, _fill, _learner, _model


def test_normalize_advantages_by_hand() -> None:
    normalised = normalize_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    # mean 3, population std sqrt(2).
    np.testing.assert_allclose(
        normalised.numpy(), [-1.4142135, -0.7071068, 0.0, 0.7071068, 1.4142135], rtol=1e-6
    )
    assert normalised.dtype == torch.float32
    constant = normalize_advantages(torch.full((3,), 7.0))  # std 0: eps keeps it finite
    assert torch.equal(constant, torch.zeros(3))


@pytest.mark.parametrize("normalize", [True, False])
def test_the_update_normalises_each_minibatch_once(monkeypatch, normalize: bool) -> None:
    """Each minibatch's advantages reach the loss normalised over that minibatch (mean 0, std 1)
    when ``normalize_advantages`` is on, and exactly as GAE computed them when it is off."""
    seen: list[torch.Tensor] = []
    original = loss_module.ppo_losses

    def spy(*args, **kwargs):
        seen.append(args[2].detach().clone())  # the advantages argument
        return original(*args, **kwargs)

    monkeypatch.setattr(loss_module, "ppo_losses", spy)
    model = _model()
    with RolloutBuffer(T, N, (OBS_DIM,), np.float32, seed=0) as buffer:
        _fill(buffer, [model], np.random.default_rng(2))
        raw = np.sort(buffer.advantages[buffer.trainable])
        updater = _learner(model, ppo_epochs=1, num_minibatches=4, normalize_advantages=normalize)
        updater.step(buffer, current_policy_version=0)
    assert len(seen) == 4
    for advantages in seen:
        if normalize:
            assert float(advantages.mean()) == pytest.approx(0.0, abs=1e-5)
            assert float(advantages.std(correction=0)) == pytest.approx(1.0, abs=1e-4)
    if not normalize:
        np.testing.assert_array_equal(np.sort(torch.cat(seen).numpy()), raw)


def test_the_buffer_offers_no_normalisation_of_its_own() -> None:
    assert not hasattr(RolloutBuffer, "normalized_advantages")
    for method in (RolloutBuffer.flat_batch, RolloutBuffer.get_minibatches):
        assert "normalize_advantages" not in inspect.signature(method).parameters
