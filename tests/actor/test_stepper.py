"""PolicyStepper on a real Gymnasium CartPole with a short time limit: truncation reaches GAE.

The expected values come from an independent replay: the same CartPole envs (``gymnasium.make``,
seeded ``seed + i`` as the vector env seeds env ``i``) stepped one by one with the actions the
stepper recorded, resetting after each finished episode as Gymnasium's same-step autoreset does.
The replay gives the true final observation of every episode and the reset observation that
replaced it, so ``bootstrap_values`` can be checked against the model's value of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium
import numpy as np
import pytest
import torch

from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.envs import EnvSpec, make_vector_env
from oakemu_core.envs.factory import make_env_groups
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.step_schema import StepSchema
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step

SEED = 7
GAMMA = 0.99
GAE_LAMBDA = 0.95
VALUE_TOLERANCE = 1e-5  # one observation alone vs. in a batch: float32 rounding only


@dataclass
class Row:
    """Copies of one stepper row (the stepper reuses its arrays)."""

    observations: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    truncated: np.ndarray
    bootstrap_values: np.ndarray
    trainable: np.ndarray
    next_values: np.ndarray
    policy_version: int
    episode_returns: list[float]
    episode_lengths: list[int]
    fields: dict[str, np.ndarray]  # what a step message carries (sent_fields), copied


@dataclass
class Replay:
    """What the reference replay saw at each step (arrays ``(steps, n, ...)``)."""

    observations: np.ndarray  # observation each action was chosen on
    terminated: np.ndarray
    truncated: np.ndarray
    final_observations: np.ndarray  # true last observation where the episode ended, else NaN
    reset_observations: (
        np.ndarray
    )  # first observation of the next episode where one ended, else NaN


def run_stepper(
    max_episode_steps: int, num_envs: int, steps: int, groups: int = 1
) -> tuple[ActorCritic, list[Row], StepSchema]:
    torch.manual_seed(SEED)
    model = build_model((4,), np.float32, 2)
    env = (
        make_vector_env("CartPole-v1", num_envs, seed=SEED, max_episode_steps=max_episode_steps)
        if groups == 1
        else make_env_groups(
            "CartPole-v1", num_envs, groups, seed=SEED, max_episode_steps=max_episode_steps
        )
    )
    rows: list[Row] = []
    try:
        stepper = PolicyStepper(env, model, policy_version=3)
        for _ in range(steps):
            row = stepper.step()
            b = row.buffers
            rows.append(
                Row(
                    b.observations.copy(),
                    b.actions.copy(),
                    b.log_probs.copy(),
                    b.values.copy(),
                    b.rewards.copy(),
                    b.dones.copy(),
                    b.truncated.copy(),
                    b.bootstrap_values.copy(),
                    b.trainable.copy(),
                    row.next_values.copy(),
                    row.policy_version,
                    list(row.env_step.episode_returns),
                    list(row.env_step.episode_lengths),
                    {
                        k: v.copy()
                        for k, v in b.sent_fields(row.next_values, stepper.schema).items()
                    },
                )
            )
        schema = stepper.schema
    finally:
        env.close()
    return model, rows, schema


def replay(rows: list[Row], max_episode_steps: int, num_envs: int) -> Replay:
    steps = len(rows)
    observations = np.zeros((steps, num_envs, 4), np.float32)
    terminated = np.zeros((steps, num_envs), bool)
    truncated = np.zeros((steps, num_envs), bool)
    final = np.full((steps, num_envs, 4), np.nan, np.float32)
    reset = np.full((steps, num_envs, 4), np.nan, np.float32)
    for i in range(num_envs):
        env = gymnasium.make("CartPole-v1", max_episode_steps=max_episode_steps)
        observation, _ = env.reset(seed=SEED + i)
        for t, row in enumerate(rows):
            observations[t, i] = observation
            observation, _, term, trunc, _ = env.step(int(row.actions[i]))
            terminated[t, i], truncated[t, i] = term, trunc
            if term or trunc:
                final[t, i] = observation
                observation, _ = env.reset()
                reset[t, i] = observation
        env.close()
    return Replay(observations, terminated, truncated, final, reset)


@pytest.mark.parametrize(
    ("max_episode_steps", "num_envs", "steps", "groups"),
    [(5, 2, 10, 1), (30, 3, 90, 1), (5, 2, 10, 2), (30, 5, 90, 2), (30, 5, 60, 3)],
)
def test_stepper_rows_match_a_replay_of_the_same_envs(
    max_episode_steps: int, num_envs: int, steps: int, groups: int
) -> None:
    """Also with overlapped env groups: every env steps exactly once per vector step,
    with its own action, and env i stays column i."""
    model, rows, schema = run_stepper(max_episode_steps, num_envs, steps, groups)
    ref = replay(rows, max_episode_steps, num_envs)
    assert schema == schema_for_env(EnvSpec.discrete("CartPole-v1", (4,), np.float32, 2))

    for t, row in enumerate(rows):
        np.testing.assert_array_equal(row.observations, ref.observations[t])
        np.testing.assert_array_equal(row.dones, ref.terminated[t] | ref.truncated[t])
        np.testing.assert_array_equal(row.truncated, ref.truncated[t] & ~ref.terminated[t])
        np.testing.assert_array_equal(
            row.rewards, np.ones(num_envs, np.float32)
        )  # CartPole: +1 per step
        assert row.trainable.all() and row.policy_version == 3
        # next_values of step t are the values of the bundle that acts on step t + 1.
        if t + 1 < len(rows):
            np.testing.assert_array_equal(row.next_values, rows[t + 1].values)
        for i in range(num_envs):
            if row.truncated[i]:
                true_final = model.predict_values(ref.final_observations[t, i][None])[0]
                after_reset = model.predict_values(ref.reset_observations[t, i][None])[0]
                assert row.bootstrap_values[i] == pytest.approx(true_final, abs=VALUE_TOLERANCE)
                assert abs(row.bootstrap_values[i] - after_reset) > 100 * VALUE_TOLERANCE
            else:  # terminated (no future value) or still running
                assert row.bootstrap_values[i] == 0.0

    truncated_rows = int(sum(r.truncated.sum() for r in rows))
    terminated_rows = int(ref.terminated.sum())
    if max_episode_steps == 5:
        # A random policy cannot drop the pole within 5 steps: every episode is cut by the limit.
        assert terminated_rows == 0 and truncated_rows == num_envs * steps // 5
        assert [r.truncated.all() for r in rows] == [(t + 1) % 5 == 0 for t in range(steps)]
    else:
        assert terminated_rows > 0 and truncated_rows > 0, (terminated_rows, truncated_rows)
    episode_count = sum(len(r.episode_returns) for r in rows)
    assert episode_count == terminated_rows + truncated_rows
    for r in rows:
        assert r.episode_returns == [
            float(n) for n in r.episode_lengths
        ]  # CartPole return = length


def test_truncation_reaches_gae_through_the_assembler() -> None:
    """Rows of a 5-step time limit go through RolloutAssembler into a buffer; GAE bootstraps each
    truncated row from V(true final observation), not from V(reset observation)."""
    num_envs, steps = 2, 10
    model, rows, schema = run_stepper(5, num_envs, steps)
    ref = replay(rows, 5, num_envs)
    step_spec = StepSpec(num_envs=num_envs, schema=schema)
    buffers = [RolloutBuffer(steps, num_envs, schema=schema) for _ in range(2)]
    try:
        assembler = RolloutAssembler(buffers, actor_timeout_s=10.0)
        assembler.join("actor-0", "inc", step_spec, hostname="test", now=0.0)
        for seq, row in enumerate(rows):
            # The actor's path: the step buffers' sent fields, over the wire, decoded against the spec.
            assert set(row.fields) == {f.name for f in schema.sent}
            np.testing.assert_array_equal(row.fields["next_values"], row.next_values)
            np.testing.assert_array_equal(row.fields["truncated"], row.truncated)
            frame = encode_step(
                StepMessage(
                    actor_id="actor-0",
                    incarnation="inc",
                    seq=seq,
                    policy_version=row.policy_version,
                    fields=row.fields,
                    episode_returns=row.episode_returns,
                    episode_lengths=row.episode_lengths,
                ),
                step_spec,
            )
            message = decode_step(frame, assembler.spec_for, max_bytes=1 << 20)
            assembler.ingest(message, current_policy_version=3, now=0.0)
        rollout = assembler.take_full_rollout()
        assert rollout is not None
        buffer = rollout.buffer
        buffer.compute_gae(rollout.last_values, rollout.last_dones, GAMMA, GAE_LAMBDA)
        advantages = buffer.advantages.copy()
    finally:
        for b in buffers:
            b.close()

    rewards = np.stack([r.rewards for r in rows]).astype(np.float64)
    values = np.stack([r.values for r in rows]).astype(np.float64)
    truncated = np.stack([r.truncated for r in rows])
    assert truncated[4].all() and truncated[9].all()  # rows 4 and 9 end every episode
    for t in (4, 9):
        for i in range(num_envs):
            v_final = float(model.predict_values(ref.final_observations[t, i][None])[0])
            v_reset = float(model.predict_values(ref.reset_observations[t, i][None])[0])
            by_hand = rewards[t, i] + GAMMA * v_final - values[t, i]
            assert advantages[t, i] == pytest.approx(by_hand, abs=1e-4)
            wrong = rewards[t, i] + GAMMA * v_reset - values[t, i]
            assert abs(advantages[t, i] - wrong) > 1e-3
    # Row 3 of env 0, by hand: delta_3 = r + gamma V(s_4) - V(s_3) (not done), then + gamma lambda A_4.
    delta_3 = rewards[3, 0] + GAMMA * values[4, 0] - values[3, 0]
    assert advantages[3, 0] == pytest.approx(
        delta_3 + GAMMA * GAE_LAMBDA * advantages[4, 0], abs=1e-4
    )


def test_masked_multi_discrete_stepper_never_sends_a_masked_action_to_the_env() -> None:
    """MaskedMultiDiscrete-v0 raises on a masked action; 4 envs x 40 steps cover 20 autoresets, after
    which the new episode's mask must be the one recorded. Every row passes the wire's checks."""
    import tests.spaces_envs  # noqa: F401 - registers the ids

    env = make_vector_env("MaskedMultiDiscrete-v0", 4, seed=3)
    try:
        schema = schema_for_env(env.spec)
        assert schema["action_mask"].shape == (7,) and schema["action_mask"].mask_segments == (3, 4)
        torch.manual_seed(0)
        model = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
        stepper = PolicyStepper(env, model)
        spec = StepSpec(4, schema)
        episodes = 0
        for seq in range(40):
            expected_masks = env.action_masks().copy()
            row = stepper.step()
            masks = row.buffers.extras["action_mask"]
            np.testing.assert_array_equal(masks, expected_masks)
            actions = row.buffers.actions
            assert (
                masks[np.arange(4), actions[:, 0]].all()
                and masks[np.arange(4), 3 + actions[:, 1]].all()
            )
            episodes += len(row.env_step.episode_returns)
            frame = encode_step(
                StepMessage("a", "b", seq, 0, row.buffers.sent_fields(row.next_values, schema)),
                spec,
            )
            decode_step(frame, lambda *_: spec, max_bytes=1 << 20)
        assert episodes == 4 * 40 // 8
    finally:
        env.close()


def test_reselect_follows_the_weights_revision_as_well_as_the_version() -> None:
    """Weights published within an update keep the version number: the pending action is chosen
    again when the revision moves, once, and again when the version moves."""
    env = make_vector_env("CartPole-v1", 2, seed=0)
    try:
        torch.manual_seed(0)
        stepper = PolicyStepper(
            env, build_model(env.spec.observation_layout, distribution_for_env(env.spec))
        )
        assert not stepper.reselect()  # the pending action comes from these weights
        stepper.weights_revision = 1
        assert stepper.reselect() and not stepper.reselect()
        stepper.policy_version, stepper.weights_revision = 1, 0
        assert stepper.reselect() and not stepper.reselect()
    finally:
        env.close()


@pytest.mark.parametrize("groups", [1, 2])
def test_rows_carry_the_revision_of_the_weights_that_acted(groups: int) -> None:
    """A row's ``(policy_version, policy_revision)`` is that of the bundle that chose its actions:
    weights loaded after the next bundle was chosen act from the step after (with two env groups
    the row takes the oldest group's)."""
    env = (
        make_vector_env("CartPole-v1", 4, seed=0)
        if groups == 1
        else make_env_groups("CartPole-v1", 4, groups, seed=0)
    )
    try:
        torch.manual_seed(0)
        stepper = PolicyStepper(
            env,
            build_model(env.spec.observation_layout, distribution_for_env(env.spec)),
            policy_version=3,
        )
        acted = []
        for step in range(5):
            if step == 2:
                stepper.weights_revision = 2
            if step == 4:
                stepper.policy_version, stepper.weights_revision = 4, 0
            row = stepper.step()
            acted.append((row.policy_version, row.policy_revision))
        assert acted == [(3, 0), (3, 0), (3, 0), (3, 2), (3, 2)]
        assert (stepper.step().policy_version, stepper.step().policy_revision) == (4, 0)
    finally:
        env.close()


class ForcingBackend:
    """A CartPole backend that plays action 0 on env 0 every other step whatever it is sent (as Atari's FIRE
    after a lost life), and keeps the actions it played."""

    def __init__(self, backend) -> None:
        self._backend, self.spec, self.num_envs = backend, backend.spec, backend.num_envs
        self.steps, self.played = 0, []

    def reset(self, seed):
        return self._backend.reset(seed)

    def forced_actions(self):
        return (np.array([0]), np.zeros(1, self.spec.action_dtype)) if self.steps % 2 == 0 else None

    def step(self, actions):
        if self.forced_actions() is not None:
            actions = actions.copy()
            actions[0] = 0
        self.steps += 1
        self.played.append(actions.copy())
        return self._backend.step(actions)

    def close(self) -> None:
        self._backend.close()


@pytest.mark.parametrize("routed", [False, True])
def test_rows_whose_action_the_env_forces_store_that_action_non_trainable(routed: bool) -> None:
    """The row stores the action the env played, log pi of it by the acting policy, trainable False; routing
    applies to the other rows; an env that forces nothing (CartPole) is unaffected."""
    from oakemu_core.actor.routing import PolicyRouter, RoutingConfig
    from oakemu_core.envs.vector import VectorEnv

    plain = make_vector_env("CartPole-v1", 3, seed=SEED)
    backend = ForcingBackend(plain._backend)
    env = VectorEnv(backend, seed=SEED, clip_rewards=False)
    torch.manual_seed(0)
    model = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
    router = (
        PolicyRouter(env.spec, 3, RoutingConfig(random_probability=0.5), seed=0) if routed else None
    )
    try:
        plain.reset()
        assert plain.forced_actions() is None
        stepper = PolicyStepper(env, model, router=router)
        observations, actions, log_probs, trainable = [], [], [], []
        for _ in range(40):
            b = stepper.step().buffers
            for kept, value in zip(
                (observations, actions, log_probs, trainable),
                (b.observations, b.actions, b.log_probs, b.trainable),
                strict=True,
            ):
                kept.append(value.copy())
    finally:
        env.close()
    actions, trainable = np.stack(actions), np.stack(trainable)
    np.testing.assert_array_equal(
        actions, np.stack(backend.played)
    )  # the stored actions are the played ones
    forced = np.zeros_like(trainable)
    forced[::2, 0] = True
    assert (actions[forced] == 0).all() and not trainable[forced].any()
    with torch.no_grad():
        policy, _ = model.policy_and_values(torch.from_numpy(np.stack(observations).reshape(-1, 4)))
        expected = (
            policy.log_prob(torch.from_numpy(actions.reshape(-1))).numpy().reshape(actions.shape)
        )
    np.testing.assert_allclose(np.stack(log_probs), expected, atol=1e-5)
    if routed:
        assert 0.3 < trainable[~forced].mean() < 0.7
    else:
        assert trainable[~forced].all()
