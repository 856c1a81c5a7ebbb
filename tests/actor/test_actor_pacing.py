"""An asynchronous actor's wait for newer weights after acting ahead: it gives up after
``AHEAD_WAIT_S`` (and acts on) only while the learner holds none of its steps, so no step it acts is
thrown away for lack of room (the learner reports held steps in each heartbeat reply)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from oakemu_services.actor import Actor


class Weights:
    """A weights socket on which nothing arrives."""

    def poll(self, timeout_ms: int) -> int:
        time.sleep(timeout_ms / 1000)
        return 0


def stub(held_rows_after: list[int]) -> SimpleNamespace:
    """What ``_wait_for_weights_newer_than`` reads: each heartbeat reports the next held-row count."""
    weights = SimpleNamespace(  # none held: asynchronous mode
        policy_version=3, learner_version=3, load_held=lambda: False
    )
    actor = SimpleNamespace(
        stop_event=threading.Event(),
        weights=weights,
        actor_id="a",
        weights_sub=Weights(),
        learner_holds_rows=held_rows_after[0],
        heartbeats=0,
    )
    actor._poll_weights = lambda: False

    def heartbeat_if_due() -> None:
        actor.heartbeats += 1
        if actor.heartbeats % 5 == 0:  # one "reply" every 5 polls of 20 ms
            actor.learner_holds_rows = held_rows_after[
                min(actor.heartbeats // 5, len(held_rows_after) - 1)
            ]

    actor.heartbeat_if_due = heartbeat_if_due
    return actor


def test_the_wait_gives_up_after_its_limit_when_the_learner_holds_nothing() -> None:
    actor = stub([0])
    started = time.monotonic()
    assert Actor._wait_for_weights_newer_than(actor, 3, give_up_s=0.1) is False
    assert 0.1 <= time.monotonic() - started < 1.0


def test_the_wait_goes_on_while_the_learner_holds_steps_of_this_actor() -> None:
    actor = stub([32, 32, 32, 32, 32, 0])  # held for ~0.5 s, then drained
    started = time.monotonic()
    assert Actor._wait_for_weights_newer_than(actor, 3, give_up_s=0.1) is False
    assert time.monotonic() - started >= 0.4, (
        "gave up while the learner still held this actor's steps"
    )
    assert actor.learner_holds_rows == 0
