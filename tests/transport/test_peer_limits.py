"""What the learner takes from a peer beyond the wire's own checks (oakemu_core.transport.peer_limits),
the step rings' memory limits (oakemu_core.transport.step_ring.StepRings) and the joins per host
(oakemu_core.transport.peer_limits.JoinRate), without sockets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oakemu_core.config import OakEmuConfig
from oakemu_core.envs import env_spec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.transport import peer_limits
from oakemu_core.transport.control import JoinRequest
from oakemu_core.transport.peer_limits import VALUE_BOUND_FACTOR, JoinRate, PeerLimits
from oakemu_core.transport.step_ring import StepRing, StepRingRefused, StepRings, ring_slots
from oakemu_core.transport.steps import StepMessage, StepSpec

SCHEMA = schema_for_env(env_spec("CartPole-v1"))
SHM = Path("/dev/shm")


def step(num_envs: int = 4, k: int = 1, **values: Any) -> StepMessage:
    """A CartPole step message of zeros, with ``values`` (name -> array or scalar) filled in."""
    spec = StepSpec(num_envs=num_envs, schema=SCHEMA, steps_per_message=k)
    fields = {name: np.zeros(shape, dtype) for name, (dtype, shape) in spec.array_layout().items()}
    for name, value in values.items():
        fields[name][...] = value
    return StepMessage("a", "inc", 0, 0, fields)


def limits(**settings: Any) -> PeerLimits:
    return PeerLimits.from_config(OakEmuConfig(env_id="CartPole-v1", **settings))


def test_without_a_reward_bound_only_the_episode_bookkeeping_is_checked() -> None:
    free = limits()
    assert (free.reward_bound, free.return_bound, free.value_bound) == (None, None, None)
    assert free.check_step(step(rewards=1e6, values=-1e6)) is None  # the schema's own bounds apply
    dones = np.array([True, False, False, False])
    assert (
        free.check_step(replace(step(dones=dones), episode_returns=[3.0], episode_lengths=[3]))
        is None
    )
    fake = replace(step(dones=dones), episode_returns=[3.0, 4.0], episode_lengths=[3, 4])
    assert "at most one episode per done row (1), received 2" in free.check_step(fake)
    empty = replace(step(dones=dones), episode_returns=[0.0], episode_lengths=[0])
    assert "episode_lengths" in free.check_step(empty)
    capped = limits(max_episode_steps=100)
    assert "expected 1..100 steps, received 101" in capped.check_step(
        replace(step(dones=dones), episode_returns=[1.0], episode_lengths=[101])
    )


def test_a_declared_reward_range_bounds_rewards_values_and_episode_returns() -> None:
    """CartPole's reward is 1 per step: [0, 1], gamma 0.99 -> |value| <= 10 * 1 / 0.01 = 1000."""
    bounded = limits(reward_low=0.0, reward_high=1.0)
    assert bounded.reward_bound == (0.0, 1.0) and bounded.return_bound == (0.0, 1.0)
    assert (
        bounded.value_bound
        == pytest.approx(VALUE_BOUND_FACTOR * 1.0 / (1 - 0.99))
        == pytest.approx(1000.0)
    )
    assert bounded.check_step(step(k=4, rewards=1.0, values=999.0, next_values=-999.0)) is None
    assert "rewards: expected values in [0, 1]" in bounded.check_step(step(rewards=1.5))
    assert "rewards" in bounded.check_step(step(rewards=np.array([0.0, 1.0, -0.1, 0.5])))
    assert "values: expected values in [-1000, 1000]" in bounded.check_step(step(values=1001.0))
    assert "bootstrap_values" in bounded.check_step(step(bootstrap_values=-2000.0))
    dones = np.array([True, True, False, False])
    fine = replace(step(dones=dones), episode_returns=[0.0, 200.0], episode_lengths=[1, 200])
    assert bounded.check_step(fine) is None
    absurd = replace(step(dones=dones), episode_returns=[1.1e14], episode_lengths=[500])
    assert "an episode of 500 steps returns within [0, 500]" in bounded.check_step(absurd)
    negative = replace(step(dones=dones), episode_returns=[-1.0], episode_lengths=[10])
    assert "episode_returns" in bounded.check_step(negative)


def test_reward_clipping_bounds_rewards_and_values_but_not_raw_returns() -> None:
    clipped = limits(clip_rewards=True)
    assert clipped.reward_bound == (-1.0, 1.0) and clipped.return_bound is None
    assert clipped.value_bound == pytest.approx(1000.0)
    assert clipped.check_step(step(rewards=-1.0)) is None and "rewards" in clipped.check_step(
        step(rewards=2.0)
    )
    big_score = replace(
        step(dones=np.array([True, False, False, False])),
        episode_returns=[864.0],
        episode_lengths=[9],
    )
    assert clipped.check_step(big_score) is None  # a raw game score: clipping says nothing about it
    both = limits(clip_rewards=True, reward_low=0.0, reward_high=7.0)  # the declared range, clipped
    assert both.reward_bound == (0.0, 1.0) and both.return_bound == (0.0, 7.0)
    assert (
        limits(clip_rewards=True, normalize_rewards=True).value_bound is None
    )  # the learner's scale
    assert limits(clip_rewards=True, gamma=1.0).value_bound is None


