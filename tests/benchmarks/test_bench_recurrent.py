"""benchmarks/bench_recurrent_vs_sb3.py: the report's arithmetic on hand-made run records, and the
settings both sides get (rl-baselines3-zoo's ppo_lstm.yml for CartPoleNoVel-v1). No training here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.script_helpers import BENCHMARKS, load_script, train_config

SCRIPT = BENCHMARKS / "bench_recurrent_vs_sb3.py"
bench = load_script("bench_recurrent_vs_sb3")


def _record(system: str, seed: int, curve: list[float], *, last100: float, sps: float) -> dict:
    return {
        "system": system,
        "seed": seed,
        "steps": 1000,
        "curve": curve,
        "last100": last100,
        "sps": sps,
        "wall_s": 1000 / sps,
        "load_1min": [1.0, 3.0],
    }


def _write(folder: Path, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for record in records:
        path = bench.result_path(folder, record["system"], record["seed"])
        path.write_text(json.dumps(record))


RECORDS = [
    _record("sb3-recurrent", 1, [10.0, 100.0, 200.0], last100=200.0, sps=400.0),
    _record("sb3-recurrent", 2, [30.0, math.nan, 400.0], last100=300.0, sps=600.0),
    _record("oakemu-recurrent", 1, [20.0, 50.0, 300.0], last100=150.0, sps=900.0),
    _record("oakemu-recurrent", 2, [20.0, 70.0, 100.0], last100=250.0, sps=1100.0),
    _record("oakemu-ff", 1, [20.0, 30.0, 40.0], last100=45.0, sps=1500.0),
]


def test_means_over_seeds_leave_out_windows_where_no_episode_ended() -> None:
    table = bench.summarize_systems(RECORDS)
    sb3 = table[("sb3-recurrent", 1000)]
    assert sb3["seeds"] == [1, 2]
    assert sb3["curve"] == [20.0, 100.0, 300.0]  # window 2: seed 2 had no episode end there
    assert (sb3["last100"], sb3["sps"], sb3["load"]) == (250.0, 500.0, [1.0, 3.0])
    oak = table[("oakemu-recurrent", 1000)]
    assert oak["curve"] == [20.0, 60.0, 200.0] and (oak["last100"], oak["sps"]) == (200.0, 1000.0)


def test_ratios_are_oakemu_over_sb3_per_window_last100_and_sps() -> None:
    ratios = bench.ratios(bench.summarize_systems(RECORDS))
    assert set(ratios) == {("oakemu-recurrent", 1000), ("oakemu-ff", 1000)}
    recurrent = ratios[("oakemu-recurrent", 1000)]
    assert recurrent["curve"] == pytest.approx([1.0, 0.6, 200 / 300])
    assert recurrent["last100"] == pytest.approx(0.8) and recurrent["sps"] == pytest.approx(2.0)
    assert ratios[("oakemu-ff", 1000)]["sps"] == pytest.approx(3.0)


def test_a_ratio_needs_the_reference_at_the_same_budget() -> None:
    other = {**RECORDS[2], "steps": 2000}
    assert bench.ratios(bench.summarize_systems([RECORDS[0], other])) == {}
    zero = _record("sb3-recurrent", 1, [0.0, math.nan, 1.0], last100=0.0, sps=1.0)
    ratio = bench.ratios(bench.summarize_systems([zero, RECORDS[2]]))[("oakemu-recurrent", 1000)]
    assert ratio["curve"][:2] == [None, None] and ratio["last100"] is None


def test_report_prints_the_markdown_tables_from_a_folder(tmp_path: Path) -> None:
    _write(tmp_path, RECORDS)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sb3 = next(line for line in lines if line.startswith("| sb3-recurrent |"))
    assert (
        sb3
        == "| sb3-recurrent | 1,000 | 1,2 | 20.0 | 100.0 | 300.0 | 250.0 | 500 | 2 | 1.0 / 3.0 |"
    )
    ratio = next(line for line in lines if line.startswith("| oakemu-recurrent | 1,000 | 1.00"))
    assert ratio == "| oakemu-recurrent | 1,000 | 1.00 | 0.60 | 0.67 | 0.80 | 2.00 |"


def test_report_refuses_a_file_that_is_not_a_run_record(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"system": "sb3-recurrent"}))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "not a run record" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_sb3_command_line_carries_the_zoo_settings() -> None:
    """rl-baselines3-zoo hyperparams/ppo_lstm.yml, CartPoleNoVel-v1 (clip range constant: see the
    module docstring)."""
    command = bench.sb3_command(
        "/venv/bin/python", bench.sb3_spec(seed=3, steps=5000, torch_threads=1)
    )
    assert command[:3] == ["/venv/bin/python", str(SCRIPT), "--sb3-worker"]
    spec = json.loads(command[3])
    assert spec["env_id"] == "oakemu_core.envs.memory:CartPoleNoVel-v1"
    assert (spec["policy"], spec["steps"], spec["learning_rate_schedule"]) == (
        "MlpLstmPolicy",
        5000,
        "linear",
    )
    vec_env = spec["vec_env"]
    assert vec_env["n_envs"] == 8 and vec_env["vec_env_cls"] == "DummyVecEnv"
    assert vec_env["VecNormalize"]["norm_obs"] and vec_env["VecNormalize"]["norm_reward"]
    assert vec_env["VecNormalize"]["gamma"] == 0.98
    kwargs = spec["kwargs"]
    expected = {
        "n_steps": 32,
        "batch_size": 256,
        "n_epochs": 20,
        "gamma": 0.98,
        "gae_lambda": 0.8,
        "ent_coef": 0.0,
        "learning_rate": 1e-3,
        "clip_range": 0.2,
        "vf_coef": 0.5,
        "max_grad_norm": 0.5,
        "seed": 3,
    }
    assert {key: kwargs[key] for key in expected} == expected
    assert kwargs["policy_kwargs"] == {
        "ortho_init": False,
        "activation_fn": "relu",
        "lstm_hidden_size": 64,
        "enable_critic_lstm": True,
        "net_arch": {"pi": [64], "vf": [64]},
    }


def test_oakemu_flags_carry_the_same_settings(tmp_path: Path) -> None:
    def flags(system: str, mode: str = "async") -> list[str]:
        return bench.oakemu_system_args(
            system,
            mode=mode,
            seed=3,
            steps=5000,
            runs_dir=tmp_path,
            run_name="r",
            ports=[1, 2, 3, 4, 5],
            torch_threads=1,
            num_actors=1,
        )

    def value(args: list[str], flag: str) -> str:
        return args[args.index(flag) + 1]

    recurrent, ff = flags("oakemu-recurrent"), flags("oakemu-ff", "sync")
    for args in (recurrent, ff):
        assert value(args, "--env") == "oakemu_core.envs.memory:CartPoleNoVel-v1"
        assert "--anneal-lr" in args and "--no-anneal-lr" not in args
        assert {"--normalize-observations", "--normalize-rewards"} <= set(args)
        for flag, expected in {
            "--rollout-length": "32",
            "--ppo-epochs": "20",
            "--num-minibatches": "1",
            "--learning-rate": "0.001",
            "--gamma": "0.98",
            "--gae-lambda": "0.8",
            "--clip-coef": "0.2",
            "--vf-coef": "1.0",  # 2 x SB3's 0.5: OakEmu's value loss is 0.5 * MSE
            "--total-env-steps": "5000",
        }.items():
            assert value(args, flag) == expected, flag
        assert int(value(args, "--num-actors")) * int(value(args, "--envs-per-actor")) == 8
    assert (value(recurrent, "--recurrent"), value(recurrent, "--recurrent-hidden")) == (
        "lstm",
        "64",
    )
    assert value(recurrent, "--sequence-length") == "32" and value(recurrent, "--mode") == "async"
    assert (value(recurrent, "--net-arch"), value(recurrent, "--activation")) == (
        "pi=64 vf=64",
        "relu",
    )
    assert (
        "--recurrent" not in ff and "--sequence-length" not in ff and value(ff, "--mode") == "sync"
    )
    assert bench.system_label("oakemu-ff", "sync") == "oakemu-ff-sync"
    assert bench.system_label("sb3-recurrent", "sync") == "sb3-recurrent"
    with pytest.raises(ValueError, match="system"):
        flags("sb3-recurrent")


def test_the_zoo_kwargs_build_recurrent_ppo() -> None:
    """RecurrentPPO accepts the worker's keyword arguments (skips without sb3-contrib)."""
    pytest.importorskip("sb3_contrib")
    import gymnasium
    import torch
    from sb3_contrib import RecurrentPPO

    import oakemu_core.envs.memory  # noqa: F401  (registers CartPoleNoVel-v1)

    spec = bench.sb3_spec(seed=1, steps=256, torch_threads=1)
    kwargs = dict(spec["kwargs"])
    policy_kwargs = {**kwargs.pop("policy_kwargs"), "activation_fn": torch.nn.ReLU}
    model = RecurrentPPO(
        "MlpLstmPolicy", gymnasium.make(spec["env_id"]), policy_kwargs=policy_kwargs, **kwargs
    )
    assert model.policy.lstm_actor.hidden_size == 64 and model.policy.lstm_critic is not None
    assert (model.n_steps, model.n_epochs, model.gamma, model.gae_lambda) == (32, 20, 0.98, 0.8)


