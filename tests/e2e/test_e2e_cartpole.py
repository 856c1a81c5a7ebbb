"""End to end: ``oakemu train`` on CartPole-v1 with 2 actor processes learns over the real ZeroMQ path.

Success criterion: the mean episodic return of 20 consecutive finished episodes (``episodes.jsonl``,
in the order the learner received them) reaches at least 195 within a fixed env-step budget, with a
fixed seed. The run is asynchronous (two actors race the learner; that is what this test covers), so
it is not bit-for-bit reproducible: the budget is about twice the steps the slowest of the runs
tried needed, and with learning broken (learning rate 0, or the policy loss's sign flipped) the
mean stays far below 195 (figures: ``docs/benchmarks.md``).
"""

from __future__ import annotations

import pytest

from tests.e2e_helpers import E2EProcesses, read_jsonl, update_records

STEP_BUDGET = 24_576
"""Env steps: 24 rollouts of 128 steps x 8 columns."""
SOLVED_RETURN = 195.0
LAST_EPISODES = 20
RATIO_TOLERANCE = 1e-5


def first_solved(episodes: list[dict]) -> tuple[int | None, float]:
    """``(global_step at which the mean of the last 20 episodes first reached 195, or None; best such mean)``."""
    returns = [float(e["episodic_return"]) for e in episodes]
    best = float("-inf")
    for end in range(LAST_EPISODES, len(returns) + 1):
        mean = sum(returns[end - LAST_EPISODES : end]) / LAST_EPISODES
        best = max(best, mean)
        if mean >= SOLVED_RETURN:
            return int(episodes[end - 1]["global_step"]), mean
    return None, best


def test_first_solved_window() -> None:
    """The criterion itself, on made-up returns: 12 episodes of 0 then 10 of 400."""
    episodes = [
        {"episodic_return": 0.0 if i < 12 else 400.0, "global_step": 100 * i} for i in range(22)
    ]
    # Windows of 20 ending at episodes 20, 21, 22: means 8*400/20=160, 9*400/20=180, 10*400/20=200.
    assert first_solved(episodes[:21]) == (None, 180.0)
    assert first_solved(episodes) == (2100, 200.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("actor_inference", "publish_every_epoch"),
    [("torch", True), ("onnxruntime", True), ("auto", False)],
)
def test_cartpole_two_actors_learn_within_budget(
    e2e: E2EProcesses, actor_inference: str, publish_every_epoch: bool
) -> None:
    """The same run whichever runs the actors' forward passes (torch or ONNX Runtime), and with the
    weights also published within updates (after every epoch of 8 SGD steps here: the actors of a
    machine with fast cores fill the next rollout within the first third of an update, before a
    publish after 32 SGD steps): the learner's first-minibatch ratio check holds the actors'
    log-probs to the learner's on the rows labelled with its version."""
    # e2e.train also checks that the launcher waited for its learner and actors: nothing of the run
    # is left running or in /dev/shm.
    run_dir = e2e.train(
        [
            "--env",
            "CartPole-v1",
            "--mode",
            "async",
            "--seed",
            "1",
            "--num-actors",
            "2",
            "--total-env-steps",
            str(STEP_BUDGET),
            "--envs-per-actor",
            "4",
            "--rollout-length",
            "128",
            "--ppo-epochs",
            "10",
            "--num-minibatches",
            "8",
            "--learning-rate",
            "1e-3",
            "--clip-coef",
            "0.2",
            "--ent-coef",
            "0.0",
            "--checkpoint-every-updates",
            "0",
            "--actor-inference",
            actor_inference,
            "--publish-every-epoch" if publish_every_epoch else "--no-publish-every-epoch",
            "--publish-min-sgd-steps",
            "8",
        ],
        timeout_s=240,
    ).run_dir

    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert len(episodes) >= LAST_EPISODES, f"only {len(episodes)} episodes finished"
    assert {e["actor_id"] for e in episodes} == {"actor-0", "actor-1"}, (
        "both actors must have contributed"
    )
    # The run stopped at its budget (plus at most what was in flight when it was reached).
    assert episodes[-1]["global_step"] <= STEP_BUDGET + 2 * 128 * 8
    solved_at, best_mean = first_solved(episodes)
    assert solved_at is not None, (
        f"the mean return of {LAST_EPISODES} consecutive episodes never reached {SOLVED_RETURN} "
        f"(best {best_mean:.1f}) in {STEP_BUDGET} env steps"
    )
    assert solved_at <= STEP_BUDGET

    updates = update_records(run_dir)
    assert len(updates) >= STEP_BUDGET // (128 * 8) - 2, f"only {len(updates)} PPO updates"
    # Actor and learner agree on log-probs: PPO ratio of the first minibatch of the first update is 1.
    first = updates[0]
    assert first["charts/policy_version"] == 1
    assert first["diagnostics/first_minibatch_ratio_max_abs_dev"] is not None
    # ... and on every later update whose first minibatch has rows of the learner's version (in
    # asynchronous mode most rollouts are a version behind, so 1-4 of the updates here): the actors act
    # with each new version's weights (a session left on old weights would give ratios far from 1).
    deviations = [u["diagnostics/first_minibatch_ratio_max_abs_dev"] for u in updates]
    assert max(d for d in deviations if d is not None) < RATIO_TOLERANCE
    assert (
        "learner torch threads: 1" in (run_dir / "logs" / "learner.log").read_text()
    )  # an MLP: one thread
    actor_logs = "".join(
        p.read_text(errors="replace") for p in (run_dir / "logs").glob("actor*.log")
    )
    assert ("forward passes by ONNX Runtime" in actor_logs) == (actor_inference == "onnxruntime")
    assert ("forward passes in numpy" in actor_logs) == (actor_inference == "auto")  # an MLP: numpy
    assert ("weight revisions published within updates" in actor_logs) == publish_every_epoch
    # The actors stopped on the learner's notice on the weights channel (or, if a heartbeat reply came
    # first, on that): each logged one of the two, and the notice reached at least one.
    for path in (run_dir / "logs").glob("actor*.log"):
        text = path.read_text(errors="replace")
        assert "learner announced the end of the run" in text or "learner asked actor" in text, text
    assert "learner announced the end of the run" in actor_logs, actor_logs
    # Rows carry the revision that acted on them. Without revisions every row lags whole updates of
    # 80 SGD steps (10 epochs x 8 minibatches), so the mean lag in SGD steps is exactly 80 x the mean
    # lag in versions; with them, rows acted within an update lag less.
    pairs = [
        (u["charts/policy_lag_sgd_steps_mean"], 80 * u["charts/policy_lag_mean"])
        for u in updates
        if u.get("charts/policy_lag_sgd_steps_mean") is not None
        and u.get("charts/policy_lag_mean") is not None
    ]
    assert len(pairs) >= len(updates) - 2
    assert any(sgd < whole - 1e-6 for sgd, whole in pairs) == publish_every_epoch, pairs
    assert all(sgd <= whole + 1e-6 for sgd, whole in pairs), pairs
    assert (run_dir / "checkpoints" / "latest.pt").is_file(), "the final checkpoint is missing"
