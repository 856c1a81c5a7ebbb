"""RolloutAssembler (learner-side routing of step messages into buffer columns) on real RolloutBuffers.

No sockets: messages are built here as already-validated :class:`StepMessage` objects. Every
expected value (columns, rows, counters, lag statistics) is computed in the test from the values
the messages carry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import StepField, build_schema
from oakemu_core.storage.assembler import (
    HELD_SLACK_MESSAGES,
    RolloutAssembler,
    SlotState,
    StepRejected,
)
from oakemu_core.storage.episodes import FinishedEpisode
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step

T = 3  # rollout length
N = 6  # buffer columns
OBS_SHAPE = (2,)
TIMEOUT_S = 5.0
SCHEMA = build_schema({"": (OBS_SHAPE, np.float32)}, Categorical(3))  # 3 actions


@pytest.fixture
def buffers() -> Iterator[list[RolloutBuffer]]:
    made = [RolloutBuffer(T, N, schema=SCHEMA) for _ in range(2)]
    yield made
    for buffer in made:
        buffer.close()


@pytest.fixture
def assembler(buffers: list[RolloutBuffer]) -> RolloutAssembler:
    return RolloutAssembler(buffers, actor_timeout_s=TIMEOUT_S)


def spec(num_envs: int) -> StepSpec:
    return StepSpec(num_envs=num_envs, schema=SCHEMA)


def message(
    actor_id: str,
    incarnation: str,
    seq: int,
    num_envs: int,
    *,
    version: int = 0,
    dones: list[bool] | None = None,
    truncated: list[bool] | None = None,
) -> StepMessage:
    """A step whose numbers encode (actor, seq, env), so the test can tell where each one landed.

    actor code a = sum of the id's bytes; env i of step seq: observation [a + 10*seq + i, -(...)],
    action (seq + i) % 3, log_prob -0.1*(i+1), value a + seq + 0.5*i, reward seq + 0.25*i,
    next value 100*a + seq + i, bootstrap 7 + i on truncated envs.
    """
    a = float(sum(actor_id.encode()))
    i = np.arange(num_envs)
    done = np.array(dones if dones is not None else [False] * num_envs, dtype=bool)
    trunc = np.array(truncated if truncated is not None else [False] * num_envs, dtype=bool)
    observation = (a + 10 * seq + i).astype(np.float32)
    return StepMessage(
        actor_id=actor_id,
        incarnation=incarnation,
        seq=seq,
        policy_version=version,
        fields={
            "observations": np.stack([observation, -observation], axis=1),
            "actions": ((seq + i) % 3).astype(np.int64),
            "log_probs": (-0.1 * (i + 1)).astype(np.float32),
            "values": (a + seq + 0.5 * i).astype(np.float32),
            "rewards": (seq + 0.25 * i).astype(np.float32),
            "dones": done,
            "truncated": trunc,
            "bootstrap_values": np.where(trunc, 7.0 + i, 0.0).astype(np.float32),
            "next_values": (100 * a + seq + i).astype(np.float32),
            "trainable": np.ones(num_envs, dtype=bool),
        },
    )


def send(
    assembler: RolloutAssembler, msg: StepMessage, *, version: int = 0, now: float = 0.0
) -> None:
    assembler.ingest(msg, current_policy_version=version, now=now)


def check_rows(buffer: RolloutBuffer, msg: StepMessage, row: int, columns: list[int]) -> None:
    """The message's arrays are in ``row`` of ``columns`` (env i -> columns[i])."""
    k = len(columns)
    for name in (
        "observations",
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "bootstrap_values",
    ):
        np.testing.assert_array_equal(
            buffer.field(name)[row, columns], msg.fields[name][:k], err_msg=name
        )
    np.testing.assert_array_equal(
        buffer.policy_versions[row, columns], np.full(k, msg.policy_version)
    )
    assert buffer.trainable[row, columns].all()


def fill_segment(
    assembler: RolloutAssembler,
    actor_id: str,
    incarnation: str,
    num_envs: int,
    first_seq: int = 0,
    **kwargs,
) -> list[StepMessage]:
    sent = [message(actor_id, incarnation, first_seq + s, num_envs, **kwargs) for s in range(T)]
    for msg in sent:
        send(assembler, msg)
    return sent


