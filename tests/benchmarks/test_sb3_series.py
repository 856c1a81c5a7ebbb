"""benchmarks/sb3_series.py: the order of a series, the skip of a kept record, the two child processes
(an SB3 worker, ``oakemu train``; both faked here by small Python commands), the reading of a run
folder, a record's fields and their order, and the JSON files of the records."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.benchmarks.script_helpers import REPO_ROOT, load_script

series = load_script("sb3_series")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_each_seed_starts_with_the_next_system() -> None:
    pairs = list(series.series([7, 8, 9, 10], ["a", "b", "c"]))
    assert [seed for seed, _ in pairs] == [7] * 3 + [8] * 3 + [9] * 3 + [10] * 3
    assert "".join(system for _, system in pairs) == "abc" + "bca" + "cab" + "abc"
    assert list(series.series([1, 2], ["only"])) == [(1, "only"), (2, "only")]


def test_a_record_is_kept_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "sb3-seed1.json"
    assert not series.kept(path, False, "sb3 seed 1")  # no record yet: run it
    assert capsys.readouterr().out == ""
    path.write_text("{}")
    assert series.kept(path, False, "sb3 seed 1")
    assert (
        capsys.readouterr().out
        == f"-- sb3 seed 1: {path} exists, skipped (--force runs it again)\n"
    )
    assert not series.kept(path, True, "sb3 seed 1")


def test_an_sb3_worker_gives_its_last_stdout_line_and_the_wall_time(tmp_path: Path) -> None:
    command = _python(
        """
        import json, os, sys
        print("progress", file=sys.stderr)
        print("not the result")
        print(json.dumps({"env_steps": 64, "path": os.environ["PYTHONPATH"].split(os.pathsep)[0]}))
        """
    )
    log = tmp_path / "sb3.log"
    result = series.run_sb3_worker(command, log_path=log, timeout_s=60)
    assert list(result) == ["env_steps", "path", "wall_s"]
    assert result["env_steps"] == 64 and result["path"] == str(REPO_ROOT)
    assert 0 < result["wall_s"] < 60
    assert log.read_text() == "progress\n"


def test_a_failed_sb3_worker_names_its_log(tmp_path: Path) -> None:
    log = tmp_path / "sb3.log"
    with pytest.raises(RuntimeError, match=re.escape(f"SB3 worker exited 3; see {log}")):
        series.run_sb3_worker(_python("raise SystemExit(3)"), log_path=log, timeout_s=60)


def test_the_worker_command_runs_the_script_with_its_spec() -> None:
    command = series.sb3_worker_command("/venv/bin/python", "benchmarks/x.py", {"seed": 3})
    assert command == [
        "/venv/bin/python",
        str(Path("benchmarks/x.py").resolve()),
        "--sb3-worker",
        '{"seed": 3}',
    ]


def test_the_preset_command_keeps_its_flags_in_order(tmp_path: Path) -> None:
    command = series.preset_command(
        "atari",
        steps=5000,
        seed=3,
        runs_dir=tmp_path,
        run_name="r",
        leading=["--env", "ALE/Pong-v5"],
        trailing=["--device", "cpu"],
        extra=["--mode", "sync"],
    )
    assert command == [
        sys.executable, "-m", "oakemu_services.cli", "train", "--preset", "atari",
        "--env", "ALE/Pong-v5", "--total-env-steps", "5000", "--seed", "3", "--device", "cpu",
        "--runs-dir", str(tmp_path), "--run-name", "r", "--mode", "sync",
    ]  # fmt: skip


METRICS = [
    {"global_step": 256, "charts/SPS": 100.0, "charts/policy_lag_mean": 1.0},
    {"global_step": 512, "charts/SPS": 120.0, "charts/policy_lag_mean": 0.0},
    {"global_step": 512, "eval/episodic_return": 9.0},  # an evaluation's record: no SPS
]
EPISODES = [
    {"global_step": 512, "episodic_return": 3.0},
    {"global_step": 128, "episodic_return": 1.0},
    {"global_step": 300, "episodic_return": 2.5},
]


def test_a_run_folder_gives_steps_sps_policy_lag_and_the_episodes_by_step(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "metrics.jsonl", METRICS)
    _write_jsonl(tmp_path / "episodes.jsonl", EPISODES)
    result = series.run_result(tmp_path, 10.0)
    assert result == {
        "wall_s": 10.0,
        "env_steps": 512,
        "sps_logged": 120.0,  # the last SPS logged, not the evaluation record's absent one
        "policy_lag_mean": 0.5,
        "episodes": [(128, 1.0), (300, 2.5), (512, 3.0)],
    }
    empty = series.run_result(tmp_path / "nothing", 1.0)
    assert (empty["env_steps"], empty["sps_logged"], empty["episodes"]) == (0, None, [])
    assert math.isnan(empty["policy_lag_mean"])


def test_oakemu_train_runs_with_its_log_and_its_run_folder_is_read(tmp_path: Path) -> None:
    runs, name = tmp_path / "runs", "oakemu-s1"
    runs.mkdir()
    command = _python(
        f"""
        import json, pathlib, sys
        run = pathlib.Path({str(runs / name)!r})
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({METRICS[0]!r}) + "\\n")
        (run / "episodes.jsonl").write_text(json.dumps({EPISODES[0]!r}) + "\\n")
        print("trained")
        print("warned", file=sys.stderr)
        """
    )
    result = series.train_oakemu_run(command, runs_dir=runs, run_name=name, timeout_s=60)
    assert (result["env_steps"], result["sps_logged"], result["episodes"]) == (
        256,
        100.0,
        [(512, 3.0)],
    )
    assert 0 < result["wall_s"] < 60
    assert (runs / f"{name}.log").read_text().split() == ["trained", "warned"]
    with pytest.raises(SystemExit, match="already holds a run"):  # it would be resumed
        series.train_oakemu_run(command, runs_dir=runs, run_name=name, timeout_s=60)
    with pytest.raises(
        RuntimeError, match=re.escape(f"oakemu train exited 2; see {runs / 'other'}/logs")
    ):
        series.train_oakemu_run(
            _python("raise SystemExit(2)"), runs_dir=runs, run_name="other", timeout_s=60
        )


def test_a_record_has_the_measures_then_the_run_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(series, "commit", lambda: "abc1234")
    episodes = [(50, 1.0), (120, 3.0)] + [(1000, float(k)) for k in range(101)]
    result = {
        "wall_s": 4.0,
        "env_steps": 1000,
        "sps_logged": 9.0,
        "episodes": episodes,
        "settings": {},
    }
    record = series.training_record(
        result, identity={"system": "sb3", "game": "pong", "seed": 2}, steps=1000, load=[1.5, 2.5]
    )
    assert list(record) == [
        "system", "game", "seed", "steps", "commit", "cpus", "games", "curve", "last100", "sps",
        "load_1min", "wall_s", "env_steps", "sps_logged", "settings",
    ]  # fmt: skip
    assert (record["steps"], record["commit"], record["cpus"]) == (1000, "abc1234", os.cpu_count())
    assert record["games"] == 103 and record["sps"] == 250.0 and record["load_1min"] == [1.5, 2.5]
    assert record["curve"][:2] == [1.0, 3.0] and record["curve"][-1] == 50.0  # mean of 0..100
    assert all(math.isnan(value) for value in record["curve"][2:-1])  # no episode ended there
    assert record["last100"] == 50.5  # the last 100: 1..100
    assert "episodes" not in result  # taken out of the run's results


def test_records_are_written_and_loaded_per_game_in_path_order(tmp_path: Path) -> None:
    series.write_record(tmp_path / "pong" / "sb3-seed2.json", {"system": "sb3", "seed": 2})
    series.write_record(tmp_path / "breakout" / "x-seed1.json", {"system": "x", "seed": 1})
    (tmp_path / "stray.json").write_text("{}")  # not in a game's folder: not a record
    text = (tmp_path / "pong" / "sb3-seed2.json").read_text()
    assert text == '{\n "system": "sb3",\n "seed": 2\n}\n'
    assert series.load_records(tmp_path) == [
        {"system": "x", "seed": 1},
        {"system": "sb3", "seed": 2},
    ]


def test_learn_logged_keeps_every_monitored_episode() -> None:
    """A short SB3 PPO run on CartPole (skips without stable-baselines3)."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    model = PPO(
        "MlpPolicy", make_vec_env("CartPole-v1", n_envs=2, seed=0), n_steps=64, batch_size=64
    )
    rollouts: list[int] = []
    result = series.learn_logged(
        model, 256, on_rollout_end=lambda log: rollouts.append(len(log.episodes))
    )
    assert result["env_steps"] == 256 and len(rollouts) == 2
    steps = [step for step, _ in result["episodes"]]
    assert len(steps) >= 256 // 500 + 1 and steps == sorted(steps) and steps[-1] <= 256
    assert all(ret >= 1.0 for _, ret in result["episodes"])  # CartPole: +1 per step
    assert rollouts == sorted(rollouts) and rollouts[-1] == len(result["episodes"])


