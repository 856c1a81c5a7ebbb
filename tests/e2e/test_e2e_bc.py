"""End to end: demonstrations recorded with ``oakemu record`` (a scripted CartPole expert) lift the
FIRST evaluation of ``oakemu train --bc-dataset ...`` far above a random policy before any PPO update.
The first tester report is of the weights published after behaviour cloning (policy
version 1), played greedily; a random CartPole policy returns about 22."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_helpers import E2EProcesses, read_jsonl

pytest.importorskip("minari", reason="behaviour cloning needs the bc extra (minari)")

RANDOM_RETURN = 22.0


@pytest.mark.slow
def test_bc_pretraining_lifts_the_first_evaluation(e2e: E2EProcesses, tmp_path: Path) -> None:
    dataset = tmp_path / "cartpole-expert"
    record = e2e.start(
        "record",
        [
            "record",
            "--env",
            "CartPole-v1",
            "--episodes",
            "4",
            "--output",
            str(dataset),
            "--policy",
            "tests.algo.test_demonstrations:cartpole_expert",
            "--seed",
            "0",
        ],
    )
    assert record.wait(timeout_s=120) == 0, record.describe()

    run = e2e.train(
        [
            "--env",
            "CartPole-v1",
            "--seed",
            "1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "4",
            "--rollout-length",
            "64",
            "--total-env-steps",
            "4096",
            "--bc-dataset",
            str(dataset),
            "--bc-pretrain-updates",
            "10",
            "--bc-batch-size",
            "64",
            "--learning-rate",
            "1e-3",
            "--eval-every-updates",
            "1000",
            "--eval-episodes",
            "3",
        ],
        timeout_s=300,
    )
    run_dir, log = run.run_dir, run.learner_log
    assert "behaviour cloning: 10 replay-only updates" in log
    assert "Traceback" not in log and "collapsed" not in log

    # The tester's first report is of the behaviour-cloned weights: the learner keeps a run's first
    # weights for the tester, so they are evaluated even when the run outpaces the tester's start-up.
    evaluations = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/episodic_return" in r]
    first = min(evaluations, key=lambda r: r["eval/policy_version"])
    assert first["eval/policy_version"] == 1, (
        "the first evaluation is of the behaviour-cloned weights"
    )
    assert first["eval/episodic_return"] > 5 * RANDOM_RETURN, first