@pytest.mark.parametrize("system", ["oakemu-ff", "oakemu-recurrent"])
def test_oakemu_flags_parse_to_the_zoo_config(
    system: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`oakemu train` reads the flags as the zoo's settings (skips the recurrent system where this
    checkout's `oakemu train` has no --recurrent)."""
    from oakemu_core.config import OakEmuConfig

    if system == "oakemu-recurrent" and "recurrent" not in OakEmuConfig.model_fields:
        pytest.skip("this checkout's oakemu train has no --recurrent")
    args = bench.oakemu_system_args(
        system,
        mode="async",
        seed=3,
        steps=5000,
        runs_dir=tmp_path,
        run_name="r",
        ports=[1, 2, 3, 4, 5],
        torch_threads=1,
        num_actors=1,
    )
    config = train_config(args, monkeypatch)
    assert (config.anneal_lr, config.normalize_observations, config.normalize_rewards) == (
        True,
        True,
        True,
    )
    assert (config.rollout_length, config.ppo_epochs, config.num_minibatches) == (32, 20, 1)
    assert (config.gamma, config.gae_lambda, config.clip_coef, config.vf_coef) == (
        0.98,
        0.8,
        0.2,
        1.0,
    )
    if system == "oakemu-recurrent":
        assert (config.recurrent, config.recurrent_hidden, config.sequence_length) == (
            "lstm",
            64,
            32,
        )
        assert (config.net_arch, config.activation) == ("pi=64 vf=64", "relu")
