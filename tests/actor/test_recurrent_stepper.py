"""PolicyStepper with a recurrent (LSTM / GRU) policy on CartPole with a short time limit.

The expected rows come from an independent recompute: the model's sequence forward
(``model(observations, state0, resets)``: L steps of E envs, time-major, zeros before step 0 and the
state zeroed before a step whose previous step ended an episode) over the observations the stepper
recorded. The stepper itself acts one step at a time and zeroes the state after a done.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from oakemu_core.actor.routing import PolicyRouter, RoutingConfig
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.envs import make_vector_env
from oakemu_core.envs.factory import make_env_groups
from oakemu_core.envs.vector import VectorEnv
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec
from tests.actor.test_stepper import ForcingBackend

SEED = 5
N_ENVS = 3
TIME_LIMIT = 14  # truncations every 14 steps at most, and terminations (random CartPole)
TOLERANCE = 1e-5  # one step at a time vs. a sequence: float32 rounding only


def recurrent_model(env, kind: str = "lstm", seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    model = build_model(
        env.spec.observation_layout,
        distribution_for_env(env.spec),
        network=NetworkSpec(recurrent=kind, recurrent_hidden=16),
    )
    return model.eval()


@dataclass
class Rows:
    """Copies of the stepper's rows, stacked ``(T, E, ...)``."""

    observations: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    dones: np.ndarray
    truncated: np.ndarray
    bootstrap_values: np.ndarray
    trainable: np.ndarray
    policy_state: np.ndarray
    next_values: np.ndarray
    final_observations: np.ndarray
    next_observations: np.ndarray


def run(stepper: PolicyStepper, steps: int, *, segment_end_last: bool = False) -> Rows:
    kept: dict[str, list[np.ndarray]] = {name: [] for name in Rows.__dataclass_fields__}
    for t in range(steps):
        row = stepper.step(segment_end=segment_end_last and t == steps - 1)
        b = row.buffers
        for name, value in (
            ("observations", b.observations),
            ("actions", b.actions),
            ("log_probs", b.log_probs),
            ("values", b.values),
            ("dones", b.dones),
            ("truncated", b.truncated),
            ("bootstrap_values", b.bootstrap_values),
            ("trainable", b.trainable),
            ("policy_state", b.extras["policy_state"]),
            ("next_values", row.next_values),
            ("final_observations", row.env_step.final_observations),
            ("next_observations", row.env_step.observations),
        ):
            kept[name].append(np.array(value, copy=True))
    return Rows(**{name: np.stack(values) for name, values in kept.items()})


def resets_of(dones: np.ndarray) -> np.ndarray:
    """``(T, E)`` bool: zero the state before step t where step t - 1 ended an episode."""
    resets = np.zeros_like(dones)
    resets[1:] = dones[:-1]
    return resets


@torch.no_grad()
def sequence(model: ActorCritic, observations: np.ndarray, dones: np.ndarray, actions=None):
    """The sequence recompute from zeros: ``(values (T, E), log pi of actions (T, E) or None,
    state after the last step (E, S))``."""
    steps, envs = dones.shape
    obs = torch.from_numpy(observations.reshape(steps * envs, -1))
    state0 = torch.zeros(envs, model.state_size)
    resets = torch.from_numpy(resets_of(dones))
    head, values, final = model(obs, state0, resets)
    log_probs = None
    if actions is not None:
        policy = model.distribution.policy(head, None)
        log_probs = policy.log_prob(torch.from_numpy(actions.reshape(-1))).numpy()
        log_probs = log_probs.reshape(steps, envs)
    return values.numpy().reshape(steps, envs), log_probs, final.numpy()


