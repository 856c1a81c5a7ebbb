"""Small image-like observations that are not pictures (MiniGrid's (7, 7, 3) grid of symbolic indices):
the encoder :func:`build_model` picks for them, how their values are scaled, and that small pictures
keep their CNN and their / 255. Learning figures: ``docs/benchmarks.md`` (bench_minigrid_vs_sb3.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import build_model, load_weight_arrays, weights_to_arrays

GRID = (
    7,
    7,
    3,
)  # MiniGrid's ImgObsWrapper: (view, view, [object type, colour, state]), channel-last


def grids(batch: int, seed: int = 0) -> np.ndarray:
    """MiniGrid-like observations: object types 0..10, colours 0..5, states 0..2, as uint8."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            rng.integers(0, 11, (batch, 7, 7)),
            rng.integers(0, 6, (batch, 7, 7)),
            rng.integers(0, 3, (batch, 7, 7)),
        ],
        axis=-1,
    ).astype(np.uint8)


def linears(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [
        (m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)
    ]


def test_a_symbolic_grid_gets_separate_mlps_on_its_flattened_values() -> None:
    model = build_model({"": (GRID, np.uint8)}, Categorical(7))
    assert not model.has_convolutions
    assert linears(model.actor_torso) == [(147, 64), (64, 64)] and linears(model.actor) == [(64, 7)]
    assert linears(model.critic_torso) == [(147, 64), (64, 64)] and linears(model.critic) == [
        (64, 1)
    ]
    assert model.actor_torso is not model.critic_torso
    assert sum(isinstance(m, torch.nn.Tanh) for m in model.actor_torso) == 2
    bundle = model.act(grids(3))
    assert bundle.actions.shape == (3,) and np.isfinite(bundle.log_probs).all()


def test_grid_values_are_normalised_by_running_statistics_not_divided_by_255() -> None:
    model = build_model({"": (GRID, np.uint8)}, Categorical(7))
    batch = grids(64, seed=1)
    # Before any statistics (mean 0, variance 1): the indices as they are, 10 stays 10.
    inputs = model._inputs(torch.from_numpy(batch))[""]
    torch.testing.assert_close(inputs, torch.from_numpy(batch).float(), rtol=0, atol=1e-6)
    # After the learner merges a batch: per-element (x - mean) / sqrt(var + 1e-8), clipped to +-10,
    # with the mean and variance of the two batches computed here by numpy.
    history = grids(256, seed=2)
    model.update_observation_statistics(history)
    mean, var = history.astype(np.float64).mean(0), history.astype(np.float64).var(0)
    prior = 1e-4  # the normaliser's initial count, of mean 0 and variance 1
    total = prior + len(history)
    merged_mean = mean * len(history) / total
    merged_var = (1.0 * prior + var * len(history) + mean**2 * prior * len(history) / total) / total
    expected = np.clip((batch - merged_mean) / np.sqrt(merged_var + 1e-8), -10, 10)
    inputs = model._inputs(torch.from_numpy(batch))[""].numpy()
    np.testing.assert_allclose(inputs, expected, rtol=1e-4, atol=1e-4)
    assert inputs.std() > 0.5  # unit scale, where / 255 gave at most 10 / 255 = 0.04
    # The network sees exactly these values, flattened in C order.
    head, values = model(torch.from_numpy(batch))
    flat = torch.from_numpy(expected.reshape(64, -1).astype(np.float32))
    torch.testing.assert_close(head, model.actor(model.actor_torso(flat)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        values, model.critic(model.critic_torso(flat)).squeeze(-1), rtol=1e-4, atol=1e-4
    )


def test_grid_statistics_travel_with_the_weights() -> None:
    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model({"": (GRID, np.uint8)}, Categorical(7))

    learner, actor, without = fresh(), fresh(), fresh()
    learner.update_observation_statistics(grids(128, seed=3))
    load_weight_arrays(actor, weights_to_arrays(learner))
    obs = grids(5, seed=4)
    np.testing.assert_array_equal(actor.predict_values(obs), learner.predict_values(obs))
    assert not np.allclose(
        without.predict_values(obs), learner.predict_values(obs)
    )  # the statistics matter


@pytest.mark.parametrize("shape", [(1, 10, 10), (3, 7, 7)])
def test_small_pictures_keep_their_cnn_and_their_255(shape: tuple[int, int, int]) -> None:
    """A channel-first picture of at least 5 x 5 (SB3's CNNs refuse 10 x 10) keeps the small 3x3 CNN on
    frames / 255, alone or as a key of a dict observation, and gets no running statistics."""
    model = build_model({"": (shape, np.uint8)}, Categorical(4))
    assert [m.kernel_size for m in model.modules() if isinstance(m, torch.nn.Conv2d)] == [
        (3, 3),
        (3, 3),
    ]
    assert len(model.normalizers) == 0
    frames = np.random.default_rng(5).integers(0, 256, (2, *shape), dtype=np.uint8)
    torch.testing.assert_close(
        model._inputs(torch.from_numpy(frames))[""], torch.from_numpy(frames).float() / 255.0
    )
    layout = {"image": (shape, np.uint8), "vector": ((2,), np.float32)}
    mixed = build_model(layout, Categorical(4))
    assert mixed.encoders["obs_image"][0].kernel_size == (3, 3) and len(mixed.normalizers) == 0


def test_a_frame_too_small_for_a_cnn_is_normalised_like_a_grid() -> None:
    model = build_model({"": ((1, 4, 4), np.uint8)}, Categorical(2))
    assert not model.has_convolutions and linears(model.actor_torso)[0] == (16, 64)
    assert "obs_" in model.normalizers


def test_a_minigrid_env_builds_the_mlp() -> None:
    """With MiniGrid installed (extra ``minigrid``): its ImgObsWrapper id gives a (7, 7, 3) uint8 layout."""
    pytest.importorskip(
        "minigrid", reason="minigrid is an optional benchmark dependency (extra 'minigrid')"
    )
    from oakemu_core.envs import factory

    spec = factory.env_spec("benchmarks.minigrid_envs:MiniGrid-Empty-5x5-Img-v0")
    assert spec.observation_layout == {"": (GRID, np.dtype(np.uint8))}
    model = build_model(spec.observation_layout, Categorical(int(spec.action_space.n)))
    assert not model.has_convolutions and linears(model.actor_torso)[0] == (147, 64)


def test_the_minigrid_benchmark_runs_oakemu_train_with_its_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """benchmarks/bench_minigrid_vs_sb3.py passes `oakemu train`'s own PPO defaults, the mode and the env
    in module:EnvId form (no training here)."""
    from tests.benchmarks.script_helpers import load_script, train_config

    module = load_script("bench_minigrid_vs_sb3")
    args = module.oakemu_minigrid_args(
        module.CASE.env_id,
        mode="async",
        seed=3,
        steps=4096,
        runs_dir=tmp_path,
        run_name="r",
        ports=[1, 2, 3, 4, 5],
    )
    config = train_config(args, monkeypatch)
    defaults = train_config(["--env", "CartPole-v1"], monkeypatch)
    assert (config.env_id, config.mode, config.seed) == (
        "benchmarks.minigrid_envs:MiniGrid-Empty-5x5-Img-v0",
        "async",
        3,
    )
    assert config.num_actors * config.envs_per_actor == module.CASE.num_envs
    for field in (
        "rollout_length",
        "ppo_epochs",
        "num_minibatches",
        "learning_rate",
        "gamma",
        "gae_lambda",
        "clip_coef",
        "ent_coef",
        "vf_coef",
        "max_grad_norm",
        "max_policy_lag",
        "normalize_observations",
        "normalize_rewards",
        "normalize_advantages",
        "target_kl",
    ):
        assert getattr(config, field) == getattr(defaults, field), field
    assert config.anneal_lr is False  # held constant on both sides (SB3's float learning rate)
