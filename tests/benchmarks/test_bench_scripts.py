"""benchmarks/bench_spaces_vs_sb3.py: both systems get the hyperparameters of one table (no training here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oakemu_services import cli

from oakemu_core.presets import load_preset
from tests.benchmarks.script_helpers import load_script, train_config

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "bench_spaces_vs_sb3.py"


bench = load_script("bench_spaces_vs_sb3")


def test_help_runs_without_sb3_imports() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--steps" in result.stdout and "--seeds" in result.stdout


@pytest.mark.parametrize("name", sorted(bench.CASES))
def test_oakemu_flags_parse_to_the_case(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flags the benchmark passes to `oakemu train` give a config equal to the case's table."""
    case = bench.CASES[name]
    args = bench.oakemu_args(
        case, seed=3, steps=4096, runs_dir=tmp_path, run_name="r", ports=[1, 2, 3, 4, 5]
    )
    config = train_config(args, monkeypatch)
    assert config.env_id == case.env_id and config.seed == 3 and config.total_env_steps == 4096
    assert config.num_actors * config.envs_per_actor == case.num_envs
    assert (
        config.batch_size // config.num_minibatches == case.batch_size
    )  # config.batch_size: rows per rollout
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
        "normalize_observations",
        "normalize_rewards",
        "normalize_advantages",
        "target_kl",
        "max_policy_lag",
    ):
        assert getattr(config, field) == getattr(case, field), field
    assert config.anneal_lr is False
    assert config.resolved_clip_value_range is None
    assert config.resolved_clip_rewards is False
    assert config.rollback is False  # SB3 has no automatic rollback


@pytest.mark.parametrize("name", sorted(bench.CASES))
def test_sb3_kwargs_build_the_same_algorithm(name: str) -> None:
    """SB3 / sb3-contrib accept the derived keyword arguments and hold the case's values (skips without SB3)."""
    pytest.importorskip("stable_baselines3")
    pytest.importorskip("sb3_contrib")
    import gymnasium as gym
    from sb3_contrib import MaskablePPO
    from stable_baselines3 import PPO

    case = bench.CASES[name]
    algorithm = MaskablePPO if case.action_masks else PPO
    model = algorithm("MlpPolicy", gym.make(case.env_id), **bench.sb3_kwargs(case, seed=1))
    assert (model.n_steps, model.batch_size, model.n_epochs) == (
        case.rollout_length,
        case.batch_size,
        case.ppo_epochs,
    )
    assert (model.gamma, model.gae_lambda, model.ent_coef, model.vf_coef, model.max_grad_norm) == (
        case.gamma,
        case.gae_lambda,
        case.ent_coef,
        case.vf_coef,
        case.max_grad_norm,
    )
    assert model.clip_range(1.0) == case.clip_coef and model.clip_range_vf is None
    assert (
        model.lr_schedule(1.0) == model.lr_schedule(0.0) == case.learning_rate
    )  # constant, as --no-anneal-lr


BENCH_VS_SB3 = REPO_ROOT / "benchmarks" / "bench_vs_sb3.py"


def _bench_vs_sb3():
    spec = importlib.util.spec_from_file_location("bench_vs_sb3", BENCH_VS_SB3)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["cartpole", "lunarlander", "breakout", "pendulum", "hopper"])
