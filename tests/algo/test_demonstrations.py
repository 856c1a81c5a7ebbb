"""Behaviour cloning from Minari demonstrations (oakemu_core/algo/demonstrations.py, recording.py,
behaviour_cloning.py, oakemu record)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oakemu_core.envs import env_spec, make_eval_env
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import build_model
from oakemu_core.run.evaluation import play_episodes

pytest.importorskip(
    "h5py",
    reason="behaviour cloning needs the optional minari[hdf5] extra: pip install 'oakemu-rl[bc]'",
)
minari = pytest.importorskip(
    "minari",
    reason="behaviour cloning needs the optional minari extra: pip install 'oakemu-rl[bc]'",
)

from oakemu_core.algo.behaviour_cloning import bc_loss, behaviour_cloning_update  # noqa: E402
from oakemu_core.algo.demonstrations import (  # after the skip
    BCSampler,
    DemonstrationDataError,
    DemonstrationMismatchError,
    DemonstrationSampler,
    MinariNotInstalledError,
    batch_to_device,
    dataset_spaces,
)
from oakemu_core.algo.recording import record_dataset  # noqa: E402

EXPERT_EPISODES = 4


def cartpole_expert(observations: np.ndarray, action_mask: np.ndarray | None) -> np.ndarray:
    """A scripted CartPole controller (push towards the side the pole falls to): 500 every episode."""
    return (observations[:, 2] + 0.5 * observations[:, 3] > 0).astype(np.int64)


@pytest.fixture(scope="module")
def expert_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demos") / "cartpole-expert"
    summary = record_dataset(
        "CartPole-v1", path, episodes=EXPERT_EPISODES, policy=cartpole_expert, seed=0, num_envs=2
    )
    assert summary.returns == [500.0] * EXPERT_EPISODES
    return path


def _fresh_model(env_id: str, seed: int = 0):
    torch.manual_seed(seed)
    spec = env_spec(env_id)
    return build_model(spec.observation_layout, distribution_for_env(spec))


def _greedy_returns(model, env_id: str, episodes: int, seed: int = 100) -> list[float]:
    env = make_eval_env(env_id, seed=seed)
    try:
        model.eval()
        return play_episodes(model, env, episodes=episodes, greedy=True).returns
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------
def test_the_recording_is_a_minari_dataset_with_the_observations_the_policy_sees(
    expert_dataset: Path,
) -> None:
    spec = env_spec("CartPole-v1")
    dataset = minari.MinariDataset(expert_dataset / "data")
    assert (
        dataset.total_episodes == EXPERT_EPISODES and dataset.total_steps == 500 * EXPERT_EPISODES
    )
    observation_space, action_space = dataset_spaces(spec)
    assert dataset.observation_space == observation_space and dataset.action_space == action_space
    metadata = dataset.storage.metadata
    assert metadata["oakemu_env_id"] == "CartPole-v1"
    episode = next(iter(dataset.iterate_episodes()))
    assert (
        episode.observations.shape == (501, 4) and episode.observations.dtype == np.float32
    )  # T + 1
    assert episode.actions.shape == (500,) and episode.rewards.sum() == 500.0
    assert episode.truncations[-1] and not episode.terminations.any()
    # Actions are the expert's on the stored observations.
    np.testing.assert_array_equal(episode.actions, cartpole_expert(episode.observations[:-1], None))


def test_bc_pretraining_lifts_the_greedy_return_far_above_a_random_policy(
    expert_dataset: Path,
) -> None:
    torch.set_num_threads(1)
    spec = env_spec("CartPole-v1")
    sampler = BCSampler(expert_dataset, spec)
    assert BCSampler is DemonstrationSampler and len(sampler) == 500 * EXPERT_EPISODES

    env = make_eval_env("CartPole-v1", seed=7)
    rng = np.random.default_rng(0)
    env.reset()
    random_returns: list[float] = []
    while len(random_returns) < 30:
        random_returns.extend(env.step(rng.integers(0, 2, 1)).episode_returns)
    env.close()
    random_mean = float(np.mean(random_returns))
    assert 10 < random_mean < 40  # ~22

    model = _fresh_model("CartPole-v1")
    before = np.mean(_greedy_returns(model, "CartPole-v1", 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    losses = []
    for _ in range(10):  # 10 replay-only rollouts of one epoch each: no PPO update at all
        stats = behaviour_cloning_update(
            model, optimizer, sampler, batch_size=64, device="cpu", max_grad_norm=0.5, rng=rng
        )
        assert stats["bc_rows"] == len(sampler) and stats["bc_steps"] == np.ceil(len(sampler) / 64)
        losses.append(stats["bc_loss"])
    assert losses[-1] < 0.5 < losses[0]  # from ~ln 2
    assert stats["bc_accuracy"] > 0.8
    after = np.mean(_greedy_returns(model, "CartPole-v1", 5))
    print(
        f"CartPole greedy return: random policy {random_mean:.1f}, fresh model {before:.1f}, "
        f"after BC {after:.1f} (bc_loss {losses[0]:.3f} -> {losses[-1]:.3f})"
    )
    assert after >= 5 * random_mean and after >= 200


@pytest.mark.parametrize("other_env", ["Acrobot-v1", "MountainCar-v0"])
def test_a_dataset_of_other_spaces_is_refused_naming_both(tmp_path: Path, other_env: str) -> None:
    path = tmp_path / "other"
    record_dataset(other_env, path, episodes=1, policy="random", seed=0, max_episode_steps=20)
    DemonstrationSampler(path, env_spec(other_env))  # fits its own env
    with pytest.raises(DemonstrationMismatchError) as caught:
        DemonstrationSampler(path, env_spec("CartPole-v1"))
    message = str(caught.value)
    assert other_env in message and "CartPole-v1" in message
    assert "(4,) float32" in message and "Discrete(2)" in message  # the run's spaces
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("env_id", "keys", "action_dtype", "masked"),
    [
        (
            "tests.spaces_envs:DictTarget-v0",
            {"image": np.uint8, "vector": np.float32},
            np.int64,
            False,
        ),
        ("Taxi-v4", {"": np.float32}, np.int64, True),
        ("tests.spaces_envs:MaskedMultiDiscrete-v0", {"": np.float32}, np.int64, True),
        ("tests.spaces_envs:MultiBinaryTarget-v0", {"": np.float32}, np.int8, False),
        ("Pendulum-v1", {"": np.float32}, np.float32, False),
    ],
)
def test_batches_keep_the_layout_dtypes_and_masks(
    tmp_path: Path, env_id: str, keys: dict, action_dtype, masked: bool
) -> None:
    spec = env_spec(env_id)
    path = tmp_path / "demos"
    summary = record_dataset(
        env_id, path, episodes=2, policy="random", seed=1, max_episode_steps=50
    )
    sampler = DemonstrationSampler(path, spec)
    assert len(sampler) == summary.steps
    batch = sampler.sample(7, np.random.default_rng(0))
    observations = batch.observations if spec.is_dict_observation else {"": batch.observations}
    assert set(observations) == set(keys)
    for key, (shape, dtype) in spec.observation_layout.items():
        assert (
            observations[key].shape == (7, *shape) and observations[key].dtype == dtype == keys[key]
        )
    assert batch.actions.shape == (7, *spec.action_shape) and batch.actions.dtype == action_dtype
    if masked:
        assert (
            batch.action_mask.shape == (7, spec.action_mask_width)
            and batch.action_mask.dtype == bool
        )
        flat_actions = batch.actions.reshape(7, -1)
        offsets = np.concatenate([[0], np.cumsum(spec.action_mask_segments)[:-1]])
        assert batch.action_mask[
            np.arange(7)[:, None], offsets + flat_actions
        ].all()  # the recorded actions were allowed
    else:
        assert batch.action_mask is None
    # A BC step runs on every space (the model takes the batch as it comes).
    model = _fresh_model(env_id)
    stats = behaviour_cloning_update(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        sampler,
        batch_size=4,
        steps=2,
        device="cpu",
    )
    assert stats["bc_steps"] == 2 and np.isfinite(stats["bc_loss"])


def test_replay_rollouts_visit_every_row_once_per_pass(expert_dataset: Path) -> None:
    sampler = DemonstrationSampler(expert_dataset, env_spec("CartPole-v1"), seed=3)
    rows = len(sampler)
    seen = np.concatenate([sampler.replay_rollout(rows // 4).observations for _ in range(4)])
    everything = sampler._observations[""]
    assert seen.shape == everything.shape
    np.testing.assert_array_equal(np.sort(seen, axis=0), np.sort(everything, axis=0))
    assert len(sampler.replay_rollout(rows + 5)) == rows + 5  # wraps into the next pass
    with pytest.raises(ValueError, match="rows"):
        sampler.replay_rollout(0)
    with pytest.raises(ValueError, match="batch_size"):
        sampler.sample(0)


def test_bc_loss_is_the_mean_negative_log_likelihood(expert_dataset: Path) -> None:
    spec = env_spec("CartPole-v1")
    sampler = DemonstrationSampler(expert_dataset, spec)
    model = _fresh_model("CartPole-v1", seed=4)
    batch = batch_to_device(sampler.sample(32, np.random.default_rng(1)), "cpu")
    assert batch.observations.dtype == torch.float32 and batch.actions.dtype == torch.int64
    policy, _ = model.policy_and_values(batch.observations, None)
    logits, _ = model(batch.observations)
    expected = -torch.distributions.Categorical(logits=logits).log_prob(batch.actions).mean()
    torch.testing.assert_close(bc_loss(policy, batch.actions), expected)


def test_missing_or_existing_folders_are_clear_errors(tmp_path: Path, expert_dataset: Path) -> None:
    spec = env_spec("CartPole-v1")
    with pytest.raises(DemonstrationDataError, match="no such demonstration dataset"):
        DemonstrationSampler(tmp_path / "nothing", spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DemonstrationDataError, match="not a Minari dataset"):
        DemonstrationSampler(tmp_path / "empty", spec)
    with pytest.raises(DemonstrationDataError, match="already exists"):
        record_dataset("CartPole-v1", expert_dataset, episodes=1)
    DemonstrationSampler(expert_dataset / "data", spec)  # the data directory itself works too


def test_without_minari_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "minari", None)  # import minari -> ImportError
    with pytest.raises(MinariNotInstalledError, match=r"oakemu-rl\[bc\]"):
        record_dataset("CartPole-v1", tmp_path / "x", episodes=1)
    with pytest.raises(MinariNotInstalledError, match=r"oakemu-rl\[bc\]"):
        DemonstrationSampler(tmp_path / "x", env_spec("CartPole-v1"))


def test_oakemu_record_with_a_scripted_policy_and_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from oakemu_services.cli import main

    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.checkpoint import save_checkpoint

    monkeypatch.chdir(
        Path(__file__).resolve().parents[2]
    )  # tests.algo.test_demonstrations is importable from here
    scripted = tmp_path / "scripted"
    assert (
        main(
            [
                "record",
                "--env",
                "CartPole-v1",
                "--episodes",
                "2",
                "--output",
                str(scripted),
                "--policy",
                "tests.algo.test_demonstrations:cartpole_expert",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert "2 episodes, 1000 steps, return mean 500.00" in capsys.readouterr().out
    assert len(DemonstrationSampler(scripted, env_spec("CartPole-v1"))) == 1000

    spec = env_spec("CartPole-v1")
    model = _fresh_model("CartPole-v1", seed=5)
    checkpoint = tmp_path / "run" / "checkpoints" / "latest.pt"
    save_checkpoint(
        checkpoint,
        {
            "env": {"env_id": "CartPole-v1", "schema": schema_for_env(spec).to_dict()},
            "config": {"max_episode_steps": 30},
            "model": model.state_dict(),
        },
    )
    recorded = tmp_path / "from-checkpoint"
    assert (
        main(
            [
                "record",
                "--checkpoint",
                str(checkpoint),
                "--episodes",
                "2",
                "--output",
                str(recorded),
            ]
        )
        == 0
    )
    capsys.readouterr()
    sampler = DemonstrationSampler(recorded, spec)
    batch = sampler.sample(64, np.random.default_rng(0))
    greedy = model.act(batch.observations, greedy=True).actions
    np.testing.assert_array_equal(batch.actions, greedy)  # the checkpoint's greedy actions
    # The run's time limit (config max_episode_steps 30) applies to the recording.
    assert all(
        len(episode) <= 30 for episode in minari.MinariDataset(recorded / "data").iterate_episodes()
    )

    # Usage errors: one line, exit code 2.
    assert (
        main(
            [
                "record",
                "--env",
                "Acrobot-v1",
                "--checkpoint",
                str(checkpoint),
                "--episodes",
                "1",
                "--output",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "trained on 'CartPole-v1'" in capsys.readouterr().err
    assert main(["record", "--episodes", "1", "--output", str(tmp_path / "bad")]) == 2
    assert "--env" in capsys.readouterr().err


def test_oakemu_record_plays_the_env_settings_of_the_run_or_of_env_kwargs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from oakemu_services.cli import main

    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.checkpoint import save_checkpoint

    def lengths(folder: Path) -> list[int]:
        return [
            len(episode) for episode in minari.MinariDataset(folder / "data").iterate_episodes()
        ]

    random_play = tmp_path / "random"
    assert (
        main(
            [
                "record",
                "--env",
                "CartPole-v1",
                "--episodes",
                "3",
                "--output",
                str(random_play),
                "--env-kwargs",
                '{"max_episode_steps": 7}',
            ]
        )
        == 0
    )
    assert (
        max(lengths(random_play)) == 7
    )  # random CartPole lasts longer than 7 steps: the kwargs reached make()

    spec = env_spec("CartPole-v1")
    checkpoint = tmp_path / "run" / "checkpoints" / "latest.pt"
    save_checkpoint(
        checkpoint,
        {
            "env": {"env_id": "CartPole-v1", "schema": schema_for_env(spec).to_dict()},
            "config": {"env_kwargs": {"max_episode_steps": 5}},
            "model": _fresh_model("CartPole-v1", seed=5).state_dict(),
        },
    )
    from_run = tmp_path / "from-run"
    assert (
        main(
            [
                "record",
                "--checkpoint",
                str(checkpoint),
                "--episodes",
                "2",
                "--output",
                str(from_run),
            ]
        )
        == 0
    )
    assert lengths(from_run) == [
        5,
        5,
    ]  # a greedy untrained policy keeps the pole up longer than 5 steps
    capsys.readouterr()

    assert (
        main(
            [
                "record",
                "--env",
                "CartPole-v1",
                "--episodes",
                "1",
                "--output",
                str(tmp_path / "bad"),
                "--env-kwargs",
                "[1]",
            ]
        )
        == 2
    )
    assert "env_kwargs" in capsys.readouterr().err
    assert (
        main(
            [
                "record",
                "--checkpoint",
                str(checkpoint),
                "--episodes",
                "1",
                "--output",
                str(tmp_path / "bad"),
                "--env-kwargs",
                "{}",
            ]
        )
        == 2
    )
    assert "--env-kwargs" in capsys.readouterr().err