@torch.no_grad()
def value_from(model: ActorCritic, observation: np.ndarray, state: np.ndarray) -> float:
    _, values, _ = model(torch.from_numpy(observation[None]), torch.from_numpy(state[None]))
    return float(values[0])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_rows_match_a_sequence_recompute(kind: str) -> None:
    """Stored states (zeros first, the state after the previous step, zeros after a done), values,
    log pi, truncation bootstraps (state before the zeroing) and the segment end's next value (state
    after it) all equal the sequence forward's."""
    env = make_vector_env("CartPole-v1", N_ENVS, seed=SEED, max_episode_steps=TIME_LIMIT)
    model = recurrent_model(env, kind)
    try:
        rows = run(PolicyStepper(env, model), 60, segment_end_last=True)
    finally:
        env.close()
    steps = rows.dones.shape[0]
    assert rows.truncated.any() and (rows.dones & ~rows.truncated).any()  # both kinds of end
    assert rows.policy_state.shape == (steps, N_ENVS, model.state_size)
    np.testing.assert_array_equal(rows.policy_state[0], 0.0)
    values, log_probs, _ = sequence(model, rows.observations, rows.dones, rows.actions)
    np.testing.assert_allclose(rows.values, values, atol=TOLERANCE)
    np.testing.assert_allclose(rows.log_probs, log_probs, atol=TOLERANCE)
    np.testing.assert_allclose(rows.next_values[:-1], rows.values[1:], atol=TOLERANCE)
    for t in range(steps):
        _, _, after = sequence(model, rows.observations[: t + 1], rows.dones[: t + 1])
        kept = np.where(rows.dones[t][:, None], 0.0, after)
        if t + 1 < steps:
            np.testing.assert_allclose(rows.policy_state[t + 1], kept, atol=TOLERANCE)
            assert (rows.policy_state[t + 1][rows.dones[t]] == 0).all()
        for e in np.flatnonzero(rows.truncated[t]):
            expected = value_from(model, rows.final_observations[t, e], after[e])
            assert rows.bootstrap_values[t, e] == pytest.approx(expected, abs=TOLERANCE)
        assert (rows.bootstrap_values[t][~rows.truncated[t]] == 0).all()
    last = steps - 1
    for e in range(N_ENVS):  # V(s_T) from the state the next row starts from
        expected = value_from(model, rows.next_observations[last, e], kept[e])
        assert rows.next_values[last, e] == pytest.approx(expected, abs=TOLERANCE)
    assert not np.allclose(rows.policy_state[1:], 0.0)  # the state does change


def test_new_weights_keep_the_state_and_reselect_chooses_from_it() -> None:
    """After new weights arrive mid-episode the pending bundle is chosen again from the same state
    (the old policy's state after the previous step), with the new weights' values."""
    env = make_vector_env("CartPole-v1", N_ENVS, seed=SEED, max_episode_steps=200)
    model = recurrent_model(env)
    old = copy.deepcopy(model)
    try:
        stepper = PolicyStepper(env, model)
        before = run(stepper, 3)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        stepper.policy_version = 1
        assert stepper.reselect()
        after = run(stepper, 1)
    finally:
        env.close()
    assert not before.dones.any()
    _, _, state = sequence(old, before.observations, before.dones)
    np.testing.assert_allclose(after.policy_state[0], state, atol=TOLERANCE)
    assert not np.allclose(state, 0.0)
    for e in range(N_ENVS):
        expected = value_from(model, after.observations[0, e], state[e])
        assert after.values[0, e] == pytest.approx(expected, abs=TOLERANCE)
        assert after.values[0, e] != pytest.approx(
            value_from(old, after.observations[0, e], state[e]), abs=TOLERANCE
        )


@pytest.mark.parametrize("routed", [False, True])
def test_routed_and_forced_rows_keep_the_state_and_log_pi_of_the_recurrent_policy(
    routed: bool,
) -> None:
    """Rows whose action the router or the env chose store that action, trainable False, and its
    log pi under the recurrent policy from the row's stored state; the states run on unchanged."""
    plain = make_vector_env("CartPole-v1", N_ENVS, seed=SEED, max_episode_steps=TIME_LIMIT)
    backend = ForcingBackend(plain._backend)
    env = VectorEnv(backend, seed=SEED, clip_rewards=False)
    model = recurrent_model(env)
    router = (
        PolicyRouter(env.spec, N_ENVS, RoutingConfig(random_probability=0.5), seed=0)
        if routed
        else None
    )
    try:
        rows = run(PolicyStepper(env, model, router=router), 30)
    finally:
        env.close()
    np.testing.assert_array_equal(rows.actions, np.stack(backend.played))
    forced = np.zeros_like(rows.trainable)
    forced[::2, 0] = True
    assert not rows.trainable[forced].any()
    if routed:
        assert 0.2 < rows.trainable[~forced].mean() < 0.8
    else:
        assert rows.trainable[~forced].all()
    values, log_probs, _ = sequence(model, rows.observations, rows.dones, rows.actions)
    np.testing.assert_allclose(rows.log_probs, log_probs, atol=TOLERANCE)
    np.testing.assert_allclose(rows.values, values, atol=TOLERANCE)
    for t in range(rows.dones.shape[0] - 1):
        _, _, after = sequence(model, rows.observations[: t + 1], rows.dones[: t + 1])
        kept = np.where(rows.dones[t][:, None], 0.0, after)
        np.testing.assert_allclose(rows.policy_state[t + 1], kept, atol=TOLERANCE)


