"""End to end through ``oakemu train`` / ``oakemu evaluate`` for the emulator backends (slow).

* Game Boy: the generated test ROM (tests/emulator_envs.py) rewards new presses of A (RAM 0xC000,
  reward spec), trained through ``gameboy:<ROM> --emulator-settings <TOML>``; PPO must beat a
  uniformly random policy's return by a wide margin within a small budget.
* stable-retro: ``retro:Airstriker-Genesis-v0`` with 1 actor x 1 env (one emulator per process):
  trains a few thousand steps, episodes reach the learner with raw (unclipped) scores, and
  ``oakemu evaluate`` plays the checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e_helpers import (
    E2EProcesses,
    common_flags,
    e2e_fixture,  # noqa: F401 - the `e2e` fixture
    new_ports,
    only_run_dir,
    read_jsonl,
)

pytestmark = pytest.mark.slow
EVALUATE_LINE = re.compile(r"episodes\s+(\d+)\s+mean\s+(-?\d+\.\d+)\s+std\s+(\d+\.\d+)")

GAMEBOY_EPISODE_STEPS = 32
RANDOM_RETURN = GAMEBOY_EPISODE_STEPS / 9  # 1 of 9 actions (no-op + 8 buttons) is A
LAST_EPISODES = 20


def _learner_log(run_dir: Path, lines: int = 30) -> str:
    path = run_dir / "logs" / "learner.log"
    if not path.exists():
        return ""
    return "\n--- learner.log tail:\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-lines:]
    )


def test_gameboy_ppo_learns_the_rewarded_button(e2e: E2EProcesses, tmp_path: Path) -> None:
    """``oakemu train --env gameboy:<ROM> --emulator-settings <TOML>`` (the user-facing form) on the test ROM:
    a safe run-folder name, whole episodes, and PPO learns to press A."""
    pytest.importorskip("pyboy", reason="PyBoy is not installed")
    from tests.emulator_envs import test_files

    rom, settings = test_files()
    runs_dir = tmp_path / "runs"
    budget = 12_288  # seed 1 reaches the maximum (32) by about 8k steps; with the learning rate 0 it stays near 3.6
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            f"gameboy:{rom}",
            "--emulator-settings",
            str(settings),
            "--seed",
            "1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "8",
            "--rollout-length",
            "64",
            "--total-env-steps",
            str(budget),
            "--learning-rate",
            "1e-3",
            "--checkpoint-every-updates",
            "0",
            *common_flags(new_ports(), runs_dir),
        ],
    )
    status = train.wait(timeout_s=480)
    run_dir = only_run_dir(runs_dir)
    assert status == 0, train.describe() + _learner_log(run_dir)
    assert run_dir.name.startswith(
        f"gameboy-{rom.name}__1__"
    )  # a safe folder name, not the ROM path
    e2e.assert_all_exited(timeout_s=5)
    assert e2e.leftover_segments() == []
    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert len(episodes) >= 2 * LAST_EPISODES
    assert all(e["episodic_length"] == GAMEBOY_EPISODE_STEPS for e in episodes)
    returns = [float(e["episodic_return"]) for e in episodes]
    assert all(value == int(value) and 0 <= value <= GAMEBOY_EPISODE_STEPS for value in returns)
    first = sum(returns[:LAST_EPISODES]) / LAST_EPISODES
    last = sum(returns[-LAST_EPISODES:]) / LAST_EPISODES
    assert last >= 3 * RANDOM_RETURN, (
        f"mean of the last {LAST_EPISODES} returns {last:.1f} (first {first:.1f}), random ~{RANDOM_RETURN:.1f}"
    )


def test_airstriker_trains_logs_raw_scores_and_evaluates(e2e: E2EProcesses, tmp_path: Path) -> None:
    pytest.importorskip("stable_retro", reason="stable-retro is not installed")
    runs_dir = tmp_path / "runs"
    ports = new_ports()
    budget = 1280  # four or more episodes of at most 300 steps
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "retro:Airstriker-Genesis-v0",
            "--seed",
            "1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "1",
            "--rollout-length",
            "128",
            "--max-episode-steps",
            "300",
            "--total-env-steps",
            str(budget),
            "--checkpoint-every-updates",
            "0",
            *common_flags(ports, runs_dir),
        ],
    )
    status = train.wait(timeout_s=420)
    run_dir = only_run_dir(runs_dir)
    assert status == 0, train.describe() + _learner_log(run_dir)
    e2e.assert_all_exited(timeout_s=5)
    assert e2e.leftover_segments() == []
    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert episodes, "no Airstriker episode reached the learner"
    returns = [float(e["episodic_return"]) for e in episodes]
    # Airstriker scores in steps of 10 per enemy; a clipped return would be at most 1 per step's kills.
    assert max(returns) >= 10.0, f"expected raw game scores, received {returns}"
    assert (run_dir / "checkpoints" / "latest.pt").is_file()

    evaluate = e2e.start(
        "evaluate",
        [
            "evaluate",
            str(run_dir / "checkpoints" / "latest.pt"),
            "--episodes",
            "1",
            "--sampled",
        ],
    )
    assert evaluate.wait(timeout_s=180) == 0, evaluate.describe()
    match = EVALUATE_LINE.search(evaluate.stdout())
    assert match, evaluate.describe()
    assert float(match.group(2)) >= 0.0
