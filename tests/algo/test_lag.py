"""Policy lag of a rollout's rows: :func:`drop_stale_rows` (versions) on a real RolloutBuffer and
:class:`SgdStepLedger` (SGD steps). Every expected value is computed in the test from the versions
written."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from oakemu_core.algo.lag import SgdStepLedger, drop_stale_rows
from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.rollout_buffer import RolloutBuffer

T = 3  # rollout length
N = 6  # buffer columns
SCHEMA = build_schema({"": ((2,), np.float32)}, Categorical(3))  # 3 actions


@pytest.fixture
def buffers() -> Iterator[list[RolloutBuffer]]:
    made = [RolloutBuffer(T, N, schema=SCHEMA)]
    yield made
    for buffer in made:
        buffer.close()


def test_drop_stale_rows_marks_rows_over_the_lag_and_reports_lag_stats(
    buffers: list[RolloutBuffer],
) -> None:
    buffer = buffers[0]
    rng = np.random.default_rng(3)
    versions = np.array([[5, 3, 5, 1, 4, 2], [5, 2, 4, 1, 4, 3], [5, 5, 2, 0, 4, 1]])
    already_untrainable = (2, 3)  # a stale row that is already out: not counted again
    for t in range(T):
        for column in range(N):
            trainable = np.array([(t, column) != already_untrainable])
            zero = np.zeros(1, np.float32)
            buffer.write(
                t,
                np.array([column]),
                {
                    "observations": rng.normal(size=(1, 2)).astype(np.float32),
                    "actions": np.array([0]),
                    "log_probs": zero,
                    "values": zero,
                    "rewards": zero,
                    "dones": np.array([False]),
                    "trainable": trainable,
                },
                policy_version=int(versions[t, column]),
            )
    current, max_lag = 5, 2
    lag = current - versions
    expected_stale = lag > max_lag
    expected_trainable = ~expected_stale
    expected_trainable[already_untrainable] = False
    expected_count = int(expected_stale.sum()) - 1

    dropped, stats = drop_stale_rows(buffer, current_policy_version=current, max_policy_lag=max_lag)
    assert (
        dropped == expected_count == 6
    )  # versions 1, 2 | 2, 1 | 2, 1 (+ 0 at (2, 3), already out)
    np.testing.assert_array_equal(buffer.trainable, expected_trainable)
    assert stats == {
        "min": 0.0,
        "mean": pytest.approx(lag.sum() / lag.size),
        "max": 5.0,
        "newest_version": 5.0,
    }
    assert buffer.trainable_size == int(expected_trainable.sum())


def test_drop_stale_rows_with_no_stale_row(buffers: list[RolloutBuffer]) -> None:
    buffer = buffers[0]
    for t in range(T):
        buffer.add(
            np.zeros((N, 2), np.float32),
            np.zeros(N, np.int64),
            np.zeros(N, np.float32),
            np.zeros(N, np.float32),
            np.zeros(N, np.float32),
            np.zeros(N, bool),
            policy_version=7 + t,
        )
    dropped, stats = drop_stale_rows(buffer, current_policy_version=9, max_policy_lag=2)
    assert dropped == 0 and buffer.trainable.all()
    assert stats == {"min": 0.0, "mean": 1.0, "max": 2.0, "newest_version": 9.0}


def test_sgd_step_ledger_lag_weights_each_row_by_its_publishing() -> None:
    ledger = SgdStepLedger()
    ledger.note(4, 0, 10)
    ledger.note(4, 1, 13)
    ledger.note(5, 0, 20)
    ledger.sgd_steps = 25
    versions = np.array([[4, 4, 5], [5, 3, 5]])
    revisions = np.array([[0, 1, 0], [0, 0, 0]])
    lags = np.array([25 - 10, 25 - 13, 25 - 20, 25 - 20, (5 - 3) * 7, 25 - 20], dtype=float)
    stats = ledger.lag(versions, revisions, current_version=5, sgd_steps_per_version=7)
    assert stats == {
        "sgd_min": lags.min(),
        "sgd_mean": pytest.approx(lags.mean()),
        "sgd_max": lags.max(),
    }
    assert ledger.last_published == 20
    empty = ledger.lag(np.zeros((0,), np.int64), None, current_version=5, sgd_steps_per_version=7)
    assert empty == {"sgd_min": 0.0, "sgd_mean": 0.0, "sgd_max": 0.0}


def test_sgd_step_ledger_keeps_the_newest_versions_only() -> None:
    ledger = SgdStepLedger()
    for version in range(SgdStepLedger.KEPT_VERSIONS + 5):
        ledger.note(version, 0, version)
    assert len(ledger.published) == SgdStepLedger.KEPT_VERSIONS
    assert next(iter(ledger.published)) == (5, 0)
