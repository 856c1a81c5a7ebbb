"""The synchronous mode's building blocks without sockets: the stepper's segment end, the
assembler's columns per rollout (members, leaves, joins) and arrival-order-free episodes, the config
check, and the run's SPS.

The end-to-end checks (two runs of one seed give the same metrics, policy lag 0, counters that
agree) are in ``tests/e2e/test_e2e_sync.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.config import ConfigError, load_config
from oakemu_core.envs import make_vector_env
from oakemu_core.policy.models import build_model
from oakemu_core.run.metrics import RunStepRates
from oakemu_core.storage.assembler import RolloutAssembler, SlotState
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from tests.storage.test_ingest import SCHEMA, N, T, message, spec

SEED = 11
NUM_ENVS = 3


# ------------------------------------------------------------------------------------ stepper
def two_models():
    """An acting model and a differently initialised one (the 'weights trained on the rollout')."""
    torch.manual_seed(SEED)
    acting = build_model((4,), np.float32, 2)
    trained = build_model((4,), np.float32, 2)
    return acting, trained


def test_segment_end_takes_next_values_from_the_acting_model_and_the_next_action_from_the_new_one() -> (
    None
):
    acting, trained = two_models()
    acting_copy, _ = (
        two_models()
    )  # the acting weights, kept aside (the stepper's model gets overwritten)
    env = make_vector_env("CartPole-v1", NUM_ENVS, seed=SEED)
    try:
        stepper = PolicyStepper(env, acting, policy_version=0)
        stepper.step()
        row = stepper.step(segment_end=True)
        next_observations = row.env_step.observations.copy()
        assert row.policy_version == 0
        np.testing.assert_array_equal(
            row.next_values, acting_copy.predict_values(next_observations)
        )
        assert not np.allclose(row.next_values, trained.predict_values(next_observations)), (
            "the two models must disagree for this test to tell them apart"
        )

        calls = []

        def load_trained_weights() -> None:  # what the actor does once the new weights arrive
            calls.append("hook")
            acting.load_state_dict(trained.state_dict())
            stepper.policy_version = 1

        row = stepper.step(before_next_action=load_trained_weights)
        # before the deferred choice of this row's actions, then as always before the next choice
        assert calls == ["hook", "hook"]
        assert row.policy_version == 1, (
            "the first row of the next segment is acted by the new weights"
        )
        np.testing.assert_array_equal(row.buffers.observations, next_observations)
        np.testing.assert_allclose(
            row.buffers.values, trained.predict_values(next_observations), rtol=0, atol=1e-6
        )
    finally:
        env.close()


def test_without_segment_end_the_hook_weights_give_next_values_as_before() -> None:
    """The asynchronous path is unchanged: next_values come from the model after the hook."""
    acting, trained = two_models()
    env = make_vector_env("CartPole-v1", NUM_ENVS, seed=SEED)
    try:
        stepper = PolicyStepper(env, acting, policy_version=0)

        def load() -> None:
            acting.load_state_dict(trained.state_dict())
            stepper.policy_version = 1

        row = stepper.step(before_next_action=load)
        assert row.policy_version == 0
        np.testing.assert_allclose(
            row.next_values, trained.predict_values(row.env_step.observations), rtol=0, atol=1e-6
        )
    finally:
        env.close()


def test_segment_end_rows_equal_plain_rows_when_the_weights_do_not_change() -> None:
    """Deferring the choice changes nothing else: same actions, rewards and values, step for step."""
    rows = {}
    for ends in (False, True):
        torch.manual_seed(SEED)
        model = build_model((4,), np.float32, 2)
        env = make_vector_env("CartPole-v1", NUM_ENVS, seed=SEED)
        try:
            stepper = PolicyStepper(env, model)
            rows[ends] = []
            for step in range(12):
                row = stepper.step(segment_end=ends and step % 4 == 3)
                rows[ends].append(
                    (
                        row.buffers.actions.copy(),
                        row.buffers.rewards.copy(),
                        row.buffers.values.copy(),
                        row.next_values.copy(),
                    )
                )
        finally:
            env.close()
    for plain, ended in zip(rows[False], rows[True]):
        for a, b in zip(plain, ended):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------- ingest
@pytest.fixture
def one_buffer() -> Iterator[RolloutBuffer]:
    buffer = RolloutBuffer(T, N, schema=SCHEMA)
    yield buffer
    buffer.close()


def with_episode(msg, value: float):
    return replace(msg, episode_returns=[value], episode_lengths=[int(value)])


def run_round(
    buffer: RolloutBuffer, order: list[str]
) -> tuple[RolloutAssembler, list[float], dict[str, list[int]]]:
    """Actors "z" (index 1) and "a" (index 0), 3 envs each, one rollout; messages arrive in
    ``order`` (a list of actor ids, one entry per message). Returns the assembler, the episodes
    released and the columns each actor's rows landed in."""
    buffer.reset()
    assembler = RolloutAssembler([buffer], actor_timeout_s=5.0, sync=True)
    assembler.join("z", "inc-z", spec(3), hostname="h", now=0.0, index=1)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    seqs = {"a": 0, "z": 0}
    released: list[float] = []
    for actor_id in order:
        seq = seqs[actor_id]
        seqs[actor_id] += 1
        code = 100.0 if actor_id == "a" else 200.0
        assembler.ingest(
            with_episode(message(actor_id, "inc-" + actor_id, seq, 3), code + seq),
            current_policy_version=0,
            now=0.0,
        )
        returns = [episode.episodic_return for episode in assembler.take_episodes()]
        if assembler.states[0] is not SlotState.FULL:
            assert returns == [], "episodes wait until the rollout is full"
        released += returns
    columns = {}
    for actor_id in ("a", "z"):
        code = float(
            sum(actor_id.encode())
        )  # message(): observations[0, env, 0] = code + env (97.., 122..)
        columns[actor_id] = sorted(
            int(c)
            for c in np.flatnonzero(np.isin(buffer.observations[0, :, 0], code + np.arange(3)))
        )
    return assembler, released, columns


