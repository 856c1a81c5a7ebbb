"""The Python API: ``oakemu_core.train(...) -> Run`` and ``oakemu_core.load_policy(...) -> Policy``."""

from __future__ import annotations

from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

import oakemu_core
from oakemu_core.envs import env_spec
from oakemu_core.errors import CheckpointError, ConfigError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import save_run_checkpoint

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


def _checkpoint(run_dir: Path, env_id: str) -> Path:
    """A run folder holding one checkpoint of a freshly initialised policy for ``env_id``."""
    spec = env_spec(env_id)
    schema = schema_for_env(spec)
    torch.manual_seed(0)
    model = build_model(spec.observation_layout, schema.distribution)
    return save_run_checkpoint(
        run_dir,
        1,
        {
            "model": model.state_dict(),
            "config": {"env_id": env_id},
            "env": {"env_id": env_id, "schema": schema.to_dict()},
        },
    )


def test_a_loaded_policy_acts_with_valid_actions_one_or_a_batch(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "run", "CartPole-v1")
    policy = oakemu_core.load_policy(tmp_path / "run")  # a run folder: its latest checkpoint
    assert policy.env_id == "CartPole-v1" and policy.action_mask_width == 0
    observation, _ = gymnasium.make("CartPole-v1").reset(seed=0)
    action = policy.act(observation)
    assert np.ndim(action) == 0 and int(action) in (0, 1)
    batch = policy.act(np.stack([observation] * 5), greedy=False)
    assert batch.shape == (5,) and set(batch.tolist()) <= {0, 1}
    with pytest.raises(ValueError, match=r"expected shape \(4,\)"):
        policy.act(np.zeros(3))


def test_masked_actions_are_never_chosen(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "run", "Taxi-v4")
    policy = oakemu_core.load_policy(tmp_path / "run")
    assert policy.action_mask_width == 6
    observation = np.eye(500, dtype=np.float32)[
        123
    ]  # Taxi's state 123, one-hot as the env adapter gives it
    for allowed in range(6):
        mask = np.arange(6) == allowed
        assert policy.act(observation, mask) == allowed
        torch.manual_seed(allowed)
        sampled = policy.act(np.stack([observation] * 200), np.stack([mask] * 200), greedy=False)
        assert set(sampled.tolist()) == {allowed}
    unmasked = policy.act(
        np.stack([observation] * 200), greedy=False
    )  # no mask: every action allowed
    assert set(unmasked.tolist()) <= set(range(6)) and len(set(unmasked.tolist())) > 1


def test_load_policy_of_something_else_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("seed = 1\n")
    with pytest.raises(CheckpointError, match="is not a readable checkpoint"):
        oakemu_core.load_policy(tmp_path / "config.toml")
    with pytest.raises(CheckpointError, match="folder without checkpoints"):
        oakemu_core.load_policy(tmp_path)


def test_train_refuses_a_config_and_a_preset_together_and_unknown_settings() -> None:
    with pytest.raises(ConfigError, match="config or preset"):
        oakemu_core.train(oakemu_core.make_config(), preset="cartpole")
    with pytest.raises(
        ConfigError, match="lerning_rate: unknown setting .*did you mean 'learning_rate'"
    ):
        oakemu_core.train(preset="cartpole", lerning_rate=1e-3)


def _random_return(episodes: int = 20) -> float:
    """Mean return of uniformly random CartPole-v1 play (about 22)."""
    env, rng, returns = gymnasium.make("CartPole-v1"), np.random.default_rng(0), []
    for episode in range(episodes):
        env.reset(seed=episode)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(2)))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


@pytest.mark.slow
def test_train_a_preset_from_python_returns_a_run_that_beats_random_play(tmp_path: Path) -> None:
    """12,288 env steps of the cartpole preset, sync mode (a seed reproduces), its learning rate constant
    (annealed over so short a budget it halves what the run learns: 126.8 / 160.4): measured final
    evaluations 216.8 (seed 1) and 437.8 (seed 2) against about 22 for random play; a run that does not
    learn stays near 22."""
    run = oakemu_core.train(
        preset="cartpole",
        total_env_steps=12_288,
        mode="sync",
        anneal_lr=False,
        runs_dir=tmp_path / "runs",
    )
    assert run.exit_status == 0 and run.updates == 12_288 // 256
    assert run.final_evaluation is not None and run.best_evaluation is not None
    assert run.final_evaluation > 4 * _random_return(), run
    assert run.best_evaluation >= run.final_evaluation
    assert (
        run.latest_checkpoint is not None
        and run.latest_checkpoint.parent == run.run_dir / "checkpoints"
    )
    policy = run.load_policy(best=True)
    observation, _ = gymnasium.make("CartPole-v1").reset(seed=0)
    assert int(policy.act(observation)) in (0, 1)


@pytest.mark.slow
def test_a_callback_stops_training_early_quietly_and_train_returns_the_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A Callback returning False at update 3 stops a run with a budget of 4,000 updates: train returns
    the Run (final checkpoint written, stopped_by_callback); verbose=0 prints nothing."""
    updates: list[oakemu_core.UpdateInfo] = []
    seen: list[object] = []

    class StopAfterThreeUpdates(oakemu_core.Callback):
        def on_update(self, info: oakemu_core.UpdateInfo) -> bool:
            updates.append(info)
            return info.update < 3

    before = _children_now()
    run = oakemu_core.train(
        preset="cartpole",
        total_env_steps=1_024_000,
        runs_dir=tmp_path / "runs",
        callbacks=[StopAfterThreeUpdates(), seen.append],
        verbose=0,
    )
    assert run.stopped_by_callback and run.exit_status == 0
    assert [info.update for info in updates] == [1, 2, 3]  # none after the one that stopped the run
    assert (
        updates[0].global_step > 0
        and updates[0].policy_loss is not None
        and updates[0].learning_rate
    )
    assert [info for info in seen if isinstance(info, oakemu_core.UpdateInfo)] == updates[:2]
    assert 3 <= run.updates < 1_024_000 // 256 and run.latest_checkpoint is not None
    err = capfd.readouterr().err
    assert err == "", err
    _no_child_process_left(before)


@pytest.mark.slow
def test_an_exception_in_a_callback_stops_the_run_and_train_raises_it_after_clean_up(
    tmp_path: Path,
) -> None:
    def broken(info: object) -> None:
        if isinstance(info, oakemu_core.UpdateInfo) and info.update >= 2:
            raise ValueError("a bug in my callback")

    before = _children_now()
    with pytest.raises(ValueError, match="a bug in my callback"):
        oakemu_core.train(
            preset="cartpole",
            total_env_steps=1_024_000,
            runs_dir=tmp_path / "runs",
            callbacks=broken,
            verbose=0,
        )
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert oakemu_core.load_policy(run_dir) is not None  # the final checkpoint of the stopped run
    _no_child_process_left(before)


def _children_now() -> set[int]:
    """This process's descendants now: those of earlier tests (multiprocessing's resource tracker,
    started by the first shared-memory segment made in this process) are not the run's."""
    import os

    from tests.e2e_helpers import descendants

    return descendants([os.getpid()])


def _no_child_process_left(before: set[int]) -> None:
    """Every process the run started has exited (``before``: :func:`_children_now` before the run)."""
    from tests.e2e_helpers import wait_for

    wait_for(
        lambda: not (_children_now() - before),
        15,
        "the run's processes to exit",
        on_timeout=lambda: str(_children_now() - before),
    )
