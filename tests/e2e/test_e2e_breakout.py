"""End to end on a real emulator: ``oakemu train`` on ALE/Breakout-v5, then ``--resume``, then ``oakemu evaluate``.

A smoke test of the whole pipeline with tiny settings (2 actors x 2 envs, rollouts of 16 steps,
4 epochs of 2 minibatches): at least two PPO updates, weights versions reach the actors, the run
folder is complete, actor and learner agree on log-probs, a resumed run continues the step count
and the update numbering, and the checkpoint plays an episode.
"""

from __future__ import annotations

import itertools
import re

import pytest

from oakemu_core.config import available_cpus
from tests.e2e_helpers import E2EProcesses, new_ports, read_jsonl, update_records

pytestmark = pytest.mark.slow

ROLLOUT_ROWS = 16 * 2 * 2  # rollout_length x (2 actors x 2 envs)
FIRST_BUDGET = 6 * ROLLOUT_ROWS
RESUMED_BUDGET = 9 * ROLLOUT_ROWS
RATIO_TOLERANCE = 1e-5
EVALUATE_LINE = re.compile(r"episodes\s+1\s+mean\s+(-?\d+\.\d+)\s+std\s+(\d+\.\d+)")


def test_breakout_train_resume_evaluate(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / "breakout"
    e2e.train(
        [
            "--env",
            "ALE/Breakout-v5",
            "--num-actors",
            "2",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "16",
            "--ppo-epochs",
            "4",
            "--num-minibatches",
            "2",
            "--run-name",
            "breakout",
            "--total-env-steps",
            str(FIRST_BUDGET),
        ],
        timeout_s=180,
    )

    # The run folder: resolved config, TensorBoard events, metrics, episodes, logs, checkpoints.
    config_text = (run_dir / "config.toml").read_text()
    assert 'env_id = "ALE/Breakout-v5"' in config_text and "rollout_length = 16" in config_text
    assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {
        "learner.log",
        "actor-0.log",
        "actor-1.log",
    }
    checkpoints = sorted((run_dir / "checkpoints").glob("checkpoint_*.pt"))
    assert checkpoints and (run_dir / "checkpoints" / "latest.pt").is_file()

    updates = update_records(run_dir)
    assert len(updates) >= 2, f"{len(updates)} PPO updates"
    assert [u["charts/policy_version"] for u in updates] == list(range(1, len(updates) + 1))
    # Weights versions reached the actors: some rollout holds rows acted by version >= 1.
    assert max(u["charts/newest_acting_policy_version"] for u in updates) >= 1
    assert updates[0]["diagnostics/first_minibatch_ratio_max_abs_dev"] < RATIO_TOLERANCE
    assert int(checkpoints[-1].stem.split("_")[1]) == len(updates)  # final checkpoint = last update
    last_step = updates[-1]["global_step"]
    assert last_step >= FIRST_BUDGET

    # Resume: the step count and the update numbering continue from the checkpoint.
    resumed = e2e.start(
        "train-2",
        [
            "train",
            "--resume",
            str(run_dir),
            "--total-env-steps",
            str(RESUMED_BUDGET),
            *new_ports().flags(),
        ],
    )
    e2e.finish(resumed, timeout_s=180, run_dir=run_dir)
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text(errors="replace")
    all_updates = update_records(run_dir)
    after = all_updates[len(updates) :]
    assert after, "the resumed run logged no update"
    assert after[0]["global_step"] > last_step
    assert [u["charts/policy_version"] for u in after] == list(
        range(len(updates) + 1, len(all_updates) + 1)
    )
    assert after[-1]["global_step"] >= RESUMED_BUDGET
    # Never back (two updates may share a step: a full rollout waiting at the budget is trained too).
    assert all(a["global_step"] <= b["global_step"] for a, b in itertools.pairwise(all_updates))
    newest = max((run_dir / "checkpoints").glob("checkpoint_*.pt"))
    assert int(newest.stem.split("_")[1]) == len(all_updates)
    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert all(e["episodic_return"] >= 0 for e in episodes)

    # Evaluate the latest checkpoint: one sampled episode, mean and std printed.
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
    assert evaluate.wait(timeout_s=120) == 0, evaluate.describe()
    match = EVALUATE_LINE.search(evaluate.stdout())
    assert match, evaluate.describe()
    mean, std = float(match.group(1)), float(match.group(2))
    assert mean >= 0.0 and std == 0.0  # one episode: std 0


BFLOAT16_RATIO_TOLERANCE = 0.05
"""Largest |ratio - 1| on the first minibatch when the actors act in bfloat16: the learner's float32
log-probs against the bfloat16 actors' (rounding of the logits, about 1e-3 here)."""


def test_breakout_with_bfloat16_actors_and_one_emulator_thread_each(e2e: E2EProcesses) -> None:
    """``--actor-inference bfloat16`` end to end: the actors say so, training runs, and the policy
    that acted differs from the learner's float32 one by rounding only (the first minibatch's ratio);
    the emulator threads are the CPUs divided by the 2 actors."""
    run_dir = e2e.runs_dir / "breakout-bf16"
    e2e.train(
        [
            "--env",
            "ALE/Breakout-v5",
            "--num-actors",
            "2",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "16",
            "--ppo-epochs",
            "2",
            "--num-minibatches",
            "2",
            "--run-name",
            "breakout-bf16",
            "--actor-inference",
            "bfloat16",
            "--total-env-steps",
            str(3 * ROLLOUT_ROWS),
        ],
        timeout_s=180,
    )
    threads = max(1, available_cpus() // 2)
    for name in ("actor-0.log", "actor-1.log"):
        log_text = (run_dir / "logs" / name).read_text(errors="replace")
        assert "forward passes in bfloat16" in log_text and "Traceback" not in log_text
        assert f"({threads} emulator threads per env group)" in log_text
    updates = update_records(run_dir)
    assert len(updates) >= 2, f"{len(updates)} PPO updates"
    deviation = updates[0]["diagnostics/first_minibatch_ratio_max_abs_dev"]
    assert (
        0.0 < deviation < BFLOAT16_RATIO_TOLERANCE
    )  # not exactly float32's, and only rounding away
    # Later updates too: a backend left with the first weights would act a policy versions behind.
    # (None: no row of the learner's version in the first minibatch, nothing to compare.)
    deviations = [u["diagnostics/first_minibatch_ratio_max_abs_dev"] for u in updates]
    assert all(d < BFLOAT16_RATIO_TOLERANCE for d in deviations if d is not None), deviations
    # The learner re-evaluated every rollout in float32, the first (all rows of version 0) included:
    # each update was decoupled, its importance weights pi_learner / pi_bfloat16 within rounding of 1.
    assert (
        "acts in bfloat16: every rollout is re-evaluated"
        in (run_dir / "logs" / "learner.log").read_text()
    )
    weights = [u["diagnostics/importance_weight_mean"] for u in updates]
    assert all(abs(w - 1.0) < BFLOAT16_RATIO_TOLERANCE for w in weights), weights  # NaN fails too
