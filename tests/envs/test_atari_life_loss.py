"""Atari life-loss episodes (``atari_episodic_life``; oakemu_core/envs/atari.py and vector.py) against a
reference written here on ale-py's plain ``ALEInterface``: SB3's ``EpisodicLifeEnv`` with FIRE after a lost
life. The learner sees ``terminated`` on every lost life and on game over, the game is not restarted on a
lost life, and the episode statistics are whole games (docs/decisions/atari-life-loss.md). The actor stores
the FIRE the env forces after a lost life as the action taken, non-trainable (oakemu_core/actor/stepper.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from oakemu_core.actor.routing import PolicyRouter, RoutingConfig
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.config import make_config
from oakemu_core.envs import make_vector_env
from oakemu_core.envs.factory import make_env_groups
from oakemu_core.envs.options import EnvOptions
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import build_model
from oakemu_core.presets import load_preset

ale_py = pytest.importorskip("ale_py")

FRAME_SKIP = 4
# No sticky actions and no random no-ops, so the reference plays the very same frames as ale-py's vector env.
OPTIONS = EnvOptions(atari_sticky_actions=0.0, atari_noop_max=0, atari_episodic_life=True)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The policy's forward passes on one thread, as an actor runs them: with torch's default of one
    thread per core each small forward pass waits for a busy machine's scheduler (beside one training
    run on 2 cores the FIRE tests took 68-86 s with it, 3 s with one thread; at a load of 15 they timed out)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ReferenceBreakout:
    """Breakout on one ``ALEInterface``: ale-py's vector-env reset (the game, then one FIRE frame), frame
    skip 4 summing rewards, and SB3's ``EpisodicLifeEnv``: ``terminated`` on game over or when the lives
    counter drops while lives remain, the game going on; after a lost life the next step plays FIRE
    (``FireResetEnv``). A game over restarts the game (same-step autoreset)."""

    def __init__(self, seed: int, *, fire_after_life_loss: bool = True) -> None:
        self.fire_after_life_loss = fire_after_life_loss
        self.ale = ale_py.ALEInterface()
        self.ale.setInt("random_seed", seed)
        self.ale.setFloat("repeat_action_probability", 0.0)
        self.ale.loadROM(ale_py.roms.get_rom_path("breakout"))
        self.action_set = list(self.ale.getMinimalActionSet())
        self.fire = self.action_set.index(ale_py.Action.FIRE)
        self._restart()

    def _restart(self) -> None:
        self.ale.reset_game()
        self.ale.act(ale_py.Action.FIRE)
        self.lives = self.ale.lives()
        self.fire_next = False
        self.score = 0.0
        self.length = 0

    def step(self, action: int) -> tuple[float, bool, bool, tuple[float, int] | None]:
        """``(reward, terminated, life lost with the game going on, (score, length) of a game that ended)``."""
        if self.fire_next:
            action = self.fire
        reward = 0.0
        for _ in range(FRAME_SKIP):
            reward += self.ale.act(self.action_set[action])
            if self.ale.game_over():
                break
        lives, game_over = self.ale.lives(), self.ale.game_over()
        life_lost = 0 < lives < self.lives and not game_over
        self.lives = lives
        self.score += reward
        self.length += 1
        self.fire_next = life_lost and self.fire_after_life_loss
        ended = (self.score, self.length) if game_over else None
        if game_over:
            self._restart()
        return reward, game_over or life_lost, life_lost, ended


def test_life_losses_end_the_learners_episode_while_the_game_goes_on_against_a_reference() -> None:
    seed, num_envs, steps = 7, 2, 1600
    references = [ReferenceBreakout(seed + row) for row in range(num_envs)]
    # Never FIRE: after a lost life only the env's own FIRE serves the ball again.
    rng = np.random.default_rng(0)
    not_fire = np.array([0, 2, 3])
    life_losses = games = 0
    with make_vector_env(
        "ALE/Breakout-v5", num_envs, seed=seed, num_threads=1, clip_rewards=False, options=OPTIONS
    ) as env:
        env.reset()
        for t in range(steps):
            actions = not_fire[rng.integers(0, 3, size=num_envs)]
            step = env.step(actions)
            expected = [
                reference.step(int(action))
                for reference, action in zip(references, actions, strict=True)
            ]
            where = f"step {t}"
            np.testing.assert_array_equal(
                step.training_rewards, [e[0] for e in expected], err_msg=where
            )
            assert step.terminated.tolist() == [e[1] for e in expected], where
            assert not step.truncated.any(), where
            ended = [(row, e[3]) for row, e in enumerate(expected) if e[3] is not None]
            assert step.episode_env_ids == [row for row, _ in ended], where
            assert step.episode_returns == [score for _, (score, _) in ended], where
            assert step.episode_lengths == [length for _, (_, length) in ended], where
            for row, (_, _, life_lost, _) in enumerate(expected):
                if life_lost:  # the game goes on: the next observation is the last one of the life, not a reset
                    np.testing.assert_array_equal(
                        step.final_observations[row], step.observations[row]
                    )
                    life_losses += 1
            games += len(ended)
    assert (
        games >= 2 and life_losses >= 4 * games
    )  # Breakout has 5 lives: 4 lost with the game going on


def test_whole_game_returns_equal_the_sum_of_the_raw_rewards_of_its_lives() -> None:
    with make_vector_env(
        "ALE/Breakout-v5", 1, seed=3, num_threads=1, clip_rewards=False, options=OPTIONS
    ) as env:
        env.reset()
        rng = np.random.default_rng(1)
        score, lives_seen, games = 0.0, 0, []
        while len(games) < 2:
            step = env.step(rng.integers(0, env.spec.num_actions, size=1))
            score += float(step.training_rewards[0])
            lives_seen += int(step.terminated[0])
            if step.episode_returns:
                games.append((step.episode_returns[0], score, lives_seen))
                score, lives_seen = 0.0, 0
    for logged, summed, terminations in games:
        assert logged == summed
        assert terminations == 5  # one learner episode per life, one game


def test_the_atari_preset_and_the_default_settings_end_episodes_on_a_lost_life() -> None:
    assert load_preset("atari").settings["atari_episodic_life"] is True
    assert make_config().env_options.atari_episodic_life is True
    assert make_config(atari_episodic_life=False).env_options.atari_episodic_life is False


def test_without_life_loss_episodes_only_game_over_terminates() -> None:
    options = EnvOptions(atari_sticky_actions=0.0, atari_noop_max=0, atari_episodic_life=False)
    with make_vector_env("ALE/Breakout-v5", 1, seed=3, num_threads=1, options=options) as env:
        env.reset()
        rng = np.random.default_rng(1)
        for _ in range(3000):
            step = env.step(rng.integers(0, env.spec.num_actions, size=1))
            assert step.terminated[0] == bool(step.episode_returns)
            if step.episode_returns:
                return
    pytest.fail("no game ended in 3000 steps")


@dataclass
class SteppedRows:
    """Copies of the stepper's rows, ``(steps, n, ...)``, and the env's ends of lives and games."""

    observations: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    trainable: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    games_ended: np.ndarray

    def forced(self) -> np.ndarray:
        """``(steps, n)`` bool: the rows that follow a lost life whose game goes on (the env plays FIRE)."""
        forced = np.zeros_like(self.terminated)
        forced[1:] = self.terminated[:-1] & ~self.games_ended[:-1]
        return forced


def step_breakout(
    num_envs: int,
    steps: int,
    *,
    groups: int = 1,
    router_config: RoutingConfig | None = None,
    seed: int = 7,
) -> tuple[SteppedRows, torch.nn.Module]:
    env = (
        make_vector_env("ALE/Breakout-v5", num_envs, seed=seed, num_threads=1, options=OPTIONS)
        if groups == 1
        else make_env_groups(
            "ALE/Breakout-v5", num_envs, groups, seed=seed, num_threads=1, options=OPTIONS
        )
    )
    torch.manual_seed(0)
    model = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
    model.eval()
    router = (
        None if router_config is None else PolicyRouter(env.spec, num_envs, router_config, seed=0)
    )
    columns: dict[str, list[np.ndarray]] = {name: [] for name in SteppedRows.__dataclass_fields__}
    try:
        stepper = PolicyStepper(env, model, router=router)
        for _ in range(steps):
            row = stepper.step()
            b = row.buffers
            ended = np.zeros(num_envs, bool)
            ended[row.env_step.episode_env_ids] = True
            for name, value in (
                ("observations", b.observations),
                ("actions", b.actions),
                ("log_probs", b.log_probs),
                ("trainable", b.trainable),
                ("rewards", b.rewards),
                ("terminated", row.env_step.terminated),
                ("games_ended", ended),
            ):
                columns[name].append(np.array(value, copy=True))
    finally:
        env.close()
    return SteppedRows(**{name: np.stack(value) for name, value in columns.items()}), model


@torch.no_grad()
def policy_log_probs(
    model: torch.nn.Module, observations: np.ndarray, actions: np.ndarray
) -> np.ndarray:
    """log pi(action | observation) of each row, one forward pass per row."""
    return np.array(
        [
            model.policy_and_values(torch.from_numpy(obs[None]))[0]
            .log_prob(torch.tensor([int(action)]))
            .item()
            for obs, action in zip(observations, actions, strict=True)
        ]
    )


@pytest.mark.parametrize("groups", [1, 2])
def test_the_fire_after_a_lost_life_is_stored_as_the_action_taken_and_not_trained_on(
    groups: int,
) -> None:
    num_envs, steps = 2, 500
    rows, model = step_breakout(num_envs, steps, groups=groups)
    fire = 1  # Breakout's minimal action set: NOOP, FIRE, RIGHT, LEFT
    forced = rows.forced()
    assert forced.sum() >= 4, "the policy lost too few lives to check anything"
    # Forced rows: FIRE, not trained on, log pi(FIRE | s) of the acting policy.
    assert (rows.actions[forced] == fire).all()
    assert not rows.trainable[forced].any()
    np.testing.assert_allclose(
        rows.log_probs[forced],
        policy_log_probs(model, rows.observations[forced], rows.actions[forced]),
        atol=1e-4,
    )
    # Every other row is the policy's own sample, trainable, with its log pi.
    assert rows.trainable[~forced].all()
    assert (rows.actions[~forced] != fire).any() and (rows.actions[~forced] == fire).any()
    some = np.flatnonzero(~forced.reshape(-1))[:: max(1, (~forced).sum() // 40)]
    flat = rows.observations.reshape(-1, *rows.observations.shape[2:])
    np.testing.assert_allclose(
        rows.log_probs.reshape(-1)[some],
        policy_log_probs(model, flat[some], rows.actions.reshape(-1)[some]),
        atol=1e-4,
    )
    # The stored actions are the actions played: replayed on emulators that force nothing, they give the same game.
    references = [ReferenceBreakout(7 + row, fire_after_life_loss=False) for row in range(num_envs)]
    for t in range(steps):
        expected = [
            reference.step(int(action))
            for reference, action in zip(references, rows.actions[t], strict=True)
        ]
        np.testing.assert_array_equal(
            rows.rewards[t], [e[0] for e in expected], err_msg=f"step {t}"
        )
        assert rows.terminated[t].tolist() == [e[1] for e in expected], f"step {t}"


def test_random_first_steps_count_the_steps_of_a_game_not_of_a_life() -> None:
    first = 25
    rows, _ = step_breakout(2, 450, router_config=RoutingConfig(random_first_steps=first))
    game_steps = np.zeros_like(rows.actions)  # steps since the start of each row's game
    for t in range(1, len(game_steps)):
        game_steps[t] = np.where(rows.games_ended[t - 1], 0, game_steps[t - 1] + 1)
    forced = rows.forced()
    assert rows.games_ended.any() and (forced & (game_steps >= first)).sum() >= 4
    np.testing.assert_array_equal(rows.trainable, (game_steps >= first) & ~forced)


def test_the_vector_env_names_the_forced_rows_before_each_step() -> None:
    with make_vector_env("ALE/Breakout-v5", 2, seed=3, num_threads=1, options=OPTIONS) as env:
        assert env.forced_actions() is None  # before the first reset
        env.reset()
        rng = np.random.default_rng(1)
        served = 0
        for _ in range(600):
            forced = env.forced_actions()
            actions = rng.integers(0, env.spec.num_actions, size=2)
            env.step_async(actions)
            with pytest.raises(RuntimeError, match="in flight"):
                env.forced_actions()
            step = env.step_wait()
            lost = np.flatnonzero(step.terminated & ~np.isin(np.arange(2), step.episode_env_ids))
            after = env.forced_actions()
            if lost.size:
                rows, fire = after
                np.testing.assert_array_equal(rows, lost)
                assert fire.tolist() == [1] * lost.size and fire.dtype == env.spec.action_dtype
                served += 1
            else:
                assert after is None
            assert forced is None or forced[0].size >= 1
    assert served >= 3
    options = EnvOptions(atari_sticky_actions=0.0, atari_noop_max=0, atari_episodic_life=False)
    with make_vector_env("ALE/Breakout-v5", 1, seed=3, num_threads=1, options=options) as env:
        env.reset()
        for _ in range(300):
            env.step(np.array([0]))
            assert env.forced_actions() is None


class NeverFire:
    """A recording policy for Breakout that never presses FIRE (NOOP, RIGHT, LEFT in turn)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, observations: np.ndarray, action_mask: np.ndarray | None) -> np.ndarray:
        self.calls += 1
        return np.full(len(observations), (0, 2, 3)[self.calls % 3], np.int64)


def test_recorded_demonstrations_store_the_fire_after_a_lost_life(tmp_path) -> None:
    pytest.importorskip("minari")
    from minari import MinariDataset

    from oakemu_core.algo.recording import record_dataset

    record_dataset(
        "ALE/Breakout-v5",
        tmp_path / "demos",
        episodes=1,
        policy=NeverFire(),
        seed=7,
        options=OPTIONS,
    )
    (episode,) = list(MinariDataset(tmp_path / "demos" / "data").iterate_episodes())
    actions, terminations = np.asarray(episode.actions), np.asarray(episode.terminations)
    after_lost_life = np.flatnonzero(terminations[:-1]) + 1
    assert after_lost_life.size == 4  # Breakout's 5 lives, one game
    assert (actions[after_lost_life] == 1).all()
    assert (np.delete(actions, after_lost_life) != 1).all()
    reference = ReferenceBreakout(
        7, fire_after_life_loss=False
    )  # the stored actions are the actions played
    replayed = [reference.step(int(action)) for action in actions]
    np.testing.assert_array_equal(episode.rewards, [r[0] for r in replayed])
    assert terminations.tolist() == [r[1] for r in replayed]