# ------------------------------------------------------------------------------ assignment
def test_two_actors_fill_one_buffer_and_a_third_gets_the_second(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    for name in ("a", "b", "c"):
        assembler.join(name, f"{name}-1", spec(3), hostname="h", now=0.0)
    first = [message("a", "a-1", 0, 3), message("b", "b-1", 0, 3), message("c", "c-1", 0, 3)]
    for msg in first:
        send(assembler, msg)

    a, b, c = (assembler.actors[name].segment for name in ("a", "b", "c"))
    assert (a.slot, a.columns.tolist()) == (0, [0, 1, 2])
    assert (b.slot, b.columns.tolist()) == (0, [3, 4, 5])
    assert (c.slot, c.columns.tolist()) == (1, [0, 1, 2])
    check_rows(buffers[0], first[0], 0, [0, 1, 2])
    check_rows(buffers[0], first[1], 0, [3, 4, 5])
    check_rows(buffers[1], first[2], 0, [0, 1, 2])
    assert buffers[0].column_steps.tolist() == [1] * 6
    assert buffers[1].column_steps.tolist() == [1, 1, 1, 0, 0, 0]
    assert assembler.counters.env_steps == 9
    assert assembler.counters.dropped["no_capacity_steps"] == 0


def test_an_actor_gets_only_the_free_columns_left_and_the_rest_is_counted(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(4), hostname="h", now=0.0)
    assembler.join("b", "b-1", spec(4), hostname="h", now=0.0)
    send(assembler, message("a", "a-1", 0, 4))
    msg_b = message("b", "b-1", 0, 4)
    send(assembler, msg_b)
    segment = assembler.actors["b"].segment
    assert (segment.slot, segment.columns.tolist()) == (0, [4, 5])  # 2 of its 4 envs fit
    check_rows(buffers[0], msg_b, 0, [4, 5])
    assert assembler.counters.dropped["no_capacity_steps"] == 2
    assert assembler.counters.env_steps == 4 + 2


def test_segment_completes_after_T_messages_with_last_values_and_dones_of_the_last_row(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    assembler.join("b", "b-1", spec(3), hostname="h", now=0.0)
    sent_a = fill_segment(assembler, "a", "a-1", 3)
    assert assembler.actors["a"].segment is None  # finished after T messages
    assert assembler.states[0] is SlotState.FILLING  # b's columns are still empty
    assert assembler.take_full_rollout() is None

    sent_b = [
        message(
            "b", "b-1", s, 3, dones=[False, s == T - 1, False], truncated=[False, s == T - 1, False]
        )
        for s in range(T)
    ]
    for msg in sent_b[:-1]:
        send(assembler, msg)
    assert assembler.states[0] is SlotState.FILLING
    send(assembler, sent_b[-1])
    assert assembler.states[0] is SlotState.FULL

    for row in range(T):
        check_rows(buffers[0], sent_a[row], row, [0, 1, 2])
        check_rows(buffers[0], sent_b[row], row, [3, 4, 5])
    rollout = assembler.take_full_rollout()
    assert rollout is not None and rollout.slot == 0 and rollout.buffer is buffers[0]
    assert assembler.states[0] is SlotState.TRAINING
    expected_last_values = np.concatenate(
        [sent_a[-1].fields["next_values"], sent_b[-1].fields["next_values"]]
    )
    np.testing.assert_array_equal(rollout.last_values, expected_last_values)
    assert rollout.last_dones.tolist() == [False, False, False, False, True, False]
    np.testing.assert_array_equal(rollout.last_dones, buffers[0].dones[-1])
    # GAE accepts them (it checks last_dones == dones[-1]); on b's truncated last row the
    # advantage is r + gamma * bootstrap - V, whatever the last value.
    rollout.buffer.compute_gae(rollout.last_values, rollout.last_dones, 0.9, 0.8)
    last_b = sent_b[-1].fields
    expected = last_b["rewards"][1] + 0.9 * last_b["bootstrap_values"][1] - last_b["values"][1]
    assert buffers[0].advantages[T - 1, 4] == pytest.approx(expected, rel=1e-6)


def test_full_buffer_hand_off_and_release_cycle(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(6), hostname="h", now=0.0)
    fill_segment(assembler, "a", "a-1", 6)
    assert assembler.states == [SlotState.FULL, SlotState.FILLING]
    assert assembler.accepting
    fill_segment(assembler, "a", "a-1", 6, first_seq=T)
    assert assembler.states == [SlotState.FULL, SlotState.FULL]
    assert not assembler.accepting

    # No buffer is filling: a step that arrives anyway is held (not dropped), nothing written yet.
    steps_before = assembler.counters.env_steps
    send(assembler, message("a", "a-1", 2 * T, 6))
    assert assembler.counters.dropped["no_capacity_steps"] == 0
    assert assembler.actors["a"].pending_rows == 1 and assembler.pending_rows == 1
    assert assembler.counters.env_steps == steps_before == 2 * T * 6

    first = assembler.take_full_rollout()
    second = assembler.take_full_rollout()
    assert (first.slot, second.slot) == (0, 1)  # oldest first
    assert assembler.take_full_rollout() is None
    assembler.release(0)
    assert assembler.states == [SlotState.FILLING, SlotState.TRAINING]
    # The held step went into the released buffer at once, as row 0.
    assert assembler.pending_rows == 0 and assembler.counters.env_steps == steps_before + 6
    assert buffers[0].column_steps.tolist() == [1] * N
    assert assembler.accepting
    with pytest.raises(ValueError, match="expected training"):
        assembler.release(0)
    assembler.release(1)
    # Buffer 0 was released first, so it fills first again.
    send(assembler, message("a", "a-1", 2 * T + 1, 6))
    assert assembler.actors["a"].segment.slot == 0
    assert (
        buffers[0].column_steps.tolist() == [2] * N and buffers[1].column_steps.tolist() == [0] * N
    )


# --------------------------------------------------------------------------------- rejection
def test_seq_gap_discards_the_segment_and_the_next_step_starts_a_new_one(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    send(
        assembler,
        message("a", "a-1", 0, 3, dones=[True, False, False], truncated=[True, False, False]),
    )
    send(assembler, message("a", "a-1", 1, 3))
    assert buffers[0].column_steps.tolist() == [2, 2, 2, 0, 0, 0]
    after_gap = message("a", "a-1", 3, 3)  # seq 2 never arrived
    send(assembler, after_gap)
    assert assembler.counters.dropped["seq_gap_steps"] == 1
    assert assembler.counters.dropped["discarded_segment_rows"] == 2 * 3
    # The two rows before the gap are gone; the step after it is row 0 of a new segment.
    segment = assembler.actors["a"].segment
    assert segment is not None and segment.rows_written == 1
    assert buffers[0].column_steps[segment.columns].tolist() == [1, 1, 1]
    check_rows(buffers[0], after_gap, 0, segment.columns.tolist())
    assert assembler.counters.env_steps == 3 * 3  # the global step count never goes backwards
    # A duplicate (or replayed) seq is refused and writes nothing.
    with pytest.raises(StepRejected) as caught:
        send(assembler, message("a", "a-1", 3, 3))
    assert caught.value.reason == "out_of_order"
    assert segment.rows_written == 1


def test_unknown_actor_and_unknown_incarnation_are_rejected(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    for msg in (message("z", "z-1", 0, 3), message("a", "a-0", 0, 3)):
        with pytest.raises(StepRejected) as caught:
            send(assembler, msg)
        assert caught.value.reason == "unknown_actor"
    assert buffers[0].column_steps.sum() == 0 and assembler.counters.env_steps == 0
    assert assembler.spec_for("a", "a-0") is None and assembler.spec_for("a", "a-1") == spec(3)


def test_future_policy_version_is_rejected(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    with pytest.raises(StepRejected) as caught:
        assembler.ingest(message("a", "a-1", 0, 3, version=4), current_policy_version=3, now=0.0)
    assert caught.value.reason == "future_version"
    assert buffers[0].column_steps.sum() == 0 and assembler.counters.env_steps == 0
    # The current version itself is accepted.
    assembler.ingest(message("a", "a-1", 0, 3, version=3), current_policy_version=3, now=0.0)
    assert buffers[0].policy_versions[0, :3].tolist() == [3, 3, 3]


# ------------------------------------------------------------------------------ actor churn
def test_silent_actor_expires_and_frees_its_columns(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    assembler.join("b", "b-1", spec(3), hostname="h", now=0.0)
    send(assembler, message("a", "a-1", 0, 3), now=1.0)
    send(assembler, message("b", "b-1", 0, 3), now=1.0)
    send(assembler, message("b", "b-1", 1, 3), now=4.0)
    assert assembler.heartbeat(
        "a", "a-1", now=2.0, env_steps_per_second=1.0, policy_lag=0.0, episodes=0
    )

    assert (
        assembler.expire_silent_actors(now=2.0 + TIMEOUT_S) == []
    )  # a: exactly the timeout, not more
    assert assembler.expire_silent_actors(now=2.0 + TIMEOUT_S + 0.1) == ["a"]
    assert set(assembler.actors) == {"b"}
    assert assembler.counters.dropped["timed_out_actors"] == 1
    assert assembler.counters.dropped["discarded_segment_rows"] == 3
    assert buffers[0].column_steps.tolist() == [0, 0, 0, 2, 2, 2]
    assert not buffers[0].trainable[:, :3].any()
    assert assembler.counters.env_steps == 9  # received steps, discarded ones included
    assert not assembler.heartbeat(
        "a", "a-1", now=8.0, env_steps_per_second=1.0, policy_lag=0.0, episodes=0
    )
    # A step of the dropped incarnation that was still in flight: refused, counted as late.
    with pytest.raises(StepRejected) as caught:
        send(assembler, message("a", "a-1", 1, 3))
    assert caught.value.reason == "departed_actor"
    assert assembler.counters.dropped["late_steps"] == 3
    assert assembler.counters.env_steps == 9
    assembler.join("c", "c-1", spec(3), hostname="h", now=8.0)
    send(assembler, message("c", "c-1", 0, 3), now=8.0)
    assert assembler.actors["c"].segment.columns.tolist() == [0, 1, 2]


def test_new_incarnation_of_an_actor_replaces_the_old(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    old = assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    send(assembler, message("a", "a-1", 0, 3))
    send(assembler, message("a", "a-1", 1, 3))
    new = assembler.join("a", "a-2", spec(3), hostname="h", now=1.0)
    assert new.index != old.index and assembler.actors["a"] is new
    assert buffers[0].column_steps.tolist() == [0] * N
    assert assembler.counters.dropped["discarded_segment_rows"] == 6
    with pytest.raises(StepRejected) as caught:
        send(assembler, message("a", "a-1", 2, 3))
    assert caught.value.reason == "departed_actor"
    assert buffers[0].column_steps.tolist() == [0] * N
    msg = message("a", "a-2", 0, 3)  # the new incarnation counts from seq 0
    send(assembler, msg)
    check_rows(buffers[0], msg, 0, [0, 1, 2])
    assert assembler.leave("a", "a-1") is False
    assert assembler.leave("a", "a-2") is True
    assert assembler.actors == {} and buffers[0].column_steps.sum() == 0


def test_episodes_are_collected_from_messages(assembler: RolloutAssembler) -> None:
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    send(
        assembler,
        replace(message("a", "a-1", 0, 3), episode_returns=[12.5, 3.0], episode_lengths=[20, 7]),
    )
    assert assembler.take_episodes() == [
        FinishedEpisode("a", 0, 12.5, 20),
        FinishedEpisode("a", 0, 3.0, 7),
    ]
    assert assembler.take_episodes() == []


def test_learner_path_counts_a_late_step_of_a_departed_actor_as_dropped(
    assembler: RolloutAssembler,
) -> None:
    """What oakemu_services.learner does with each frame: decode against the joined spec, then ingest."""
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    frame = encode_step(message("a", "a-1", 0, 3), spec(3))
    assert assembler.leave("a", "a-1")
    with pytest.raises((StepRejected, MessageRejected)) as caught:  # the learner catches both
        assembler.ingest(
            decode_step(frame, assembler.spec_for, max_bytes=2**20),
            current_policy_version=0,
            now=1.0,
        )
    assert caught.value.reason == "departed_actor"
    assert assembler.counters.dropped["late_steps"] == 3


def learner_path(assembler: RolloutAssembler, msg: StepMessage, *, version: int = 0) -> None:
    """What oakemu_services.learner does with each frame: decode against the joined spec, then ingest."""
    frame = encode_step(msg, spec(msg.num_envs))
    assembler.ingest(
        decode_step(frame, assembler.spec_for, max_bytes=2**20),
        current_policy_version=version,
        now=0.0,
    )


@pytest.mark.parametrize(
    ("field", "bad_value"),
    [
        ("actions", np.array([0, 3], np.int64)),  # 3 actions: 0..2
        ("actions", np.array([-1, 0], np.int64)),
        ("rewards", np.array([0.0, 3e38], np.float32)),
        ("values", np.array([-2e6, 0.0], np.float32)),
        ("log_probs", np.array([0.5, -0.1], np.float32)),
        ("bootstrap_values", np.array([1.0, 0.0], np.float32)),  # not truncated
    ],
)
def test_impossible_values_are_rejected_on_the_learner_path_and_break_the_segment(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer], field: str, bad_value: np.ndarray
) -> None:
    """Value checks moved from ingest to the wire (decode_step, reason value_range): the bad step
    never reaches the assembler, and the hole it leaves in the actor's seq discards the segment."""
    assembler.join("a", "a-1", spec(2), hostname="h", now=0.0)
    learner_path(assembler, message("a", "a-1", 0, 2))
    assert buffers[0].column_steps.tolist()[:2] == [1, 1]
    bad = message("a", "a-1", 1, 2)
    bad = replace(bad, fields={**bad.fields, field: bad_value})
    with pytest.raises(MessageRejected) as caught:
        learner_path(assembler, bad)
    assert caught.value.reason == "value_range" and caught.value.detail.startswith(field)
    # Nothing of the bad step was written.
    assert buffers[0].column_steps.tolist()[:2] == [1, 1]
    assert assembler.counters.env_steps == 2
    # The next step reveals the hole: the unfinished segment (row 0) is discarded, so no column
    # ever holds rows that are not consecutive steps of one env, and that step starts a new one.
    msg = message("a", "a-1", 2, 2)
    learner_path(assembler, msg)
    assert assembler.counters.dropped["seq_gap_steps"] == 1
    assert assembler.counters.dropped["discarded_segment_rows"] == 2
    assert buffers[0].column_steps.tolist()[:2] == [1, 1]
    check_rows(buffers[0], msg, 0, [0, 1])


def test_bootstrap_value_on_a_truncated_row_is_accepted(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(2), hostname="h", now=0.0)
    learner_path(assembler, message("a", "a-1", 0, 2, dones=[True, False], truncated=[True, False]))
    assert buffers[0].bootstrap_values[0, :2].tolist() == [7.0, 0.0]


def test_buffers_must_share_the_schema(buffers: list[RolloutBuffer]) -> None:
    with RolloutBuffer(T, N, OBS_SHAPE, np.float32) as plain:  # same shapes, no distribution
        with pytest.raises(ValueError, match="share T, N and the step schema"):
            RolloutAssembler([buffers[0], plain], actor_timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="at least one rollout buffer"):
        RolloutAssembler([], actor_timeout_s=TIMEOUT_S)


def test_a_spec_of_another_schema_is_refused_at_join(assembler: RolloutAssembler) -> None:
    """Messages are written without a second check (decode_step checked them against the actor's
    spec), so a spec whose schema is not the buffers' (a learner bug) never joins."""
    extra = StepField("my_extra", (3,), np.float32)
    with pytest.raises(ValueError, match="schema differs"):
        assembler.join("a", "a-1", StepSpec(2, SCHEMA.with_field(extra)), hostname="h", now=0.0)
    assert "a" not in assembler.actors


def test_a_stored_field_actors_do_not_send_gets_its_default() -> None:
    """A schema may store a field no actor sends (``sent=False`` with a default): the written rows hold
    the default, as the checked write paths fill it."""
    schema = SCHEMA.with_field(StepField("learner_note", (), np.float32, sent=False, default=0.5))
    made = [RolloutBuffer(T, N, schema=schema) for _ in range(2)]
    try:
        assembler = RolloutAssembler(made, actor_timeout_s=TIMEOUT_S)
        assembler.join("a", "a-1", StepSpec(2, schema), hostname="h", now=0.0)
        msg = message("a", "a-1", 0, 2)
        assert "learner_note" not in msg.fields
        send(assembler, msg)
        columns = assembler.actors["a"].segment.columns
        check_rows(made[0], msg, 0, columns.tolist())
        assert made[0].field("learner_note")[0, columns].tolist() == [0.5, 0.5]
        assert made[0].field("learner_note")[1:].sum() == 0  # only the written row
    finally:
        for buffer in made:
            buffer.close()


def test_a_write_whose_rows_disagree_with_the_buffer_is_rejected_and_discards_the_segment(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    """The one check left on the write path: the segment's columns hold the rows it expects."""
    assembler.join("b", "b-1", spec(2), hostname="h", now=0.0)
    send(assembler, message("b", "b-1", 0, 2))
    columns = assembler.actors["b"].segment.columns
    assert buffers[0].column_steps[columns].tolist() == [1, 1]
    buffers[0].write(1, columns[:1], message("x", "x", 0, 1).fields)  # behind the assembler's back
    with pytest.raises(StepRejected) as caught:
        send(assembler, message("b", "b-1", 1, 2))
    assert caught.value.reason == "schema" and "step_index=1" in caught.value.detail
    assert (
        buffers[0].column_steps[columns].tolist() == [0, 0]
        and assembler.actors["b"].segment is None
    )


# ------------------------------------------------------------------------- over-subscription
def _decode_written(buffer: RolloutBuffer) -> list[list[tuple[int, int, int]]]:
    """Per column, the (actor code, seq, env) of each row, decoded from :func:`message`'s numbers."""
    values, rewards = (
        buffer.field("values").astype(np.float64),
        buffer.field("rewards").astype(np.float64),
    )
    columns = []
    for column in range(buffer.num_envs):
        rows = []
        for row in range(buffer.rollout_length):
            v, r = values[row, column], rewards[row, column]
            a = int(np.floor(v - r + 1e-6))
            i = int(round((v - r - a) / 0.25))
            rows.append((a, int(round(r - 0.25 * i)), i))
        columns.append(rows)
    return columns


@pytest.mark.parametrize("train_rounds", [1, 2, 3])
def test_an_over_subscribed_learner_holds_steps_instead_of_dropping_them(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer], train_rounds: int
) -> None:
    """3 actors x 3 envs on 2 buffers x 6 columns: one actor always waits for columns. The learner
    reads while a buffer fills; a full buffer trains for ``train_rounds`` rounds. Every step sent
    is written exactly once (or still held), rows are consecutive per column, nothing is dropped."""
    names = ("a", "b", "c")
    for name in names:
        assembler.join(name, f"{name}-1", spec(3), hostname="h", now=0.0)
    seqs = dict.fromkeys(names, 0)
    training: list[tuple[int, int]] = []  # (slot, round it finishes)
    seen: set[tuple[int, int, int]] = set()
    sent = 0
    rng = np.random.default_rng(0)
    for round_ in range(60):
        for slot, done_at in [t for t in training if t[1] <= round_]:
            assembler.release(slot)
            training.remove((slot, done_at))
        for name in rng.permutation(names):  # arrival order varies, one message per actor per round
            if not assembler.accepting:  # the learner stops reading: actors wait in send
                break
            send(assembler, message(name, f"{name}-1", seqs[name], 3))
            seqs[name] += 1
            sent += 3
        while (rollout := assembler.take_full_rollout()) is not None:
            for rows in _decode_written(rollout.buffer):
                a, first_seq, env = rows[0]
                assert rows == [(a, first_seq + t, env) for t in range(T)], (
                    rows
                )  # one actor's env, consecutive
                assert not seen.intersection(rows)
                seen.update(rows)
            training.append((rollout.slot, round_ + train_rounds))
    assert assembler.counters.dropped["no_capacity_steps"] == 0
    assert len(seen) > 0.6 * sent
    assert assembler.counters.env_steps + 3 * assembler.pending_rows == sent


def test_freed_columns_go_to_the_actor_served_least_recently_not_the_lowest_index(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    """Both buffers taken, "early" (index 0) has written a segment, "late" (index 9) none; both hold
    a step: the columns a release frees go to "late", and "early" keeps holding (by index, low
    indices would take every freed column while more envs than columns hold steps: the others starve)."""
    for name, index in (("early", 0), ("y", 1), ("late", 9)):
        assembler.join(name, f"{name}-1", spec(6), hostname="h", now=0.0, index=index)
    fill_segment(assembler, "early", "early-1", 6)  # buffer 0 full
    send(assembler, message("y", "y-1", 0, 6))  # buffer 1's columns taken
    send(assembler, message("late", "late-1", 0, 6))
    send(assembler, message("early", "early-1", T, 6))
    assert assembler.actors["late"].pending and assembler.actors["early"].pending
    assert assembler.take_full_rollout().slot == 0
    assembler.release(0)
    late, early = assembler.actors["late"], assembler.actors["early"]
    assert late.segment is not None and late.segment.slot == 0 and not late.pending
    assert early.segment is None and early.pending_rows == 1


def test_a_held_backlog_keeps_one_segment_plus_the_slack_and_drops_the_oldest(
    assembler: RolloutAssembler, buffers: list[RolloutBuffer]
) -> None:
    assembler.join("a", "a-1", spec(6), hostname="h", now=0.0)
    fill_segment(assembler, "a", "a-1", 6)
    fill_segment(assembler, "a", "a-1", 6, first_seq=T)
    assert not assembler.accepting
    capacity = T + HELD_SLACK_MESSAGES  # one step per message
    late = [message("a", "a-1", 2 * T + s, 6) for s in range(capacity + 2)]  # 2 more than it holds
    for msg in late:
        send(assembler, msg)
    assert assembler.pending_rows == capacity
    assert assembler.counters.dropped["no_capacity_steps"] == 2 * 6  # the two oldest
    assembler.take_full_rollout()
    assembler.release(0)
    assert assembler.pending_rows == capacity - T  # the rest waits for the next free columns
    for row, msg in enumerate(late[2 : 2 + T]):  # the oldest T kept, consecutive from row 0
        check_rows(buffers[0], msg, row, list(range(6)))
    assert assembler.states[0] is SlotState.FULL


def test_held_steps_that_would_train_too_old_are_dropped_at_release(
    buffers: list[RolloutBuffer],
) -> None:
    """With max_policy_lag 1 and 2 buffers, a buffer filled after a release to version v trains at
    v + 1 at the earliest: held steps acted before v are dropped, newer ones written."""
    assembler = RolloutAssembler(buffers, actor_timeout_s=TIMEOUT_S, max_policy_lag=1)
    assembler.join("a", "a-1", spec(6), hostname="h", now=0.0)
    fill_segment(assembler, "a", "a-1", 6)
    fill_segment(assembler, "a", "a-1", 6, first_seq=T)
    old, new = (
        message("a", "a-1", 2 * T, 6, version=0),
        message("a", "a-1", 2 * T + 1, 6, version=1),
    )
    send(assembler, old, version=1)
    send(assembler, new, version=1)
    assert assembler.pending_rows == 2
    assembler.take_full_rollout()
    assembler.release(0, policy_version=1)
    assert assembler.counters.dropped["stale_steps"] == 6  # the version-0 step
    assert assembler.counters.dropped["no_capacity_steps"] == 0
    assert assembler.pending_rows == 0
    check_rows(buffers[0], new, 0, list(range(6)))


def test_a_step_that_waited_in_the_sockets_does_not_start_a_stale_segment(
    buffers: list[RolloutBuffer],
) -> None:
    """A step acted by version 0 that reaches the learner only after version 2 is published (it
    waited in the sockets while both buffers were busy) and finds free columns only in the newer
    buffer, which trains at version 3: it is dropped as stale, and the actor's next step (version 2)
    starts the segment there."""
    assembler = RolloutAssembler(buffers, actor_timeout_s=TIMEOUT_S, max_policy_lag=2)
    assembler.join("b", "b-1", spec(6), hostname="h", now=0.0)
    assembler.join("a", "a-1", spec(3), hostname="h", now=0.0)
    for version, slot in ((1, 0), (2, 1)):  # b fills buffer 0, then buffer 1; each trains
        for seq in range((version - 1) * T, version * T):
            send(assembler, message("b", "b-1", seq, 6, version=version - 1), version=version - 1)
        rollout = assembler.take_full_rollout()
        assert rollout is not None and rollout.slot == slot
        assembler.release(slot, policy_version=version)
    assert (assembler.trains_at(0), assembler.trains_at(1)) == (2, 3)  # buffer 0 fills first
    send(assembler, message("b", "b-1", 2 * T, 6, version=2), version=2)  # b holds all of buffer 0
    stale, fresh = message("a", "a-1", 0, 3, version=0), message("a", "a-1", 1, 3, version=2)
    send(assembler, stale, version=2)
    assert assembler.counters.dropped["stale_steps"] == 3
    assert int(buffers[1].column_steps.sum()) == 0
    send(assembler, fresh, version=2)
    check_rows(buffers[1], fresh, 0, [0, 1, 2])
