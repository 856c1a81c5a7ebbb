"""End to end through ``oakemu train`` (2 actor processes, the real ZeroMQ path) on every action and
observation space, each learning above a random policy by a margin, then ``oakemu evaluate`` on the
final checkpoint.

Every run is in sync mode, so a seed gives the same training on one machine (not bit for bit across
machines). At each budget seeds 1, 2 and 3 all clear the threshold with a margin, and the run
fails with learning broken (learning rate 0, or the policy loss's sign flipped); the figures, and
the smaller budgets tried, are in ``docs/benchmarks.md`` (Learning budgets). Random and optimal returns of the
bandit envs: ``tests/spaces_envs.py``. Threshold: the mean return of the last 20 episodes.

* ``Pendulum-v1`` (Box actions, Gaussian): random about -1230; threshold -1000 in 40k steps.
* ``Taxi-v4`` (Discrete observations one-hot + ``info["action_mask"]``): random with masks about
  -200 (every episode truncated at 200 steps); threshold -100 in 160k steps. Whether a run escapes
  the -200 plateau depends on the seed and the budget (the learning rate anneals over it): shorter
  budgets left a seed on the plateau.
* ``MultiDiscreteTarget-v0``: random 1.5, best with one sub-action right 4.0; threshold 5.0 in 16k.
* ``DictTarget-v0`` (uint8 image key + float vector key): random 2.0, best with one key 4.0;
  threshold 5.5 in 20k steps.
* ``MultiBinaryTarget-v0``: random 4.0; threshold 5.5 in 20k steps.
* ``MaskedMultiDiscrete-v0`` (``action_masks()`` method; the env raises if a masked action reaches
  it): random over valid actions 3.0; threshold 4.5 in 10k steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e_helpers import E2EProcesses, read_jsonl

LAST_EPISODES = 20
BANDIT = [
    "--envs-per-actor",
    "4",
    "--rollout-length",
    "128",
    "--ppo-epochs",
    "4",
    "--num-minibatches",
    "4",
    "--learning-rate",
    "1e-3",
    "--clip-coef",
    "0.2",
    "--ent-coef",
    "0.01",
    "--mode",
    "sync",
]
CASES = {
    "pendulum": (
        "Pendulum-v1",
        40_000,
        -1000.0,
        [
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "512",
            "--ppo-epochs",
            "10",
            "--num-minibatches",
            "32",
            "--learning-rate",
            "1e-3",
            "--gamma",
            "0.9",
            "--clip-coef",
            "0.2",
            "--ent-coef",
            "0",
            "--normalize-observations",
            "--normalize-rewards",
            "--max-policy-lag",
            "1",
            "--mode",
            "sync",
        ],
    ),
    "taxi": ("Taxi-v4", 160_000, -100.0, BANDIT),
    "multi_discrete": ("tests.spaces_envs:MultiDiscreteTarget-v0", 16_000, 5.0, BANDIT),
    "dict": ("tests.spaces_envs:DictTarget-v0", 20_000, 5.5, BANDIT),
    "multi_binary": ("tests.spaces_envs:MultiBinaryTarget-v0", 20_000, 5.5, BANDIT),
    "masked_multi_discrete": ("tests.spaces_envs:MaskedMultiDiscrete-v0", 10_000, 4.5, BANDIT),
}
"""case -> (env id, env-step budget, return threshold, training flags)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_space_learns_above_random_and_evaluates(case: str, e2e: E2EProcesses) -> None:
    env_id, budget, threshold, flags = CASES[case]
    run_dir = e2e.train(
        [
            "--env",
            env_id,
            "--seed",
            "1",
            "--num-actors",
            "2",
            "--total-env-steps",
            str(budget),
            "--checkpoint-every-updates",
            "0",
            *flags,
        ],
        timeout_s=300,
    ).run_dir
    logs = {
        path.name: path.read_text(errors="replace") for path in (run_dir / "logs").glob("*.log")
    }
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    # Every step message was accepted: no masked action, no wrong field, nothing rejected.
    assert "rejected step message" not in logs["learner.log"]

    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert len(episodes) >= LAST_EPISODES
    last = [float(e["episodic_return"]) for e in episodes[-LAST_EPISODES:]]
    assert np.mean(last) > threshold, (
        f"{env_id}: mean of the last {LAST_EPISODES} returns {np.mean(last):.2f}; learner.log tail:\n"
        + logs["learner.log"][-3000:]
    )

    evaluate = e2e.start("evaluate", ["evaluate", str(run_dir), "--episodes", "3"])
    assert evaluate.wait(timeout_s=120) == 0, evaluate.describe()
    assert "episodes 3" in evaluate.stdout()


def test_taxi_policy_never_takes_a_masked_action() -> None:
    """2,000 steps of an untrained masked policy on Taxi-v4: every stored action is allowed by the
    stored mask, and by Taxi's own ``action_mask(state)`` computed independently."""
    import gymnasium

    from oakemu_core.actor.stepper import PolicyStepper
    from oakemu_core.envs import make_vector_env
    from oakemu_core.policy.distributions import distribution_for_env
    from oakemu_core.policy.models import build_model

    env = make_vector_env("Taxi-v4", 4, seed=3)
    references = [gymnasium.make("Taxi-v4").unwrapped for _ in range(4)]
    try:
        assert env.spec.action_mask_width == 6
        model = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
        stepper = PolicyStepper(env, model)
        taken = 0
        for _ in range(500):
            row = stepper.step()
            actions, masks = row.buffers.actions, row.buffers.extras["action_mask"]
            assert masks[np.arange(4), actions].all()
            states = np.argmax(row.buffers.observations, axis=1)
            for env_index, state in enumerate(states):
                expected = references[env_index].action_mask(int(state)).astype(bool)
                np.testing.assert_array_equal(masks[env_index], expected)
                assert expected[actions[env_index]]
                taken += 1
        assert taken == 2000
    finally:
        env.close()