def test_join_limits_and_the_reward_range_setting() -> None:
    run = limits(max_connected_actors=3)
    assert run.check_join(JoinRequest("a", "i", 1024, "h"), connected=0, known=False) is None
    assert "max_envs_per_actor=1024, received 65536" in run.check_join(
        JoinRequest("a", "i", 65_536, "h"), connected=0, known=False
    )
    assert "max_connected_actors=3" in run.check_join(
        JoinRequest("d", "i", 2, "h"), connected=3, known=False
    )
    assert run.check_join(JoinRequest("a", "i", 2, "h"), connected=3, known=True) is None
    with pytest.raises(ValueError, match="reward_low / reward_high"):
        OakEmuConfig(env_id="CartPole-v1", reward_low=1.0)
    with pytest.raises(ValueError, match="reward_low / reward_high"):
        OakEmuConfig(env_id="CartPole-v1", reward_low=1.0, reward_high=0.0)


# --- step rings' memory ------------------------------------------------------------------------------


def ring_spec(num_envs: int) -> StepSpec:
    return StepSpec(num_envs=num_envs, schema=SCHEMA, steps_per_message=1)


def test_step_rings_are_capped_per_actor_and_in_total_and_freed_when_an_actor_times_out() -> None:
    rollout = 64
    size = StepRing.segment_bytes(ring_spec(64), ring_slots(1, rollout))
    rings = StepRings(max_bytes=3 * size, max_bytes_per_actor=size)
    try:
        with pytest.raises(StepRingRefused, match="step_ring_max_mib_per_actor"):
            rings.offer("greedy", "i", ring_spec(65), rollout)
        offers = [rings.offer(f"a{i}", "i", ring_spec(64), rollout) for i in range(3)]
        assert rings.used_bytes == 3 * size and all((SHM / o.name).exists() for o in offers)
        with pytest.raises(StepRingRefused, match="step_ring_max_mib "):
            rings.offer("a3", "i", ring_spec(64), rollout)
        # a0 rejoins (a new incarnation): its old ring departs, and is freed to make room at once
        rings.offer("a0", "j", ring_spec(32), rollout)
        assert not (SHM / offers[0].name).exists() and rings.get("a0", "i") is None
        # a1 timed out: its ring is unlinked and unmapped at once; a2 left: kept mapped for late messages
        rings.retain({("a0", "j")}, free={"a1"})
        assert rings.get("a1", "i") is None and not (SHM / offers[1].name).exists()
        assert (
            rings.get("a2", "i") is not None
            and not (SHM / offers[2].name).exists()
            and len(rings) == 1
        )
        assert rings.used_bytes == size + StepRing.segment_bytes(
            ring_spec(32), ring_slots(1, rollout)
        )
        rings.offer("a4", "i", ring_spec(64), rollout)  # fits beside the departed ring
        assert rings.get("a2", "i") is not None
        rings.offer("a5", "i", ring_spec(64), rollout)  # room made by freeing the departed ring
        assert rings.get("a2", "i") is None and rings.used_bytes <= 3 * size
    finally:
        rings.close()
    assert rings.used_bytes == 0


# --- joins per host ------------------------------------------------------------------------------------


def test_a_hosts_joins_are_a_token_bucket_of_its_burst_refilled_at_its_rate() -> None:
    rate = JoinRate(per_second=4.0, burst=3)
    assert [rate.take("h", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.take("h", 0.0) == pytest.approx(0.25), "the seconds until the next token"
    assert rate.take("h", 0.1) == pytest.approx(0.15), "a refused join takes no token"
    assert rate.take("other", 0.1) == 0.0, "each host its own bucket"
    assert rate.take("h", 0.25) == 0.0 and rate.take("h", 0.25) > 0.0
    assert [rate.take("h", 100.0) for _ in range(4)][-1] > 0.0, "refilled to the burst, not beyond"
    with pytest.raises(ValueError):
        JoinRate(per_second=0.0)


def test_join_buckets_of_hosts_that_refilled_are_forgotten_beyond_the_tracked_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peer_limits, "MAX_TRACKED_HOSTS", 4)
    rate = JoinRate(per_second=1.0, burst=2)
    for i in range(4):
        rate.take(f"h{i}", 0.0)
    rate.take("busy", 9.0)
    rate.take("busy", 9.0)  # empty: kept
    rate.take("new", 10.0)  # the fifth bucket: the refilled ones go
    assert set(rate._buckets) <= {"busy", "new"} and "busy" in rate._buckets