def test_env_groups_are_refused_for_a_recurrent_policy() -> None:
    env = make_env_groups("CartPole-v1", 4, 2, seed=SEED)
    try:
        with pytest.raises(ValueError, match="recurrent policy is not supported with env groups"):
            PolicyStepper(env, recurrent_model(env))
    finally:
        env.close()


def test_step_buffers_refuse_a_bundle_without_the_state_of_a_recurrent_schema() -> None:
    """A feed-forward bundle for a recurrent run's buffers (its policy_state would stay zeros) and a
    recurrent bundle for a feed-forward run's are refused, nothing written."""
    from oakemu_core.actor.step_buffers import PPOActorStepBuffers
    from oakemu_core.policy.schemas import schema_for_env

    env = make_vector_env("CartPole-v1", 2, seed=SEED)
    try:
        recurrent = recurrent_model(env)
        feed_forward = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
        observations = env.reset()
    finally:
        env.close()
    trainable = np.ones(2, np.bool_)
    for acting, schema_network in ((feed_forward, recurrent.network), (recurrent, None)):
        buffers = PPOActorStepBuffers.create(
            num_envs=2, schema=schema_for_env(env.spec, schema_network)
        )
        state = recurrent.initial_state(2) + 1.0 if acting.recurrent else None
        bundle = acting.act(observations, state=state)
        with pytest.raises(ValueError, match="policy_state"):
            buffers.record_action_bundle(bundle, trainable=trainable)
        assert not buffers.trainable.any() and (buffers.log_probs == 0).all()
    buffers = PPOActorStepBuffers.create(
        num_envs=2, schema=schema_for_env(env.spec, recurrent.network)
    )
    bundle = recurrent.act(observations, state=recurrent.initial_state(2) + 1.0)
    buffers.record_action_bundle_for_env_ids(bundle, env_ids=[1, 0], trainable=[True, True])
    np.testing.assert_array_equal(buffers.extras["policy_state"], 1.0)


def test_an_actor_with_env_groups_refuses_a_recurrent_learner_policy_in_one_line() -> None:
    """An actor started with its own ``env_groups`` > 1 joining a learner whose policy is recurrent."""
    from types import SimpleNamespace

    from oakemu_core.actor.client import ActorSetupError
    from oakemu_core.actor.join_setup import make_stepper

    env = make_env_groups("CartPole-v1", 4, 2, seed=SEED)
    try:
        with pytest.raises(
            ActorSetupError, match="env_groups=2: the learner's policy is recurrent"
        ):
            make_stepper(env, recurrent_model(env), SimpleNamespace(spec=object()))
    finally:
        env.close()


def test_a_policy_that_computes_nan_stops_the_actor_in_one_line() -> None:
    """NaN outputs would be rejected by the learner step after step: the actor refuses them first."""
    from oakemu_core.actor.client import ActorSetupError
    from oakemu_core.envs.factory import make_vector_env
    from oakemu_core.policy.distributions import distribution_for_env
    from oakemu_core.policy.models import build_model

    env = make_vector_env("CartPole-v1", 2, seed=0)
    try:
        model = build_model(env.spec.observation_layout, distribution_for_env(env.spec))
        stepper = PolicyStepper(env, model)
        stepper.step()  # finite: steps
        with torch.no_grad():
            model.critic.bias.fill_(float("nan"))
        with pytest.raises(ActorSetupError, match="NaN or infinite log-prob or value"):
            stepper.step()
    finally:
        env.close()
