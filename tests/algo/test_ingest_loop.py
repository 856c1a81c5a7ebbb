"""The learner's ingest loop without sockets: the books of each step message, actor expiry, the
env-step budget and the stop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from oakemu_core.algo.handshake import RunProgress, TrainResult
from oakemu_core.algo.ingest_loop import EXPIRY_PERIOD_S, IngestLoop
from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.peer_limits import PeerLimits
from oakemu_core.transport.step_source import ForeignStep
from oakemu_core.transport.steps import StepMessage, StepSpec

T, N = 4, 4
SCHEMA = build_schema({"": ((2,), np.float32)}, Categorical(3))
SPEC = StepSpec(num_envs=2, schema=SCHEMA)
BUDGET = 100
TIMEOUT_S = 5.0


class Events:
    """A rate-limited log's stand-in: every event kept."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def event(self, reason: str, text: str, *, level: int = logging.INFO) -> None:
        self.lines.append((reason, text))


@pytest.fixture
def buffers() -> Iterator[list[RolloutBuffer]]:
    made = [RolloutBuffer(T, N, schema=SCHEMA) for _ in range(2)]
    yield made
    for buffer in made:
        buffer.close()


def make_loop(buffers: list[RolloutBuffer], *, trained: int = 0, gone=()) -> IngestLoop:
    assembler = RolloutAssembler(buffers, actor_timeout_s=TIMEOUT_S)
    server = SimpleNamespace(drop_gone_actors=lambda: list(gone), held_joins=set())
    return IngestLoop(
        assembler,
        server,
        peer_limits=PeerLimits(max_envs=8, max_actors=8, reward_bound=(-1.0, 1.0)),
        total_env_steps=BUDGET,
        rejections=Events(),
        notices=Events(),
        progress=RunProgress(global_step=40, episodes=3),
        trained_env_steps=trained,
    )


def step(seq: int, *, actor: str = "a", reward: float = 0.0, episodes=()) -> StepMessage:
    fields = {f.name: np.zeros((2, *f.shape), f.dtype) for f in SCHEMA.sent}
    fields["trainable"] = np.ones(2, dtype=bool)
    fields["rewards"] = np.full(2, reward, np.float32)
    message = StepMessage(actor, f"{actor}-1", seq, 0, fields)
    if episodes:
        fields["dones"] = np.array([True, False])
        message = replace(message, episode_returns=[episodes[0]], episode_lengths=[episodes[1]])
    return message


def result(trained_env_steps: int, stale_rows: int = 0) -> TrainResult:
    return TrainResult(
        slot=0,
        policy_version=1,
        weights={},
        stats=None,
        stale_rows=stale_rows,
        iterations=1,
        trained_env_steps=trained_env_steps,
    )


def test_every_step_message_is_counted_once(buffers: list[RolloutBuffer]) -> None:
    loop = make_loop(buffers)
    loop.assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    loop.take_step(step(0), now=0.0)
    loop.take_step(step(1, reward=5.0), now=0.0)  # beyond the run's reward bound
    loop.refuse_step(ForeignStep("a"))
    loop.refuse_step(MessageRejected("garbage", "not msgpack"))
    counters = loop.counters
    assert counters.accepted["step"] == 1 and counters.env_steps == 40 + 2
    assert counters.rejected == {"value_range": 1, "impersonation": 1, "garbage": 1}
    assert [reason for reason, _ in loop.rejections.lines] == [
        "value_range",
        "impersonation",
        "garbage",
    ]
    assert counters.received["data"] == 4 and counters.unaccounted_messages() == 0


def test_a_departed_incarnations_message_counts_late_not_rejected(
    buffers: list[RolloutBuffer],
) -> None:
    loop = make_loop(buffers)
    loop.assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    assert loop.assembler.leave("a", "a-1")
    late = MessageRejected("schema", "no stack to rebuild from")
    late.sender = ("a", "a-1", 3)
    loop.refuse_step(late)
    loop.take_step(step(0), now=0.0)  # decoded, but its actor has left
    counters = loop.counters
    assert counters.rejected == {} and counters.dropped["late_step_messages"] == 2
    assert counters.unaccounted_messages() == 0


def test_episodes_are_counted_once_from_what_the_assembler_took(
    buffers: list[RolloutBuffer],
) -> None:
    loop = make_loop(buffers)
    loop.assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    loop.take_step(step(0, episodes=(7.5, 12)), now=0.0)
    [episode] = loop.take_episodes()
    assert (episode.actor_id, episode.episodic_return, episode.episodic_length) == ("a", 7.5, 12)
    assert loop.episodes == 3 + 1 and loop.progress() == RunProgress(42, 4)
    assert loop.take_episodes() == [] and loop.episodes == 4


def test_the_update_that_spends_the_budget_stops_the_run(buffers: list[RolloutBuffer]) -> None:
    loop = make_loop(buffers)
    loop.record_result(result(BUDGET - 1, stale_rows=2))
    assert loop.stopping_reason == "" and loop.wants_steps(training=False)
    assert loop.counters.dropped["stale_rows"] == 2
    loop.record_result(result(BUDGET))
    assert loop.budget_spent and loop.stopping_reason == "env-step budget reached"
    assert not loop.wants_steps(training=False)


def test_a_resumed_spent_budget_stops_once_nothing_is_in_flight(
    buffers: list[RolloutBuffer],
) -> None:
    loop = make_loop(buffers, trained=BUDGET)
    loop.check_stop(stop_requested=False, training=True)  # a rollout trains: wait for it
    assert loop.stopping_reason == "" and not loop.wants_steps(training=True)
    loop.assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    loop.take_step(step(0), now=0.0)  # a row in a filling buffer
    assert not loop.nothing_in_flight(training=False)
    loop.check_stop(stop_requested=False, training=False)
    assert loop.stopping_reason == ""
    loop.assembler.leave("a", "a-1")  # its unfinished segment is discarded
    loop.check_stop(stop_requested=False, training=False)
    assert loop.stopping_reason == "env-step budget reached"


def test_a_signal_stops_the_run(buffers: list[RolloutBuffer]) -> None:
    loop = make_loop(buffers)
    loop.check_stop(stop_requested=True, training=True)
    assert loop.stopping_reason == "signal" and not loop.wants_steps(training=False)


def test_expiry_drops_silent_and_gone_actors_at_most_every_period(
    buffers: list[RolloutBuffer],
) -> None:
    loop = make_loop(buffers, gone=[("b", "exited")])
    loop.assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    loop.assembler.join("c", "c-1", SPEC, hostname="h", now=0.0)
    loop.assembler.heartbeat(
        "c", "c-1", now=TIMEOUT_S, env_steps_per_second=1.0, policy_lag=0.0, episodes=0
    )
    loop.expire(now=TIMEOUT_S - 0.1)
    assert set(loop.assembler.actors) == {"a", "c"}
    assert [reason for reason, _ in loop.notices.lines] == ["gone"]
    loop.expire(now=TIMEOUT_S + 0.2)  # "a" is silent, but within the period nothing is looked at
    assert set(loop.assembler.actors) == {"a", "c"}
    loop.expire(now=TIMEOUT_S - 0.1 + EXPIRY_PERIOD_S)
    assert set(loop.assembler.actors) == {"c"}
    assert loop.counters.dropped["timed_out_actors"] == 1
    assert loop.notices.lines[-1][0] == "timeout" and "actor a silent" in loop.notices.lines[-1][1]
