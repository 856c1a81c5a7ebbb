"""Atari life-loss episodes (``atari_episodic_life``; oakemu_core/envs/atari.py and vector.py) against a
reference written here on ale-py's plain ``ALEInterface``: SB3's ``EpisodicLifeEnv`` with FIRE after a lost
life. The learner sees ``terminated`` on every lost life and on game over, the game is not restarted on a
lost life, and the episode statistics are whole games (docs/decisions/atari-life-loss.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from oakemu_core.config import make_config
from oakemu_core.envs import make_vector_env
from oakemu_core.envs.options import EnvOptions
from oakemu_core.presets import load_preset

ale_py = pytest.importorskip("ale_py")

FRAME_SKIP = 4
# No sticky actions and no random no-ops, so the reference plays the very same frames as ale-py's vector env.
OPTIONS = EnvOptions(atari_sticky_actions=0.0, atari_noop_max=0, atari_episodic_life=True)


class ReferenceBreakout:
    """Breakout on one ``ALEInterface``: ale-py's vector-env reset (the game, then one FIRE frame), frame
    skip 4 summing rewards, and SB3's ``EpisodicLifeEnv``: ``terminated`` on game over or when the lives
    counter drops while lives remain, the game going on; after a lost life the next step plays FIRE
    (``FireResetEnv``). A game over restarts the game (same-step autoreset)."""

    def __init__(self, seed: int) -> None:
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
        self.fire_next = life_lost
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
    with make_vector_env("ALE/Breakout-v5", num_envs, seed=seed, num_threads=1, clip_rewards=False,
                         options=OPTIONS) as env:
        env.reset()
        for t in range(steps):
            actions = not_fire[rng.integers(0, 3, size=num_envs)]
            step = env.step(actions)
            expected = [reference.step(int(action)) for reference, action in zip(references, actions, strict=True)]
            where = f"step {t}"
            np.testing.assert_array_equal(step.training_rewards, [e[0] for e in expected], err_msg=where)
            assert step.terminated.tolist() == [e[1] for e in expected], where
            assert not step.truncated.any(), where
            ended = [(row, e[3]) for row, e in enumerate(expected) if e[3] is not None]
            assert step.episode_env_ids == [row for row, _ in ended], where
            assert step.episode_returns == [score for _, (score, _) in ended], where
            assert step.episode_lengths == [length for _, (_, length) in ended], where
            for row, (_, _, life_lost, _) in enumerate(expected):
                if life_lost:  # the game goes on: the next observation is the last one of the life, not a reset
                    np.testing.assert_array_equal(step.final_observations[row], step.observations[row])
                    life_losses += 1
            games += len(ended)
    assert games >= 2 and life_losses >= 4 * games  # Breakout has 5 lives: 4 lost with the game going on


def test_whole_game_returns_equal_the_sum_of_the_raw_rewards_of_its_lives() -> None:
    with make_vector_env("ALE/Breakout-v5", 1, seed=3, num_threads=1, clip_rewards=False, options=OPTIONS) as env:
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
