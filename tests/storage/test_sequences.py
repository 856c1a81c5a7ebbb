"""Tests for oakemu_core.storage.sequences: a recurrent policy's rollout cut into sequences, against
values written out by hand (which rows, which initial states, which resets, which rows train)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.storage.sequences import SequenceLayout

T, N, S = 5, 3, 2


def _buffer(dones_at: set[tuple[int, int]], untrainable_at: set[tuple[int, int]]) -> RolloutBuffer:
    """A full (5, 3) rollout whose rows say where they are: observation ``[10 t + n]``, action
    ``(t + n) % 2``, state ``[t, n]``, value ``100 t + n``; ``dones`` and untrainable rows where
    given; GAE computed."""
    schema = build_schema({"": ((1,), np.float32)}, Categorical(2), state_size=S)
    buffer = RolloutBuffer(T, N, schema=schema)
    for t in range(T):
        columns = np.arange(N)
        buffer.add(
            (10 * t + columns).astype(np.float32)[:, None],
            (t + columns) % 2,
            np.zeros(N, np.float32),
            (100 * t + columns).astype(np.float32),
            np.zeros(N, np.float32),
            np.array([(t, n) in dones_at for n in columns]),
            np.array([(t, n) not in untrainable_at for n in columns]),
            policy_state=np.stack([np.full(N, t), columns], axis=1).astype(np.float32),
        )
    buffer.compute_gae(np.zeros(N, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)
    return buffer


def test_layout_cuts_columns_into_chunks_and_pads_the_last() -> None:
    layout = SequenceLayout.of(5, 2, 2)
    # Column 0: rows (0, 1), (2, 3), (4, pad); then column 1 the same.
    assert layout.columns.tolist() == [0, 0, 0, 1, 1, 1]
    assert layout.times.T.tolist() == [[0, 1], [2, 3], [4, 4]] * 2
    assert layout.valid.T.tolist() == [[True, True], [True, True], [True, False]] * 2
    whole = SequenceLayout.of(5, 2, None)
    assert whole.times.T.tolist() == [[0, 1, 2, 3, 4]] * 2 and whole.valid.all()
    assert SequenceLayout.of(5, 2, 99).length == 5  # never longer than the rollout
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="sequence_length"):
            SequenceLayout.of(5, 2, bad)


def test_sequences_start_from_stored_states_reset_after_dones_and_mask_padding() -> None:
    """L = 2 over T = 5: chunks rows (0, 1), (2, 3), (4, pad) per column. Column 2 has no trainable
    row: its chunks are left out. Done at (0, 0) and (3, 1): a reset before (1, 0) (inside a chunk),
    none at (4, 1) (a chunk's first row: the stored state is the start)."""
    untrainable = {(t, 2) for t in range(T)} | {(2, 0)}
    with _buffer({(0, 0), (3, 1)}, untrainable) as buffer:
        batch = buffer.sequence_batch("cpu", 2)
        assert (batch.sequences, batch.length) == (6, 2)
        assert batch.layout.columns.tolist() == [0, 0, 0, 1, 1, 1]
        observations = batch.fields["observations"][..., 0].T.tolist()
        assert observations == [[0, 10], [20, 30], [40, 40], [1, 11], [21, 31], [41, 41]]
        # The state stored with each chunk's first row: [t, n] of rows 0, 2, 4 of columns 0 and 1.
        assert batch.state.tolist() == [[0, 0], [2, 0], [4, 0], [0, 1], [2, 1], [4, 1]]
        assert batch.resets.T.tolist() == [[False, True]] + [[False, False]] * 5
        assert batch.trainable.T.tolist() == [
            [True, True],
            [False, True],  # (2, 0) untrainable
            [True, False],  # padding
            [True, True],
            [True, True],
            [True, False],
        ]
        assert batch.size == 2 * T - 1 == int(buffer.trainable.sum())
        # Field by field: the rollout's rows at the chunks' rows, time-major.
        assert batch.fields["values"].T.tolist() == [
            [0, 100],
            [200, 300],
            [400, 400],
            [1, 101],
            [201, 301],
            [401, 401],
        ]
        # The statistics read the trainable rows, time-major: 0, 100, 400 (chunk 0, 2 at t = 0) ...
        values = batch.trainable_rows("values").tolist()
        assert sorted(values) == sorted(buffer.values[buffer.trainable].tolist())


def test_whole_columns_by_default() -> None:
    with _buffer({(1, 0)}, set()) as buffer:
        batch = buffer.sequence_batch("cpu", None)
        assert (batch.sequences, batch.length) == (N, T)
        assert batch.state.tolist() == [[0, n] for n in range(N)]
        assert batch.resets[:, 0].tolist() == [False, False, True, False, False]
        assert not batch.resets[:, 1:].any()
        assert batch.trainable.all()


def test_minibatches_shuffle_whole_sequences_time_major() -> None:
    """Every sequence appears once per split, in ``min(num_minibatches, sequences)`` minibatches; the
    model's rows of a minibatch of C' sequences are time-major (row l * C' + c is step l of sequence
    c) and its per-row fields hold the trainable rows, at ``trained_rows`` among the model's rows."""
    with _buffer({(0, 0)}, {(1, 1)}) as buffer:
        batch = buffer.sequence_batch("cpu", 2)
        assert batch.sequences == 9
        minibatches = batch.minibatches(4, np.random.default_rng(0))
        assert [len(m.state) for m in minibatches] == [3, 2, 2, 2]
        starts = sorted(
            (int(s[0]), int(s[1])) for m in minibatches for s in m.state.tolist()
        )  # (first row, column) of each sequence
        assert starts == sorted((t, n) for t in (0, 2, 4) for n in range(N))
        seen = 0
        for minibatch in minibatches:
            chunks = len(minibatch.state)
            observations = minibatch.observations[:, 0].reshape(2, chunks)
            first_rows, columns = minibatch.state[:, 0], minibatch.state[:, 1]
            # Step l of sequence c is row first_rows[c] + l (the padding repeats the last row, 4).
            expected = 10 * torch.minimum(first_rows + torch.arange(2)[:, None], torch.tensor(4.0))
            torch.testing.assert_close(observations, expected + columns)
            rows = minibatch.trained_rows
            torch.testing.assert_close(
                minibatch.values,
                10 * minibatch.observations[rows, 0] + columns.repeat(2)[rows] * -9,
            )
            assert minibatch.advantages.shape == minibatch.returns.shape == rows.shape
            assert minibatch.fields["policy_versions"].shape == rows.shape
            seen += len(rows)
        assert seen == batch.size == T * N - 1
        assert len(batch.minibatches(100, np.random.default_rng(0))) == 9
        whole = batch.whole()
        assert len(whole.trained_rows) == batch.size and len(whole.state) == 9
        with pytest.raises(ValueError, match="num_minibatches"):
            batch.minibatches(0, np.random.default_rng(0))


def test_the_batch_is_cached_until_the_buffer_changes_and_needs_stored_states() -> None:
    with _buffer(set(), set()) as buffer:
        batch = buffer.sequence_batch("cpu", 2)
        assert buffer.sequence_batch("cpu", 2) is batch and buffer.observation_uploads == 1
        assert buffer.sequence_batch("cpu", 3) is not batch  # another length: another batch
        buffer.mark_untrainable(np.eye(T, N, dtype=bool))
        assert buffer.sequence_batch("cpu", 3).size == T * N - N
        assert buffer.observation_uploads == 3
    with RolloutBuffer(2, 1, (1,), np.float32) as plain:
        for _ in range(2):
            plain.add(
                np.zeros((1, 1), np.float32),
                np.zeros(1, np.int64),
                *np.zeros((3, 1), np.float32),
                np.zeros(1, bool),
            )
        plain.compute_gae(np.zeros(1, np.float32), np.zeros(1, bool), 0.99, 0.95)
        with pytest.raises(ValueError, match="no policy_state"):
            plain.sequence_batch("cpu", None)
