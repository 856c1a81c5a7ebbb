"""End to end: ``oakemu train`` on CartPole-v1 evaluates itself with the tester.

The tester logs ``eval/episodic_return`` (mean, std, length) to ``metrics.jsonl``, keeps
``checkpoints/best.pt`` = the checkpoint of the best evaluation (replaying it with the tester's
settings gives that evaluation's mean return), records the best and the final evaluation as video,
leaves no process behind, and slows training by a small measured amount: the same short run with and
without evaluation, compared by the learner's ``charts/SPS`` of the last update (wall-clock env steps
per second since the learner started).
"""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
from oakemu_services.evaluate import evaluate
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oakemu_core.run.checkpoint import load_checkpoint
from oakemu_core.run.tester import EVAL_SEED_OFFSET
from tests.e2e_helpers import E2EProcesses, new_ports, read_jsonl, update_records

SEED = 3
STEPS = 32_768  # 64 updates of 128 steps x 4 envs: long enough for a ratio of two wall-clock SPS
EVAL_EPISODES = 3
MIN_SPS_RATIO = 0.45
"""Training with evaluation every 2 updates keeps at least this share of the SPS without it. The
tester is a niced process of its own, paced to a tenth of the wall time (eval_max_share), so few of
those evaluations run (the wall-clock SPS of two short runs is noisy: docs/benchmarks.md gives the
ratios measured). Evaluating inside the learner's loop (3 greedy episodes of up to 500 steps every 2
updates of 512 steps) would cost more than the training itself: a ratio near 0.3, which this bound
catches."""


def train(e2e: E2EProcesses, tmp_path: Path, name: str, eval_every: int) -> Path:
    """One run to its end; ``e2e.train`` also checks that the tester process exited with the rest."""
    return e2e.train(
        [
            "--env",
            "CartPole-v1",
            "--seed",
            str(SEED),
            "--num-actors",
            "1",
            "--envs-per-actor",
            "4",
            "--rollout-length",
            "128",
            "--total-env-steps",
            str(STEPS),
            "--ppo-epochs",
            "4",
            "--num-minibatches",
            "4",
            "--learning-rate",
            "1e-3",
            "--checkpoint-every-updates",
            "0",
            "--eval-every-updates",
            str(eval_every),
            "--eval-episodes",
            str(EVAL_EPISODES),
            "--eval-greedy",
            "true",
        ],
        name=name,
        timeout_s=300,
        ports=new_ports(),
        runs_dir=tmp_path / name,
        exit_timeout_s=10,
    ).run_dir


@pytest.mark.slow
def test_training_evaluates_itself_keeps_best_and_is_not_slowed_much(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    baseline_dir = train(e2e, tmp_path, "no-eval", eval_every=0)
    run_dir = train(e2e, tmp_path, "eval", eval_every=2)

    records = read_jsonl(run_dir / "metrics.jsonl")
    evaluations = [r for r in records if "eval/episodic_return" in r]
    # The tester process needs seconds to start (importing torch) and only the newest weights wait:
    # a short run may see only the final evaluation, a slower one a few periodic ones too. The final
    # weights are always evaluated.
    assert len(evaluations) >= 1, "no evaluation logged"
    final_version = update_records(run_dir)[-1]["charts/policy_version"]
    assert evaluations[-1]["eval/policy_version"] == final_version, (
        "the final weights are evaluated at the end"
    )
    for record in evaluations:
        assert record["eval/episodic_return_std"] is not None and record["eval/episodic_length"] > 0
    steps = [r["global_step"] for r in records]
    assert steps == sorted(steps), "metrics.jsonl went back in global_step"
    assert not any("eval/episodic_return" in r for r in read_jsonl(baseline_dir / "metrics.jsonl"))

    # Videos (CartPole's 400 x 600 render) a user can watch: best.mp4 of the best evaluation, final.mp4
    # of the final weights' one, update_<N>.mp4 of every 10th evaluation (the first included); each in
    # TensorBoard when its evaluation recorded it. No unfinished file is left.
    videos = run_dir / "videos"
    names = sorted(path.name for path in videos.iterdir())
    assert {"best.mp4", "final.mp4", "update_0.mp4"} <= set(names), names
    assert all(name in ("best.mp4", "final.mp4") or name.startswith("update_") for name in names), (
        names
    )
    assert not list(videos.glob("*.partial.mp4"))
    for name in ("best.mp4", "final.mp4"):
        frames = iio.imread(videos / name, plugin="FFMPEG", index=None)
        assert frames.shape[1:] == (400, 600, 3) and len(frames) >= 2, name
    final_length = evaluations[-1]["eval/episodic_length"]
    if (
        evaluations[-1]["eval/episodic_return_std"] == 0
    ):  # all greedy episodes alike: the first's length is known
        assert (
            len(iio.imread(videos / "final.mp4", plugin="FFMPEG", index=None)) == final_length + 1
        )
    assert not (baseline_dir / "videos").exists()
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 1})
    events.Reload()
    assert 1 <= len(events.Images("eval/video")) <= len(evaluations)

    best_path = run_dir / "checkpoints" / "best.pt"
    assert best_path.is_file()
    best_return = max(r["eval/episodic_return"] for r in evaluations)
    state = load_checkpoint(best_path)
    assert state["env"]["env_id"] == "CartPole-v1"
    replay = evaluate(best_path, episodes=EVAL_EPISODES, greedy=True, seed=SEED + EVAL_SEED_OFFSET)
    assert float(np.mean(replay)) == pytest.approx(best_return), (
        "best.pt is not the best evaluation's policy"
    )

    sps_without = update_records(baseline_dir)[-1]["charts/SPS"]
    sps_with = update_records(run_dir)[-1]["charts/SPS"]
    ratio = sps_with / sps_without
    print(
        f"SPS without evaluation {sps_without:.0f}, with evaluation every 2 updates {sps_with:.0f} "
        f"(ratio {ratio:.3f})"
    )
    assert ratio >= MIN_SPS_RATIO, f"evaluation slowed training to {ratio:.0%} of its SPS"
