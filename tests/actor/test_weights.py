"""ActorWeights without sockets: the stepper owns the loaded ``(policy_version, revision)``; newer
weights load or, inside a synchronous segment, wait for its end; the catch-up request falls due after
``missed_s`` behind the learner; a join drops what was held."""

from __future__ import annotations

import numpy as np

from oakemu_core.actor.weights import ActorWeights
from oakemu_core.transport.control import WeightsMessage
from tests.actor_fakes import FakeStepper


def arrays(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(2, version, np.float32)}


def message(version: int, revision: int = 0) -> WeightsMessage:
    return WeightsMessage(version, arrays(version), revision)


def weights_at(version: int) -> tuple[ActorWeights, FakeStepper, list[float]]:
    """ActorWeights over a stepper at ``version``; the list gets the first array value of each load."""
    stepper, loads = FakeStepper(version), []
    return ActorWeights(stepper, lambda a: loads.append(float(a["w"][0]))), stepper, loads


def test_a_load_writes_the_stepper_s_version_and_revision_and_everything_reads_them_there() -> None:
    weights, stepper, loads = weights_at(2)
    weights.load(3, arrays(3), revision=1)
    assert (stepper.policy_version, stepper.weights_revision) == (3, 1) and loads == [3.0]
    assert weights.loaded == (3, 1) and weights.policy_version == 3
    assert weights.revisions_loaded == 1 and weights.learner_version == 3
    stepper.policy_version = 7  # whoever writes the stepper's record, the weights read it
    assert weights.policy_version == 7 and weights.loaded == (7, 1)
    weights.heard(9)
    assert weights.policy_lag == 2.0


def test_only_newer_weights_load_by_version_then_revision() -> None:
    weights, stepper, loads = weights_at(3)
    assert weights.take(message(3), hold=False) is False and loads == []
    assert weights.take(message(3, 2), hold=False) is True and weights.loaded == (3, 2)
    assert weights.take(message(3, 1), hold=False) is False
    assert weights.take(message(4), hold=False) is True and weights.loaded == (4, 0)
    assert weights.take(message(2, 5), hold=False) is False and loads == [3.0, 4.0]


def test_held_weights_wait_for_the_segment_s_end_and_count_for_the_lag() -> None:
    weights, stepper, loads = weights_at(1)
    assert weights.take(message(3), hold=True) is False
    assert weights.take(message(2), hold=True) is False  # older than the one held: dropped
    assert weights.held is not None and weights.held.policy_version == 3 and loads == []
    assert weights.newest_version() == 3 and weights.learner_version == 3
    assert weights.policy_version == 1 and weights.policy_lag == 2.0
    assert weights.load_held() is True and weights.loaded == (3, 0) and weights.held is None
    assert weights.load_held() is False and loads == [3.0]


def test_a_join_loads_its_weights_and_drops_those_held() -> None:
    weights, stepper, loads = weights_at(100)
    weights.take(message(101), hold=True)
    weights.behind_since = 5.0
    weights.rejoined(95, arrays(95))  # a learner restarted from its checkpoint
    assert weights.loaded == (95, 0) and weights.held is None and weights.behind_since is None
    assert weights.load_held() is False and loads == [95.0]


def test_the_catch_up_request_falls_due_after_missed_s_behind_and_again_after_another() -> None:
    weights, _, _ = weights_at(4)
    assert weights.fetch_due(4, now=10.0, missed_s=1.0) is False and weights.behind_since is None
    assert weights.fetch_due(5, now=10.0, missed_s=1.0) is False and weights.behind_since == 10.0
    assert weights.fetch_due(5, now=10.5, missed_s=1.0) is False
    assert weights.fetch_due(5, now=11.0, missed_s=1.0) is True and weights.behind_since is None
    assert weights.fetch_due(5, now=11.2, missed_s=1.0) is False  # a failed request: wait again
    assert weights.fetch_due(5, now=12.2, missed_s=1.0) is True
    weights.take(message(5), hold=True)  # held weights count as having the version
    assert weights.fetch_due(5, now=20.0, missed_s=1.0) is False and weights.behind_since is None


def test_fetched_weights_are_counted_and_taken() -> None:
    weights, _, loads = weights_at(1)
    assert weights.took_fetched(message(2), hold=False, actor_id="a") is True
    assert weights.took_fetched(message(2), hold=False, actor_id="a") is False
    assert weights.fetched == 2 and loads == [2.0]
