"""benchmarks/bench_console_vs_sb3.py: the settings both sides get, the SB3 env slot, the report's arithmetic on
hand-made records, the rotation of system order, and a smoke run of the OakEmu and random sides (no SB3 here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

from tests.benchmarks.script_helpers import BENCHMARKS, REPO_ROOT, load_script, train_config

SCRIPT = BENCHMARKS / "bench_console_vs_sb3.py"
bench = load_script("bench_console_vs_sb3")


@pytest.mark.parametrize("name", sorted(bench.GAMES))
def test_sb3_gets_the_hyperparameters_oakemu_trains_with(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The SB3 spec and the `oakemu train` flags of one run describe the same PPO (SB3's vf_coef is
    half OakEmu's: its value loss is the MSE, OakEmu's 0.5 x MSE)."""
    pytest.importorskip("pyboy" if name == "gameboy" else "stable_retro")
    game = bench.GAMES[name]
    env_id, settings_file = bench.game_files(game, tmp_path / "rom")
    command = bench.oakemu_command(
        env_id=env_id,
        settings_file=settings_file,
        seed=3,
        steps=4096,
        runs_dir=tmp_path,
        run_name="r",
        torch_threads=1,
        extra=[],
    )
    config = train_config(command[4:], monkeypatch)
    spec = bench.sb3_spec(
        env_id=env_id,
        settings_file=settings_file,
        subprocesses=game.subprocesses,
        seed=3,
        steps=4096,
        torch_threads=1,
    )
    ppo = spec["ppo"]
    assert (config.env_id, config.emulator_settings) == (spec["env_id"], spec["settings_file"])
    assert (config.seed, config.total_env_steps) == (spec["seed"], spec["steps"]) == (3, 4096)
    assert config.num_actors * config.envs_per_actor == spec["n_envs"] == 4
    assert config.rollout_length == ppo["n_steps"] == 128
    assert config.rollout_length * spec["n_envs"] // config.num_minibatches == ppo["batch_size"]
    assert config.ppo_epochs == ppo["n_epochs"]
    assert config.learning_rate == ppo["learning_rate"] and config.anneal_lr
    assert spec["schedule"] == "lin"
    assert config.clip_coef == ppo["clip_range"] == 0.1
    assert config.resolved_clip_value_range is None and ppo["clip_range_vf"] is None
    assert config.ent_coef == ppo["ent_coef"] and config.vf_coef == 2 * ppo["vf_coef"]
    assert config.max_grad_norm == ppo["max_grad_norm"]
    assert (config.gamma, config.gae_lambda) == (ppo["gamma"], ppo["gae_lambda"])
    assert config.normalize_advantages == ppo["normalize_advantage"]
    assert config.target_kl is None and ppo["target_kl"] is None
    assert config.resolved_clip_rewards and spec["clip_rewards"]
    assert config.mode == "async" and config.eval_every_updates == 25  # the preset's, untouched
    assert spec["vec_env"] == ("subproc" if name == "airstriker" else "dummy")
    assert config.learner_threads == spec["torch_threads"] == 1


def test_torch_threads_0_leaves_each_side_its_default(tmp_path: Path) -> None:
    common = {"seed": 1, "steps": 512, "runs_dir": tmp_path, "run_name": "r", "extra": []}
    command = bench.oakemu_command(
        env_id="retro:Airstriker-Genesis-v0", settings_file=None, torch_threads=0, **common
    )
    assert "--learner-threads" not in command and "--env" not in command  # the preset's own env
    with_one = bench.oakemu_command(
        env_id="retro:Airstriker-Genesis-v0", settings_file=None, torch_threads=1, **common
    )
    assert with_one[with_one.index("--learner-threads") + 1] == "1"


