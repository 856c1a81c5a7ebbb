"""Policy routing (oakemu_core/actor/routing.py): routed steps are stored and counted, never trained on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.actor.routing import (
    ROUTE_POLICY,
    ROUTE_RANDOM,
    ROUTE_SCRIPTED,
    PolicyRouter,
    RoutingConfig,
    load_callable,
    random_actions,
)
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.algo.losses import normalize_advantages
from oakemu_core.algo.ppo import EmptyRolloutError, PPOUpdater
from oakemu_core.envs import EnvSpec, env_spec, make_vector_env
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.storage.rollout_buffer import RolloutBuffer

T, N = 64, 4


def scripted_push_left(observations: np.ndarray, action_mask: np.ndarray | None) -> np.ndarray:
    """A scripted CartPole policy for ``route_scripted_policy``: always action 0."""
    assert action_mask is None
    return np.zeros(len(observations), np.int64)


def scripted_wrong_shape(observations: np.ndarray, action_mask: np.ndarray | None) -> np.ndarray:
    return np.zeros((len(observations), 3), np.int64)


class _RecordingEnv:
    """Wraps a VectorEnv and keeps every action it was stepped with."""

    def __init__(self, env) -> None:
        self._env = env
        self.spec = env.spec
        self.num_envs = env.num_envs
        self.actions: list[np.ndarray] = []

    def reset(self):
        return self._env.reset()

    def action_masks(self):
        return self._env.action_masks()

    def forced_actions(self):
        return self._env.forced_actions()

    def step(self, actions):
        self.actions.append(np.array(actions))
        return self._env.step(actions)

    def close(self) -> None:
        self._env.close()


def _model(spec: EnvSpec, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(spec.observation_layout, distribution_for_env(spec))
    model.eval()
    return model


def _fill(stepper: PolicyStepper, buffer: RolloutBuffer, gamma: float = 0.99) -> list[np.ndarray]:
    """Step T times into ``buffer``, compute GAE; returns the trainable flags of every row."""
    flags = []
    row = None
    for _ in range(buffer.rollout_length):
        row = stepper.step()
        flags.append(row.buffers.trainable.copy())
        row.buffers.add_to_rollout_buffer(buffer, policy_version=stepper.policy_version)
    assert row is not None
    buffer.compute_gae(row.next_values, row.buffers.dones.copy(), gamma, 0.95)
    return flags


# ---------------------------------------------------------------------------------------------
def test_routing_config_checks_its_fields() -> None:
    assert not RoutingConfig().active
    assert RoutingConfig(random_first_steps=3).active
    with pytest.raises(ValueError, match="route_random_probability"):
        RoutingConfig(random_probability=1.5)
    with pytest.raises(ValueError, match="route_random_first_steps"):
        RoutingConfig(random_first_steps=-1)
    with pytest.raises(ValueError, match="both set"):
        RoutingConfig(scripted_policy="tests.actor.test_routing:scripted_push_left")
    with pytest.raises(ValueError, match="module:callable"):
        RoutingConfig(scripted_policy="no_colon", scripted_probability=0.5)
    config = RoutingConfig(
        random_first_steps=2,
        random_probability=0.1,
        scripted_policy="tests.actor.test_routing:scripted_push_left",
        scripted_probability=0.5,
    )
    assert RoutingConfig.from_mapping(config.to_env_config()) == config
    assert (
        RoutingConfig.from_mapping({"env_id": "CartPole-v1"}) == RoutingConfig()
    )  # an older learner


def test_the_config_model_and_the_join_reply_carry_the_route_settings() -> None:
    from oakemu_core.config import ConfigError, load_config

    config = load_config(["--route-random-first-steps", "30", "--route-random-probability", "0.05"])
    assert RoutingConfig.from_mapping(config) == RoutingConfig(
        random_first_steps=30, random_probability=0.05
    )
    with pytest.raises(ConfigError, match="route_scripted_policy"):
        load_config(["--route-scripted-probability", "0.5"])


def test_load_callable_names_what_is_wrong() -> None:
    assert load_callable("tests.actor.test_routing:scripted_push_left") is scripted_push_left
    with pytest.raises(ValueError, match="expected 'module:callable'"):
        load_callable("tests.actor.test_routing")
    with pytest.raises(ValueError, match="no_such_module"):
        load_callable("no_such_module:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_callable("tests.actor.test_routing:missing")
    with pytest.raises(ValueError, match="expected a callable"):
        load_callable("tests.actor.test_routing:T")


@pytest.mark.parametrize(
    "env_id",
    [
        "Taxi-v4",
        "tests.spaces_envs:MaskedMultiDiscrete-v0",
        "tests.spaces_envs:MultiBinaryTarget-v0",
        "Pendulum-v1",
    ],
)
def test_random_actions_are_in_the_space_and_allowed_by_the_masks(env_id: str) -> None:
    spec = env_spec(env_id)
    rng = np.random.default_rng(0)
    count = 2000
    masks = None
    if spec.has_action_masks:
        masks = rng.random((count, spec.action_mask_width)) < 0.5
        offset = 0
        for size in spec.action_mask_segments:  # at least one allowed value per sub-action
            masks[np.arange(count), offset + rng.integers(0, size, count)] = True
            offset += size
    actions = random_actions(spec, count, rng, masks)
    assert actions.shape == (count, *spec.action_shape) and actions.dtype == spec.action_dtype
    if spec.action_kind == "box":
        assert np.all(actions >= spec.action_space.low) and np.all(
            actions <= spec.action_space.high
        )
        uniform_std = (spec.action_space.high - spec.action_space.low) / np.sqrt(12)
        assert actions.std(axis=0) == pytest.approx(
            uniform_std, rel=0.1
        )  # uniform within the bounds
        return
    columns = actions.reshape(count, -1)
    offset = 0
    for j, size in enumerate(spec.action_mask_segments):
        assert columns[:, j].min() >= 0 and columns[:, j].max() < size
        if masks is not None:
            assert masks[np.arange(count), offset + columns[:, j]].all()  # never a masked value
        assert (
            len(np.unique(columns[:, j])) == size
        )  # and every value shows up (uniform over allowed)
        offset += size


def test_router_routes_the_first_steps_of_each_episode_and_a_share_of_the_rest() -> None:
    spec = env_spec("CartPole-v1")
    router = PolicyRouter(spec, 3, RoutingConfig(random_first_steps=2), seed=0)
    seen = []
    for dones in (
        [False, False, False],
        [False, True, False],
        [False, False, False],
        [False, False, False],
    ):
        seen.append(router.decide().tolist())
        router.end_step(np.array(dones))
    random_, policy = ROUTE_RANDOM, ROUTE_POLICY
    assert seen == [
        [random_] * 3,
        [random_] * 3,
        [policy, random_, policy],
        [policy, random_, policy],
    ]

    router = PolicyRouter(
        spec,
        1000,
        RoutingConfig(
            random_probability=0.2,
            scripted_policy="tests.actor.test_routing:scripted_push_left",
            scripted_probability=0.5,
        ),
        seed=1,
    )
    routes = router.decide()
    shares = [np.mean(routes == code) for code in (ROUTE_POLICY, ROUTE_RANDOM, ROUTE_SCRIPTED)]
    assert shares == pytest.approx([0.8 * 0.5, 0.2, 0.8 * 0.5], abs=0.05)


def test_random_controlled_rows_are_stored_non_trainable_and_excluded_from_advantage_statistics() -> (
    None
):
    spec = env_spec("CartPole-v1")
    env = _RecordingEnv(make_vector_env("CartPole-v1", N, seed=3))
    model = _model(spec)
    router = PolicyRouter(
        spec, N, RoutingConfig(random_first_steps=10, random_probability=0.25), seed=0
    )
    stepper = PolicyStepper(env, model, router=router)
    with RolloutBuffer(T, N, schema=schema_for_env(spec), seed=0) as buffer:
        flags = np.array(_fill(stepper, buffer))
        trainable = buffer.trainable.copy()
        # Stored: every row holds the action the env received, routed or not; routed rows are flagged.
        np.testing.assert_array_equal(buffer.actions, np.stack(env.actions))
        np.testing.assert_array_equal(trainable, flags)
        routed = ~trainable
        assert routed[:10].all()  # the first 10 steps of every first episode
        assert 0.2 < routed[10:].mean() < 0.7  # 25 % random plus episode starts
        assert trainable.any()
        # Counted per decision; the stepper has already decided the next step's N actions.
        assert sum(router.counts.values()) == (T + 1) * N
        assert 0 <= router.counts["random"] - int(routed.sum()) <= N
        # Routed rows carry the policy's values (needed for GAE) and log pi of the routed action.
        assert np.isfinite(buffer.values).all() and np.isfinite(buffer.log_probs).all()
        assert (buffer.log_probs <= 0).all()

        # Advantage statistics over trainable rows only: mean 0, std 1 there
        # (the update normalises the flat batch's advantages, which hold the trainable rows only).
        normalised = normalize_advantages(buffer.flat_batch("cpu").fields["advantages"]).numpy()
        assert normalised.size == int(trainable.sum())
        assert normalised.mean() == pytest.approx(0.0, abs=1e-5)
        assert normalised.std() == pytest.approx(1.0, abs=1e-3)
        raw = buffer.advantages[trainable]
        assert not np.isclose(
            raw.mean(), buffer.advantages.mean()
        )  # the routed rows would change them

        # Minibatches hold exactly the trainable rows.
        flat = buffer.flat_batch("cpu")
        np.testing.assert_array_equal(np.sort(flat.rows), np.flatnonzero(trainable.reshape(-1)))
        diagnostics = buffer.trainable_diagnostics()
        assert diagnostics is not None and diagnostics.advantages.size == int(trainable.sum())

        # PPO on it: the first minibatch's ratio is 1 (on-policy rows only), the update runs.
        trained = _model(spec)
        trained.load_state_dict(model.state_dict())
        updater = PPOUpdater(
            trained,
            torch.optim.Adam(trained.parameters(), lr=2.5e-4, eps=1e-5),
            device="cpu",
            ppo_epochs=2,
            num_minibatches=4,
            clip_coef=0.2,
            ent_coef=0.0,
            vf_coef=0.5,
            max_grad_norm=0.5,
            seed=0,
        )
        stats = updater.step(buffer, current_policy_version=stepper.policy_version)
        assert stats.first_minibatch_ratio_max_abs_dev < 1e-5
        assert stats.trainable_rows == int(trainable.sum())
        assert not torch.equal(
            trained.critic.weight, model.critic.weight
        )  # the update trained the model
    env.close()


def test_a_scripted_policy_from_module_callable_controls_the_routed_envs() -> None:
    spec = env_spec("CartPole-v1")
    env = _RecordingEnv(make_vector_env("CartPole-v1", N, seed=5))
    config = RoutingConfig(
        scripted_policy="tests.actor.test_routing:scripted_push_left", scripted_probability=1.0
    )
    stepper = PolicyStepper(env, _model(spec), router=PolicyRouter(spec, N, config, seed=0))
    with RolloutBuffer(16, N, schema=schema_for_env(spec), seed=0) as buffer:
        _fill(stepper, buffer)
        assert (buffer.actions == 0).all() and (np.stack(env.actions) == 0).all()
        assert not buffer.trainable.any()
        assert (
            buffer.dones.any()
        )  # pushing left always ends CartPole episodes quickly: stored like any row
        with pytest.raises(EmptyRolloutError):
            PPOUpdater(
                _model(spec),
                torch.optim.Adam(_model(spec).parameters()),
                device="cpu",
                ppo_epochs=1,
                num_minibatches=1,
                clip_coef=0.2,
                ent_coef=0.0,
                vf_coef=0.5,
                max_grad_norm=0.5,
            ).step(buffer, current_policy_version=0)

    bad = RoutingConfig(
        scripted_policy="tests.actor.test_routing:scripted_wrong_shape", scripted_probability=1.0
    )
    with pytest.raises(ValueError, match=r"scripted_wrong_shape.*expected actions of shape \(4,\)"):
        PolicyStepper(
            make_vector_env("CartPole-v1", N, seed=5),
            _model(spec),
            router=PolicyRouter(spec, N, bad, seed=0),
        )


def test_routing_honours_action_masks_in_the_stepper() -> None:
    spec = env_spec("Taxi-v4")
    env = make_vector_env("Taxi-v4", N, seed=0)
    router = PolicyRouter(spec, N, RoutingConfig(random_probability=1.0), seed=0)
    stepper = PolicyStepper(env, _model(spec), router=router)
    with RolloutBuffer(32, N, schema=schema_for_env(spec), seed=0) as buffer:
        _fill(stepper, buffer)  # VectorEnv raises on any masked action
        masks = buffer.field("action_mask")
        assert masks[np.arange(32)[:, None], np.arange(N)[None, :], buffer.actions].all()
        assert not buffer.trainable.any()
    env.close()