def test_sync_columns_follow_the_actor_index_and_episodes_the_actor_order(
    one_buffer: RolloutBuffer,
) -> None:
    orders = [["z", "z", "a", "z", "a", "a"], ["a", "z", "a", "a", "z", "z"]]
    results = [run_round(one_buffer, order) for order in orders]
    for assembler, released, columns in results:
        assert assembler.states[0] is SlotState.FULL
        assert columns == {"a": [0, 1, 2], "z": [3, 4, 5]}
        assert released == [100.0, 101.0, 102.0, 200.0, 201.0, 202.0]  # (index, seq) order


def test_sync_join_refuses_a_taken_index_and_actors_past_the_buffers_room(
    one_buffer: RolloutBuffer,
) -> None:
    assembler = RolloutAssembler([one_buffer], actor_timeout_s=5.0, sync=True)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    with pytest.raises(ValueError, match="held by actor 'a'"):
        assembler.join("b", "inc-b", spec(3), hostname="h", now=0.0, index=0)
    assembler.join(
        "c", "inc-c", spec(3), hostname="h", now=0.0, index=5
    )  # any index: columns follow the order
    assert not assembler.has_room_for(3)
    with pytest.raises(ValueError, match="do not fit in the buffer's 6 columns"):
        assembler.join("d", "inc-d", spec(3), hostname="h", now=0.0, index=2)
    # a new incarnation of "a" takes its own index back (and its old room)
    assert assembler.join("a", "inc-a2", spec(3), hostname="h", now=1.0, index=0).index == 0


# ------------------------------------------------------------------------------ elastic rounds
def send_segment(
    assembler: RolloutAssembler, actor_id: str, rows: int, *, first_seq: int = 0
) -> None:
    for seq in range(first_seq, first_seq + rows):
        assembler.ingest(
            message(actor_id, "inc-" + actor_id, seq, 3), current_policy_version=0, now=0.0
        )