class _Recorder(gymnasium.Wrapper):
    """A stand-in for SB3's Monitor: the rewards it sees."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self.rewards: list[float] = []

    def step(self, action: Any) -> Any:
        result = self.env.step(action)
        self.rewards.append(float(result[1]))
        return result


def test_an_sb3_env_slot_is_the_project_env_with_raw_rewards_under_the_clipping(
    tmp_path: Path,
) -> None:
    pytest.importorskip("pyboy")
    settings = tmp_path / "emulator.toml"
    settings.write_text(
        bench.GAMEBOY_SETTINGS.replace("address = 0xC000", "address = 0xC000\nweight = 5.0")
    )
    rom = bench.game_files(bench.GAMES["gameboy"], tmp_path / "rom")[0]
    env = bench.project_env(rom, str(settings), 0, True, monitor=_Recorder)
    try:
        observation, _ = env.reset(seed=0)
        assert observation.shape == (4, 72, 80) and observation.dtype == np.uint8
        rewards = [env.step(1)[1] for _ in range(3)]  # action 1: press A (0 is the no-op)
        assert rewards == [1.0, 1.0, 1.0]  # clipped for training
        assert env.env.rewards == [5.0, 5.0, 5.0]  # the raw score, what the Monitor logs
        for _ in range(29):
            *_, truncated, _ = env.step(0)
        assert truncated  # the settings' 32-step time limit
    finally:
        env.close()


def _record(system: str, seed: int, curve: list[float], **fields: Any) -> dict:
    return {
        "system": system,
        "game": "airstriker",
        "seed": seed,
        "steps": 1000,
        "curve": curve + [math.nan] * (bench.WINDOWS - len(curve)),
        "load_1min": [1.0, 3.0, 2.0],
        **fields,
    }


RECORDS = [
    _record("sb3", 1, [10.0, 20.0], last100=100.0, wall_s=200.0, sps=5.0),
    _record("sb3", 2, [30.0, 40.0], last100=300.0, wall_s=400.0, sps=2.5),
    _record(
        "oakemu",
        1,
        [30.0, 20.0],
        last100=200.0,
        wall_s=100.0,
        sps=10.0,
        evaluations=[[0, 50.0, 1.0], [500, 300.0, 2.0], [1000, 200.0, 3.0]],
    ),
    _record(
        "oakemu",
        2,
        [30.0, 50.0],
        last100=400.0,
        wall_s=200.0,
        sps=5.0,
        evaluations=[[0, 60.0, 1.0], [1000, 400.0, 3.0]],
    ),
    _record("oakemu-x", 1, [1.0, 2.0], last100=7.0, wall_s=10.0, sps=100.0),
    {
        "system": "random",
        "game": "airstriker",
        "seed": 1001,
        "episodes": 100,
        "mean": 77.0,
        "std": 37.5,
        "wall_s": 120.0,
        "load_1min": [1.0, 2.0, 1.5],
    },
]


def _row(table: str, game: str, system: str) -> list[str]:
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[:2] == [game, system]:
            return cells
    raise AssertionError(f"no row {game} {system} in\n{table}")


def test_report_gives_means_over_seeds_and_ratios_to_sb3_at_the_same_seeds() -> None:
    table = bench.report(RECORDS)
    oakemu = _row(table, "airstriker", "oakemu")
    windows = oakemu[4 : 4 + bench.WINDOWS]
    assert windows[:2] == ["30.0", "35.0"] and windows[2] == "nan"
    rest = oakemu[4 + bench.WINDOWS :]
    last100, evaluation, wall, sps, ratio_last, at_least, ratio_wall, load = rest
    assert (last100, wall, sps) == ("300.0", "150", "8")
    assert evaluation == "300.0 / 350.0"  # last: mean of 200 and 400; best: mean of 300 and 400
    assert ratio_last == "1.50"  # 300 / mean(100, 300)
    assert at_least == f"2/{bench.WINDOWS}"  # 30 >= 20, 35 >= 30; a nan window never counts
    assert ratio_wall == "0.50"  # 150 / 300
    assert load == "1.0-3.0-2.0; 1.0-3.0-2.0"
    sb3 = _row(table, "airstriker", "sb3")
    assert sb3[4 + bench.WINDOWS :][1] == "-" and sb3[-2] == "-"  # no eval, no ratio to itself
    random = _row(table, "airstriker", "random")
    assert random[3] == "1001" and random[4 + bench.WINDOWS] == "77.0 +- 37.5 (100 episodes)"


def test_a_ratio_needs_the_reference_at_the_same_seeds() -> None:
    seed_1 = _row(bench.report(RECORDS), "airstriker", "oakemu-x")  # against sb3's seed 1 only
    assert seed_1[-4:-1] == ["0.07", f"0/{bench.WINDOWS}", "0.05"]  # 7 / 100, 10 / 200
    seed_3 = [{**r, "seed": 3} if r["system"] == "oakemu-x" else r for r in RECORDS]
    assert _row(bench.report(seed_3), "airstriker", "oakemu-x")[-4:-1] == ["-", "-", "-"]
    sb3_seed_1 = [r for r in RECORDS if not (r["system"] == "sb3" and r["seed"] == 2)]
    assert _row(bench.report(sb3_seed_1), "airstriker", "oakemu")[-4:-1] == ["-", "-", "-"]
    alone = bench.report([r for r in RECORDS if r["system"] != "sb3"])
    assert _row(alone, "airstriker", "oakemu")[-4:-1] == ["-", "-", "-"]


def test_each_seed_starts_with_the_next_system(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, int]] = []
    args = types.SimpleNamespace(
        seeds=[1, 2, 3, 4], systems=["sb3", "oakemu", "random"], runs_dir=tmp_path
    )
    monkeypatch.setattr(
        bench, "run_one", lambda _args, system, seed, _runs: calls.append((system, seed))
    )
    bench.run_series(args)
    assert [system for system, _ in calls] == [
        *("sb3", "oakemu", "random"),
        *("oakemu", "random", "sb3"),
        *("random", "sb3", "oakemu"),
        *("sb3", "oakemu", "random"),
    ]


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO_ROOT,
    )


def test_report_of_an_empty_folder_and_the_sb3_label_are_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    empty = _script("--report", "--out", str(tmp_path))
    assert (
        empty.returncode == 2 and empty.stderr.strip() == f"--report: no records under {tmp_path}"
    )
    label = _script("--label", "sb3", "--out", str(tmp_path))
    assert label.returncode == 2 and len(label.stderr.strip().splitlines()) == 1
    assert "'sb3' names the sb3 runs" in label.stderr


@pytest.mark.slow
def test_quick_run_of_oakemu_and_random_play_writes_their_records(tmp_path: Path) -> None:
    """``--quick`` on the Game Boy ROM: oakemu train at the preset for 1,024 env steps and 3 random
    episodes, each recorded; ``--report`` prints both."""
    pytest.importorskip("pyboy")
    out, runs = tmp_path / "out", tmp_path / "runs"
    result = _script(
        "--game", "gameboy", "--systems", "oakemu", "random", "--quick",
        "--out", str(out), "--runs-dir", str(runs),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((out / "gameboy" / "oakemu-seed1-1024.json").read_text())
    assert record["system"] == "oakemu" and record["steps"] == 1024
    assert record["env_steps"] >= 1024 and record["games"] >= 20  # 32-step episodes, 4 envs
    assert all(0 <= value <= 32 for value in record["curve"] if not math.isnan(value))
    assert record["evaluations"] and record["wall_s"] > 0 and len(record["load_1min"]) == 3
    assert "--preset" in record["settings"]["oakemu_train"]
    random = json.loads((out / "gameboy" / "random-seed1-3ep.json").read_text())
    assert random["episodes"] == 3 and len(random["returns"]) == 3 and random["seed"] == 1001
    assert all(0 <= value <= 32 for value in random["returns"])
    table = _script("--report", "--out", str(out))
    assert table.returncode == 0
    assert "| gameboy | oakemu | 1,024 |" in table.stdout and "| gameboy | random |" in table.stdout