def test_bench_vs_sb3_flags_match_the_case(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """benchmarks/bench_vs_sb3.py: --help runs; both modes' flags give the case's config, vf_coef in OakEmu's
    0.5 * MSE meaning (2 x SB3's), rewards clipped for Atari only."""
    result = subprocess.run(
        [sys.executable, str(BENCH_VS_SB3), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and "--quick" in result.stdout, result.stderr
    module = _bench_vs_sb3()
    target = module.BENCHES[name]
    case = target.case
    kwargs = module.sb3_bench_kwargs(target, seed=3)
    for mode in ("async", "sync"):
        args = module.oakemu_bench_args(
            target,
            mode=mode,
            seed=3,
            steps=4096,
            runs_dir=tmp_path,
            run_name="r",
            ports=[1, 2, 3, 4, 5],
            torch_threads=1,
            num_actors=min(2, case.num_envs),
        )
        config = train_config(args, monkeypatch)
        assert (config.mode, config.env_id, config.seed, config.eval_every_updates) == (
            mode,
            case.env_id,
            3,
            0,
        )
        assert config.num_actors * config.envs_per_actor == case.num_envs
        assert (
            config.batch_size // config.num_minibatches == case.batch_size == kwargs["batch_size"]
        )
        assert (
            config.rollout_length,
            config.ppo_epochs,
            config.learning_rate,
            config.gamma,
            config.gae_lambda,
            config.clip_coef,
            config.ent_coef,
            config.max_grad_norm,
        ) == (
            kwargs["n_steps"],
            kwargs["n_epochs"],
            kwargs["learning_rate"],
            kwargs["gamma"],
            kwargs["gae_lambda"],
            kwargs["clip_range"],
            kwargs["ent_coef"],
            kwargs["max_grad_norm"],
        )
        assert config.vf_coef == 2 * kwargs["vf_coef"]
        assert (config.normalize_observations, config.normalize_rewards) == (
            case.normalize_observations,
            case.normalize_rewards,
        )
        normalize = module.sb3_vec_env_settings(case)["VecNormalize"]
        assert (normalize is not None) is case.normalize_observations
        if name == "hopper":  # SB3's own defaults, not a preset
            assert (
                kwargs["n_steps"],
                kwargs["batch_size"],
                kwargs["n_epochs"],
                kwargs["vf_coef"],
            ) == (2048, 64, 10, 0.5)
            continue
        preset = load_preset(
            {"breakout": "atari"}.get(name, name)
        ).settings  # the one home of the values
        for key in (
            "env_id",
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
        ):
            assert getattr(config, key) == preset[key], key
        assert (
            config.anneal_lr is False
            and config.resolved_clip_value_range is None is kwargs["clip_range_vf"]
        )
        assert config.resolved_clip_rewards is target.atari
    # One actor process (--actors auto on 2 cores) gets every env of the case; a count that does not
    # divide the envs is refused.
    one = train_config(
        module.oakemu_bench_args(
            target,
            mode="async",
            seed=3,
            steps=4096,
            runs_dir=tmp_path,
            run_name="r",
            ports=[1, 2, 3, 4, 5],
            torch_threads=1,
            num_actors=1,
        ),
        monkeypatch,
    )
    assert (one.num_actors, one.envs_per_actor) == (1, case.num_envs)
    with pytest.raises(SystemExit, match="must divide"):
        module.oakemu_bench_args(
            target,
            mode="async",
            seed=3,
            steps=4096,
            runs_dir=tmp_path,
            run_name="r",
            ports=[1, 2, 3, 4, 5],
            torch_threads=1,
            num_actors=case.num_envs + 1,
        )


def test_bench_vs_sb3_report_merges_json_files_and_prints_means_over_seeds(tmp_path: Path) -> None:
    """``bench_vs_sb3.py --report``: rows of two JSON files merged by case and seed (a later file adds systems),
    and the printed means over seeds are the means of the rows' figures."""

    def result(last100: float, wall: float, curve: list[float]) -> dict:
        return {
            "sps": 1000.0,
            "last100": last100,
            "wall_s": wall,
            "curve": curve,
            "to_threshold": None,
        }

    first = [
        {
            "case": "lunarlander",
            "env": "LunarLander-v3",
            "seed": 1,
            "steps": 100,
            "sb3": result(200.0, 800.0, [-100.0, 100.0]),
        },
        {
            "case": "lunarlander",
            "env": "LunarLander-v3",
            "seed": 2,
            "steps": 100,
            "sb3": result(100.0, 600.0, [-50.0, 200.0]),
        },
    ]
    second = [
        {
            "case": "lunarlander",
            "env": "LunarLander-v3",
            "seed": 1,
            "steps": 100,
            "oakemu-sync": result(190.0, 200.0, [-90.0, 150.0]),
        },
        {
            "case": "lunarlander",
            "env": "LunarLander-v3",
            "seed": 2,
            "steps": 100,
            "oakemu-sync": result(80.0, 220.0, [-60.0, 130.0]),
        },
    ]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, rows in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(rows))
    merged = _bench_vs_sb3().merge_results(paths)
    assert [
        (row["seed"], sorted(k for k in row if k.startswith(("sb3", "oakemu")))) for row in merged
    ] == [(1, ["oakemu-sync", "sb3"]), (2, ["oakemu-sync", "sb3"])]
    printed = subprocess.run(
        [sys.executable, str(BENCH_VS_SB3), "--report", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert printed.returncode == 0, printed.stderr
    # SB3: last100 (200 + 100) / 2 = 150, wall 700, curve [-75, 150]; sync: 135, 210, curve [-75, 140].
    assert "sb3: seeds [1, 2], mean last100 150.0, mean wall 700 s" in printed.stdout
    assert (
        "oakemu-sync: seeds [1, 2], mean last100 135.0, mean wall 210 s (-15.0 against SB3's return, 0.90 x; "
        "0.30 x its wall)"
    ) in printed.stdout
    assert "mean curve: [-75.0, 140.0]" in printed.stdout
    # -75 >= -75 - 3.75 holds; 140 >= 150 - 7.5 does not.
    assert (
        "windows within 5 % of SB3's mean or better: 1 of 2; differences [0.0, -10.0]"
        in printed.stdout
    )
    missing = subprocess.run(
        [sys.executable, str(BENCH_VS_SB3), "--report", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode != 0 and "no such file" in missing.stderr


def test_bench_learner_layout_times_each_variant_and_prints_their_ratios() -> None:
    """A tiny run of benchmarks/bench_learner_layout.py: each variant timed, and each printed speed-up is
    the quotient of two printed medians."""
    import re

    script = REPO_ROOT / "benchmarks" / "bench_learner_layout.py"
    result = subprocess.run(
        [sys.executable, str(script), "--batch", "4", "--steps", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    built = float(re.search(r"as built:\s+([\d.]+) ms", result.stdout).group(1))
    last = float(re.search(r"channels-last:\s+([\d.]+) ms", result.stdout).group(1))
    bfloat16 = float(re.search(r"bfloat16:\s+([\d.]+) ms", result.stdout).group(1))
    ratio = float(re.search(r"channels-last speed-up: ([\d.]+) x", result.stdout).group(1))
    bfloat16_ratio = float(
        re.search(r"bfloat16 speed-up over channels-last: ([\d.]+) x", result.stdout).group(1)
    )
    assert built > 0 and last > 0 and bfloat16 > 0
    assert abs(ratio - built / last) <= 0.01 + 0.05 * ratio  # the printed figures are rounded
    assert abs(bfloat16_ratio - last / bfloat16) <= 0.01 + 0.05 * bfloat16_ratio


@pytest.mark.parametrize(
    "env_id, steps_per_message", [("CartPole-v1", 1), ("CartPole-v1", 4), ("ALE/Breakout-v5", 1)]
)
def test_bench_ingest_in_process_figure_decodes_and_writes_whole_rollouts(
    env_id: str, steps_per_message: int
) -> None:
    """benchmarks/bench_ingest.py's in-process figure: its synthetic fields pass decode_step's checks and
    fill whole rollouts (the function asserts a full buffer after each), and it reports a positive rate."""
    spec = importlib.util.spec_from_file_location(
        "bench_ingest", REPO_ROOT / "benchmarks" / "bench_ingest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.in_process_rows_per_s(env_id, 4, steps_per_message, seconds=0.05) > 0


@pytest.mark.parametrize(
    "variant", ["per_core", "per_core+torch", "per_core+bfloat16", "groups2+bfloat16"]
)
def test_bench_pipeline_actor_loop_variants_step_with_their_settings(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/bench_pipeline.py's per-core and bfloat16 actor loops (``--per-core``, ``--actor-variants``),
    in process: the env gets one emulator thread exactly when the variant is per-core, the model the
    bfloat16 forward exactly when asked, and the loop reports a positive rate."""
    import queue

    from oakemu_core.actor.stepper import PolicyStepper
    from oakemu_core.envs import factory
    from oakemu_core.policy.bfloat16_inference import BFloat16Forward

    module_spec = importlib.util.spec_from_file_location(
        "bench_pipeline", REPO_ROOT / "benchmarks" / "bench_pipeline.py"
    )
    bench_pipeline = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench_pipeline)
    threads, backends = [], []
    real_backend, real_stepper = factory.AtariBackend, PolicyStepper.__init__

    def recording_backend(*args, **kwargs):
        threads.append(kwargs["num_threads"])
        return real_backend(*args, **kwargs)

    def recording_stepper(self, env, model, **kwargs):
        backends.append(type(model.__dict__.get("_inference_backend")))
        real_stepper(self, env, model, **kwargs)

    monkeypatch.setattr(factory, "AtariBackend", recording_backend)
    monkeypatch.setattr(PolicyStepper, "__init__", recording_stepper)
    out: queue.Queue = queue.Queue()
    bench_pipeline._step_loop("ALE/Breakout-v5", 2, 0.2, variant != "per_core", 1, out, variant)
    assert out.get_nowait() > 0
    groups = 2 if "groups2" in variant else 1
    assert threads == [1 if variant.startswith("per_core") else None] * groups
    assert backends == (
        [] if variant == "per_core" else [BFloat16Forward if "bfloat16" in variant else type(None)]
    )


showcase = load_script("showcase_airstriker")


def test_showcase_reads_the_training_and_evaluation_curve_from_metrics_lines() -> None:
    lines = [
        '{"global_step": 512, "charts/episodic_return": NaN, "losses/entropy": 8.3}',
        "",
        '{"global_step": 1024, "charts/episodic_return": 70.0}',
        '{"global_step": 1100, "eval/episodic_return": 90.0, "eval/episodic_return_std": 5.0, '
        '"eval/weights_global_step": 1024.0}',
        '{"global_step": 1536, "charts/episodic_return": 75.5}',
    ]
    curve = showcase.read_curve(lines)
    assert (curve.train_steps, curve.train_returns) == ([1024, 1536], [70.0, 75.5])
    assert (curve.eval_steps, curve.eval_means, curve.eval_stds) == ([1024], [90.0], [5.0])


def test_showcase_beats_random_needs_the_mean_above_random_mean_plus_two_std_over_ten_episodes() -> (
    None
):
    random = [
        60.0,
        80.0,
        100.0,
    ] * 4  # mean 80, population std sqrt(800 / 3) = 16.33: the bar is 112.66
    assert showcase.beats_random([113.0] * 10, random)
    assert not showcase.beats_random([112.0] * 10, random)
    assert not showcase.beats_random([500.0] * 9, random)  # too few trained episodes
    assert not showcase.beats_random([500.0] * 10, random[:9])  # too few random ones


def test_showcase_trains_airstriker_with_evaluation_and_one_env_per_actor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = showcase.train_args(steps=4096, seed=3, runs_dir=tmp_path, run_name="r")
    config = train_config(args, monkeypatch)
    assert (
        config.env_id == "retro:Airstriker-Genesis-v0"
        and config.total_env_steps == 4096
        and config.seed == 3
    )
    assert config.envs_per_actor == 1 and config.num_actors == 4 and config.mode == "async"
    assert (
        config.clip_rewards is True
        and config.eval_greedy is False
        and config.eval_every_updates > 0
    )
    assert config.runs_dir == tmp_path and config.run_name == "r"


def test_showcase_clip_keeps_every_second_frame_of_its_seconds_downscaled() -> None:
    clip = showcase.ClipFrames(seconds=1.0, skip=0.4)  # at 15 frames per second: frames 6 to 20
    assert clip.begin(15.0)
    for value in range(40):
        clip.add(np.full((224, 320, 3), value, dtype=np.uint8))
    clip.end()
    assert not clip.begin(15.0)  # the first episode only
    assert [int(frame[0, 0, 0]) for frame in clip.frames] == [6, 8, 10, 12, 14, 16, 18, 20]
    assert {frame.shape for frame in clip.frames} == {(112, 160, 3)}


GPU_CHECK = REPO_ROOT / "benchmarks" / "gpu_check.py"


def _run_gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """benchmarks/gpu_check.py ARGS in a session of its own: on a timeout or a failure of the test every
    process it started is killed and its shared-memory segments removed (the script itself must leave
    none: asserted)."""
    import signal

    from oakemu_core.shared_memory import SEGMENT_PREFIX
    from tests.e2e_helpers import SHM_DIR

    process = subprocess.Popen(
        [sys.executable, str(GPU_CHECK), *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    left: list[Path] = []
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(
                process.pid, signal.SIGKILL
            )  # the synthetic actors, if the script did not stop them
        except ProcessLookupError:
            pass
        process.wait()
        left = sorted(SHM_DIR.glob(f"{SEGMENT_PREFIX}{process.pid}_*")) if SHM_DIR.is_dir() else []
        for path in left:
            path.unlink(missing_ok=True)
    assert not left, f"gpu_check left shared-memory segments: {[path.name for path in left]}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_gpu_check_cpu_fallback_prints_consistent_update_and_end_to_end_figures() -> None:
    """benchmarks/gpu_check.py --quick on the CPU: one upload per update, actor and learner agree on the
    log-probs, the printed medians are the table's and their ratio their quotient; end to end, updates
    ran and the training ceiling and busy share follow from the printed rate and update time."""
    import re

    result = _run_gpu_check("--quick", "--device", "cpu", timeout=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    table = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(table) == 2  # --quick: 2 updates
    for row in table:
        uploads, deviation, per_epoch, production, bare = int(row[1]), *map(float, row[2:6])
        assert uploads == 1 and deviation < 1e-5
        assert per_epoch > 0 and production > 0 and bare > 0
        assert abs(per_epoch - production / 4) <= 1e-3  # the preset's 4 epochs
    medians = re.search(
        r"production ([\d.]+) ms, bare loop ([\d.]+) ms, production / bare ([\d.]+)", out
    )
    production_ms, bare_ms, ratio = map(float, medians.groups())
    assert (
        abs(production_ms - 1e3 * float(table[1][4])) <= 0.1
        and abs(bare_ms - 1e3 * float(table[1][5])) <= 0.1
    )
    assert abs(ratio - production_ms / bare_ms) <= 0.002 + 0.001 * ratio
    figures = re.search(
        r"end to end: ([\d,]+) env steps/s trained over (\d+) updates, ([\d,]+) env steps/s "
        r"ingested; update ([\d.]+) ms \(median\) = training ceiling ([\d,]+) env steps/s; "
        r"trainer busy ([\d.]+) %",
        out,
    )
    assert figures is not None, out
    trained, updates, ingested, update_ms, ceiling, busy = (
        float(value.replace(",", "")) for value in figures.groups()
    )
    assert trained > 0 and updates >= 1 and ingested > 0 and update_ms > 0
    assert (
        abs(ceiling - 32 / (update_ms / 1e3)) <= 1 + 0.01 * ceiling
    )  # 2 envs x 16 steps per update
    # trained and ceiling are printed to whole env steps/s: at a few dozen (a loaded machine) their
    # rounding alone moves the quotient by up to 100 * 0.5 * (1 / ceiling + trained / ceiling^2).
    rounding = 50 * (1 / ceiling + trained / ceiling**2)
    assert abs(busy - 100 * trained / ceiling) <= 0.1 + 0.01 * busy + rounding


def test_gpu_check_asking_for_a_missing_device_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert load_script("gpu_check").main(["--quick", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "cuda" in err


def test_bench_churn_gives_the_learner_only_options_it_takes() -> None:
    """The churn benchmark starts ``oakemu learner`` with the ``oakemu train`` flags of its case: the
    ones the learner does not offer (``--torch-threads``, ``--num-actors``) must be left out, else it
    exits 2 at once and the benchmark measures nothing."""
    churn, vs_sb3 = load_script("bench_churn"), load_script("bench_vs_sb3")
    args = vs_sb3.oakemu_bench_args(
        vs_sb3.BENCHES["cartpole"],
        mode="sync",
        seed=1,
        steps=4096,
        runs_dir=Path("r"),
        run_name="n",
        ports=[5001, 5002, 5003, 5004, 5005],
        torch_threads=1,
        num_actors=2,
    )
    assert "--torch-threads" in args
    kept = churn.learner_args(args)
    assert (
        "--torch-threads" not in kept
        and "--mode" in kept
        and kept[kept.index("--mode") + 1] == "sync"
    )
    parser = cli.build_parser()[1]["learner"]
    namespace, unknown = parser.parse_known_args(kept)
    assert unknown == [] and namespace.total_env_steps == 4096