def columns_of(buffer: RolloutBuffer, actor_id: str) -> list[int]:
    code = float(sum(actor_id.encode()))  # message(): observations[0, env, 0] = code + env
    return sorted(
        int(c) for c in np.flatnonzero(np.isin(buffer.observations[0, :, 0], code + np.arange(3)))
    )


def test_a_member_that_leaves_mid_rollout_takes_its_rows_and_the_others_fill_the_rollout(
    one_buffer,
) -> None:
    assembler = RolloutAssembler([one_buffer], actor_timeout_s=5.0, sync=True, planned_columns=6)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    assembler.join("z", "inc-z", spec(3), hostname="h", now=0.0, index=1)
    send_segment(assembler, "z", 2)  # z's unfinished segment: 2 of T=3 rows
    send_segment(assembler, "a", T)
    assert assembler.states[0] is SlotState.FILLING, "the rollout waits for z while it is joined"
    assert assembler.leave("z", "inc-z")
    assert assembler.states[0] is SlotState.FULL
    rollout = assembler.take_full_rollout()
    assert rollout is not None and rollout.planned_columns == 6
    np.testing.assert_array_equal(rollout.columns_used, [True] * 3 + [False] * 3)
    assert one_buffer.is_full, "the columns nobody filled are sealed, so GAE runs"
    assert one_buffer.trainable[:, :3].all() and not one_buffer.trainable[:, 3:].any(), (
        "z's rows never train"
    )
    assert assembler.counters.dropped["discarded_segment_rows"] == 2 * 3
    one_buffer.compute_gae(rollout.last_values, rollout.last_dones, 0.99, 0.95)
    assert np.isfinite(one_buffer.advantages).all()


def test_a_join_during_a_rollout_starts_at_the_next_one_and_a_leave_returns_the_columns(
    one_buffer,
) -> None:
    assembler = RolloutAssembler([one_buffer], actor_timeout_s=5.0, sync=True)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    assert assembler.round.is_open and set(assembler.round.members) == {"a"}
    send_segment(assembler, "a", 1)
    assert not assembler.round.is_open
    assembler.join(
        "m", "inc-m", spec(3), hostname="h", now=0.0, index=1
    )  # the control server holds such joins
    assert set(assembler.round.members) == {"a"}
    send_segment(assembler, "m", 1)  # not a member: not written, counted
    assert assembler.counters.dropped["not_member_steps"] == 3
    send_segment(assembler, "a", T - 1, first_seq=1)
    rollout = assembler.take_full_rollout()
    assert rollout is not None and rollout.columns_used.sum() == 3
    assembler.release(rollout.slot, policy_version=1)
    assert {k: v.tolist() for k, v in assembler.round.members.items()} == {
        "a": [0, 1, 2],
        "m": [3, 4, 5],
    }
    assert assembler.leave("m", "inc-m")
    assert set(assembler.round.members) == {"a"}, (
        "a rollout with no row yet is filled by the actors joined now"
    )


def test_a_rollout_whose_members_all_left_with_nothing_finished_opens_again(one_buffer) -> None:
    assembler = RolloutAssembler([one_buffer], actor_timeout_s=5.0, sync=True)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    send_segment(assembler, "a", 2)
    assert assembler.expire_silent_actors(now=10.0) == ["a"]
    assert (
        assembler.round.is_open
        and assembler.states[0] is SlotState.FILLING
        and not assembler.round.members
    )
    assembler.join("b", "inc-b", spec(3), hostname="h", now=10.0, index=0)
    assert set(assembler.round.members) == {"b"}
    send_segment(assembler, "b", T)
    assert assembler.states[0] is SlotState.FULL


