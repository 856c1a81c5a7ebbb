"""Pacing without sockets: an asynchronous actor's allowance of ``AHEAD_SEGMENTS`` segments per
policy version (a new version, or a wait that gave up, starts it over); a synchronous actor's
segment ends."""

from __future__ import annotations

from oakemu_core.actor.pacing import AHEAD_SEGMENTS, Pacing


def test_an_asynchronous_actor_is_too_far_ahead_after_its_segments_with_one_version() -> None:
    pacing = Pacing()
    pacing.joined({"rollout_length": 4}, 7, version_changed=True)
    assert not pacing.synchronous and pacing.ahead_rows == AHEAD_SEGMENTS * 4
    for _ in range(pacing.ahead_rows - 1):
        pacing.acted(7)
    assert not pacing.too_far_ahead(7)
    pacing.acted(7)
    assert pacing.too_far_ahead(7)
    assert not pacing.too_far_ahead(8), "newer weights loaded: a fresh allowance"
    pacing.acted(8)
    assert pacing.rows_acted == 1 and not pacing.too_far_ahead(8)


def test_a_wait_that_gives_up_starts_the_allowance_over_and_is_counted() -> None:
    pacing = Pacing()
    pacing.joined({"rollout_length": 1}, 3, version_changed=True)
    for _ in range(AHEAD_SEGMENTS):
        pacing.acted(3)
    assert pacing.too_far_ahead(3)
    pacing.waited(False, stopped=False, policy_version=3, actor_id="a")
    assert not pacing.too_far_ahead(3)
    assert (pacing.ahead_waits, pacing.ahead_waits_timed_out) == (1, 1)
    pacing.waited(True, stopped=False, policy_version=3, actor_id="a")
    pacing.waited(False, stopped=True, policy_version=3, actor_id="a")
    assert (pacing.ahead_waits, pacing.ahead_waits_timed_out) == (3, 1)


def test_a_join_keeps_the_count_of_the_version_it_loads_again_and_restarts_another() -> None:
    pacing = Pacing()
    pacing.joined({"rollout_length": 1}, 5, version_changed=True)
    for _ in range(AHEAD_SEGMENTS):
        pacing.acted(5)
    pacing.joined({"rollout_length": 1}, 5, version_changed=False)
    assert pacing.too_far_ahead(5)
    pacing.joined({"rollout_length": 1}, 5, version_changed=True)  # v5 -> v6 -> v5 (a restart)
    assert not pacing.too_far_ahead(5)


def test_a_synchronous_segment_ends_on_the_message_that_fills_it() -> None:
    pacing = Pacing()
    pacing.joined({"mode": "sync", "rollout_length": 8}, 0, version_changed=False)
    assert pacing.synchronous and pacing.ahead_rows == 0 and not pacing.too_far_ahead(0)
    ends = []
    for _ in range(4):  # messages of 4 rows
        end = pacing.ends_segment(4)
        pacing.sent(4, end)
        ends.append(end)
    assert ends == [False, True, False, True]
    pacing.sent(4, False)
    pacing.joined({"mode": "sync", "rollout_length": 8}, 0, version_changed=False)
    assert pacing.segment_rows == 0, "a new incarnation starts a new segment"
