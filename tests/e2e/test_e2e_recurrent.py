"""End to end with a recurrent (LSTM) policy: ``oakemu train --recurrent lstm``.

- Learning: on ``CartPoleNoVel-v1`` (CartPole observing positions only, :mod:`oakemu_core.envs.memory`)
  in sync mode, the mean return of 20 consecutive episodes reaches 150 within the budget. Sync mode
  with one actor reproduces a seed; the budget is about twice what the slowest of seeds 1-4 needed
  (7,900-12,300 env steps). The same settings without the core (feed-forward, which cannot see the
  velocities) stay far below: their best 20-episode mean was 63 in this budget (seed 1) and 60 in
  20,000 env steps (seed 2).
- Plumbing: async mode, 2 actors over sockets (``--step-transport sockets``), sequences shorter than
  the rollout, then ``--resume``: the actors' stored states give the learner's log-probs (the
  first-minibatch ratio check), rows of older versions are re-evaluated over sequences, and the
  resumed run continues the step count and the versions.
"""

from __future__ import annotations

import itertools

import pytest

from tests.e2e_helpers import E2EProcesses, new_ports, read_jsonl, update_records

LEARNING_BUDGET = 24_576
"""Env steps: 96 rollouts of 32 steps x 8 envs."""
SOLVED_RETURN = 150.0
LAST_EPISODES = 20
RATIO_TOLERANCE = 1e-5


def best_window(episodes: list[dict]) -> tuple[int | None, float]:
    """``(global_step at which the mean of the last 20 episodes first reached 150, or None; the best
    such mean)``."""
    returns = [float(e["episodic_return"]) for e in episodes]
    best = float("-inf")
    for end in range(LAST_EPISODES, len(returns) + 1):
        mean = sum(returns[end - LAST_EPISODES : end]) / LAST_EPISODES
        best = max(best, mean)
        if mean >= SOLVED_RETURN:
            return int(episodes[end - 1]["global_step"]), mean
    return None, best


@pytest.mark.slow
def test_an_lstm_policy_learns_cartpole_without_velocities(e2e: E2EProcesses) -> None:
    """rl-baselines3-zoo's ``ppo_lstm`` settings for CartPoleNoVel-v1 (8 envs x 32 steps, 20 epochs,
    one minibatch of 8 whole columns, lr 1e-3 annealed, gamma 0.98, lambda 0.8, no entropy bonus,
    normalised observations and rewards, an LSTM of 64 under pi=64 vf=64 ReLU torsos)."""
    run_dir = e2e.train(
        [
            *("--env", "oakemu_core.envs.memory:CartPoleNoVel-v1", "--mode", "sync"),
            *("--seed", "1", "--total-env-steps", str(LEARNING_BUDGET)),
            *("--num-actors", "1", "--envs-per-actor", "8", "--rollout-length", "32"),
            *("--ppo-epochs", "20", "--num-minibatches", "1", "--learning-rate", "1e-3"),
            *("--anneal-lr", "--gamma", "0.98", "--gae-lambda", "0.8", "--clip-coef", "0.2"),
            *("--clip-value-range", "null", "--ent-coef", "0.0", "--vf-coef", "1.0"),
            *("--normalize-observations", "--normalize-rewards", "--no-clip-rewards"),
            *("--checkpoint-every-updates", "0", "--no-rollback", "--eval-every-updates", "0"),
            *("--net-arch", "pi=64 vf=64", "--activation", "relu"),
            *("--recurrent", "lstm", "--recurrent-hidden", "64"),
        ],
        timeout_s=240,
    ).run_dir
    episodes = read_jsonl(run_dir / "episodes.jsonl")
    solved_at, best_mean = best_window(episodes)
    assert solved_at is not None, (
        f"the mean return of {LAST_EPISODES} consecutive episodes never reached {SOLVED_RETURN} "
        f"(best {best_mean:.1f}) in {LEARNING_BUDGET} env steps"
    )
    # Every row's log-prob recomputed from its sequence's stored state is the actor's (sequences
    # started from zeros instead, mid-episode, give ratios off by 10 and more once the policy is sharp).
    updates = update_records(run_dir)
    assert (
        max(u["diagnostics/first_minibatch_ratio_max_abs_dev"] for u in updates) < RATIO_TOLERANCE
    )


@pytest.mark.slow
def test_an_lstm_policy_trains_async_over_sockets_and_resumes(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / "lstm"
    common = [
        *("--rollout-length", "32", "--sequence-length", "8"),
        *("--ppo-epochs", "2", "--num-minibatches", "4", "--checkpoint-every-updates", "2"),
        *("--step-transport", "sockets", "--eval-every-updates", "0"),
    ]
    e2e.train(
        [
            *("--env", "oakemu_core.envs.memory:CartPoleNoVel-v1", "--mode", "async"),
            *("--num-actors", "2", "--envs-per-actor", "2", "--total-env-steps", "1024"),
            *("--recurrent", "lstm", "--recurrent-hidden", "16", "--run-name", "lstm"),
            *common,
        ],
        timeout_s=180,
    )
    updates = update_records(run_dir)
    assert len(updates) >= 6, f"{len(updates)} PPO updates"
    # The actors' log-probs, from the states they stored, are the learner's: exactly on the first
    # rollout (every row of version 0). Later, a row of the learner's version may follow rows of the
    # version before in its sequence: the actor's state came through the older weights, the learner
    # recomputes it with its own, so the ratio is near 1 only (up to 2e-4 seen). The learning test
    # above holds every update to 1e-5 (sync mode: one version per rollout).
    deviations = [
        u["diagnostics/first_minibatch_ratio_max_abs_dev"]
        for u in updates
        if u.get("diagnostics/first_minibatch_ratio_max_abs_dev") is not None
    ]
    assert updates[0]["diagnostics/first_minibatch_ratio_max_abs_dev"] < RATIO_TOLERANCE
    assert max(deviations) < 1e-3, deviations
    # Asynchronous: some rollouts held rows of older versions (re-evaluated over sequences).
    assert any((u.get("charts/policy_lag_max") or 0) >= 1 for u in updates), updates
    last_step = updates[-1]["global_step"]

    resumed = e2e.start(
        "train-2",
        ["train", "--resume", str(run_dir), "--total-env-steps", "2048", *new_ports().flags()],
    )
    e2e.finish(resumed, timeout_s=180, run_dir=run_dir)
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text(errors="replace")
    all_updates = update_records(run_dir)
    after = all_updates[len(updates) :]
    assert after and after[0]["global_step"] > last_step
    assert [u["charts/policy_version"] for u in after] == list(
        range(len(updates) + 1, len(all_updates) + 1)
    )
    assert all(a["global_step"] <= b["global_step"] for a, b in itertools.pairwise(all_updates))
    assert {e["actor_id"] for e in read_jsonl(run_dir / "episodes.jsonl")} >= {"actor-0", "actor-1"}