# ------------------------------------------------------------------------------------- config
def test_sync_mode_plans_num_envs_columns_and_allocates_room_for_max_actors() -> None:
    assert load_config([]).mode == "sync"
    config = load_config(["--mode", "sync", "--num-actors", "2", "--envs-per-actor", "4"])
    assert (config.buffer_num_envs, config.resolved_max_actors, config.allocated_num_envs) == (
        8,
        4,
        16,
    )
    config = load_config(
        ["--num-actors", "3", "--envs-per-actor", "4", "--num-envs", "20", "--max-actors", "2"]
    )
    assert (config.buffer_num_envs, config.allocated_num_envs) == (20, 20), (
        "room for the planned columns at least"
    )
    config = load_config(
        ["--mode", "async", "--num-actors", "2", "--envs-per-actor", "4", "--max-actors", "9"]
    )
    assert config.allocated_num_envs == 8, "async: the buffers hold num_envs columns"
    with pytest.raises(ConfigError, match="mode"):
        load_config(["--mode", "lockstep"])


# ---------------------------------------------------------------------------------------- SPS
def test_run_step_rates_since_start_and_recent_window() -> None:
    rates = RunStepRates(started=100.0, start_steps=1_000, window_s=10.0)
    assert rates.overall() == 0.0 and rates.recent() == 0.0
    rates.sample(104.0, 1_000)  # start-up: 4 s without steps
    assert rates.overall() == 0.0
    rates.sample(
        105.0, 1_500
    )  # the first rollout arrives within a second: recent is positive at once
    assert rates.overall() == pytest.approx(500 / 5)
    assert rates.recent() == pytest.approx(500 / 1)
    for second in range(106, 130):
        rates.sample(float(second), 1_500 + 200 * (second - 105))
    assert rates.overall() == pytest.approx((1_500 + 200 * 24 - 1_000) / 29)  # start-up included
    assert rates.recent() == pytest.approx(200.0)  # the last 10 s only
    with pytest.raises(ValueError, match="window_s"):
        RunStepRates(0.0, window_s=0.0)


# ----------------------------------------------------------------------------- console's last line
def test_final_console_line_comes_from_the_last_update_record(tmp_path) -> None:
    from oakemu_services.train import _final_update_line, _metrics_records

    assert (
        _metrics_records(tmp_path) == [] and _final_update_line([]) is None
    )  # no metrics.jsonl yet
    (tmp_path / "metrics.jsonl").write_text(
        '{"global_step": 256, "charts/update": 1, "charts/SPS": 100.0, "charts/SPS_recent": 120.0}\n'
        '{"global_step": 300, "eval/episodic_return": 9.0}\n'  # not an update record
        '{"global_step": 512, "charts/update": 2, "charts/SPS": 110.4, "charts/SPS_recent": 130.0, '
        '"charts/episodic_return": 21.5, "losses/policy_loss": -0.01, "losses/value_loss": 2.0, '
        '"losses/entropy": 0.69, "charts/actors": 2}\n'
        '{"global_step": 7'  # a torn last line is skipped
    )
    update, line = _final_update_line(_metrics_records(tmp_path))
    assert update == 2
    assert line.startswith(
        "update     2 | steps       512 | SPS    110 (recent    130) | return    21.50"
    )
    assert "actors 2" in line


def test_a_repeated_join_of_the_same_incarnation_keeps_its_place_in_the_rollout(one_buffer) -> None:
    assembler = RolloutAssembler([one_buffer], actor_timeout_s=5.0, sync=True)
    assembler.join("a", "inc-a", spec(3), hostname="h", now=0.0, index=0)
    assembler.join("z", "inc-z", spec(3), hostname="h", now=0.0, index=1)
    send_segment(assembler, "a", 1)
    assembler.join(
        "z", "inc-z", spec(3), hostname="h", now=1.0, index=1
    )  # z's join reply was lost: it asks again
    assert assembler.round.members["z"].tolist() == [3, 4, 5]
    send_segment(assembler, "z", T)
    send_segment(assembler, "a", T - 1, first_seq=1)
    assert assembler.states[0] is SlotState.FULL