class _Killed(Exception):
    """Stands for the kill of a run's process after a checkpoint."""


def test_a_killed_learn_logged_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A run killed after its second saved rollout (one update done) goes on from the saved weights,
    optimizer state, step count and episodes; the second segment trains only the rest of the budget
    (skips without SB3)."""
    pytest.importorskip("stable_baselines3")
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    folder = tmp_path / "ckpt"

    def model() -> PPO:
        venv = make_vec_env("CartPole-v1", n_envs=2, seed=0)
        return PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0)

    def optimizer_moment(ppo: PPO) -> torch.Tensor:
        return ppo.policy.optimizer.state_dict()["state"][0]["exp_avg"].clone()

    saved: dict = {}

    def kill_at_256_steps(log) -> None:
        if log.model.num_timesteps == 256:
            saved["episodes"] = list(log.episodes)
            saved["weights"] = {k: v.clone() for k, v in log.model.policy.state_dict().items()}
            saved["moment"] = optimizer_moment(log.model)
            raise _Killed

    with pytest.raises(_Killed):
        series.learn_logged(
            model(),
            512,
            on_rollout_end=kill_at_256_steps,
            checkpoint=folder,
            checkpoint_every_s=0.0,
        )
    progress = json.loads((folder / "progress.json").read_text())
    assert progress["env_steps"] == 256 and progress["segments"] == 1
    assert progress["episodes"] == [list(e) for e in saved["episodes"]]
    assert [p.name for p in folder.glob("*.zip")] == ["model-256.zip"]

    restored = model()
    assert series._load_checkpoint(restored, folder)["env_steps"] == 256
    assert restored.num_timesteps == 256
    for key, value in restored.policy.state_dict().items():
        torch.testing.assert_close(value, saved["weights"][key])
    torch.testing.assert_close(optimizer_moment(restored), saved["moment"])

    steps_at_rollout_end: list[int] = []
    result = series.learn_logged(
        model(),
        512,
        on_rollout_end=lambda log: steps_at_rollout_end.append(int(log.model.num_timesteps)),
        checkpoint=folder,
    )
    assert steps_at_rollout_end == [384, 512]  # 256 restored, then two rollouts of 2 x 64
    assert result["env_steps"] == 512 and result["segments"] == 2
    assert result["resumed_wall_s"] > 0.0
    assert result["episodes"][: len(saved["episodes"])] == saved["episodes"]
    assert len(result["episodes"]) > len(saved["episodes"])
