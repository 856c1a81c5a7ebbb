"""Stacked-frame deduplication on the socket path: an actor sends an env's newest frame only when the
rest of its stack is what it sent the step before; the learner keeps each env's last stack and rebuilds.

A *stacked field* (:func:`stacked_fields`) is a sent observation field of dtype uint8 whose per-env
shape is ``(S, *frame)`` with ``S >= 2`` and at least two frame dimensions: Atari's ``(4, 84, 84)``,
an emulator's ``(4, H, W, 3)``; oldest frame first. In a step message of K vector steps of n envs
(:mod:`oakemu_core.transport.steps`) such a field travels as two ZeroMQ frames:

1. ``flags``: ``(K, n)`` bool, one byte per row, 1 where the row carries its whole stack;
2. ``data``: the newest frame of every row, ``(K, n, *frame)`` uint8 in row order, followed by the
   ``S - 1`` older frames of each flagged row, ``(count, S - 1, *frame)`` in row order.

A row goes without its older frames only when they equal frames ``1..S-1`` of the env's previous row
(the row before it in the block, or the env's last row of message ``seq - 1``): the rebuilt stack is
then byte-identical to the actor's whatever the env does (reset stacks simply fail the comparison and
go whole). The learner rebuilds a newest-frame-only row only from the last rows of message ``seq - 1``
of the same actor incarnation, and rejects the message otherwise (a message it rejected or never
received leaves no stack to rebuild from). So that such a learner recovers, the actor sends the first
row of every :data:`KEYFRAME_MESSAGES`-th message whole, as a video codec sends key frames.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from oakemu_core.step_schema import OBSERVATION_FIELD, StepField, StepSchema
from oakemu_core.transport.codec import checked_contents, reject

__all__ = [
    "KEYFRAME_MESSAGES",
    "stacked_fields",
    "wire_bytes_per_env",
    "StackEncoder",
    "StackHistories",
    "StackedRows",
    "decode_stacks",
    "rebuild_stacks",
]

KEYFRAME_MESSAGES = 64
"""Every message whose ``seq`` is a multiple of this sends its first row of every env whole (3 frames
of 4 every 64 steps: under 5 % more bytes for Atari)."""


def stacked_fields(schema: StepSchema) -> frozenset[str]:
    """Names of ``schema``'s sent fields that travel deduplicated (see the module docstring)."""
    return frozenset(
        f.name
        for f in schema.sent
        if f.dtype == np.uint8
        and len(f.shape) >= 3
        and f.shape[0] >= 2
        and (f.name == OBSERVATION_FIELD or f.name.startswith(OBSERVATION_FIELD + "."))
    )


def wire_bytes_per_env(schema: StepSchema) -> int:
    """Array bytes one env's step puts on the socket path in the steady state: every sent field whole,
    each stacked field as its newest frame (Atari, ``(4, 84, 84)``: 7,056 bytes instead of 28,224).
    Whole stacks after resets and in key-frame messages are not counted."""
    stacked = stacked_fields(schema)
    return sum(_frame_bytes(f) if f.name in stacked else f.item_bytes for f in schema.sent)


def _frame_bytes(item: StepField) -> int:
    return math.prod(item.shape[1:])


class StackEncoder:
    """The actor's side: the last row it sent of every env, per stacked field (one per channel, so a
    rejoined actor starts with whole stacks)."""

    def __init__(self) -> None:
        self.last: dict[str, np.ndarray] = {}

    def encode(
        self, item: StepField, array: np.ndarray, seq: int, num_envs: int
    ) -> tuple[bytes, bytearray]:
        """The ``flags`` and ``data`` frames of ``array`` (``(n, S, *frame)`` or ``(K, n, S, *frame)``
        uint8) in message ``seq``; remembers its last row.

        ``data`` is a fresh buffer, owned by the caller (it may go to ZeroMQ without a copy).
        """
        rows = np.ascontiguousarray(array).reshape(-1, num_envs, *item.shape)  # (K, n, S, *frame)
        steps = rows.shape[0]
        previous = None if seq % KEYFRAME_MESSAGES == 0 else self.last.get(item.name)
        whole = np.ones((steps, num_envs), dtype=bool)
        for k in range(steps):
            before = previous if k == 0 else rows[k - 1]
            if before is not None:
                whole[k] = _moved_on(rows[k, :, :-1], before[:, 1:])
        count = int(whole.sum())
        frame = _frame_bytes(item)
        newest_bytes = steps * num_envs * frame
        data = bytearray(newest_bytes + count * (item.shape[0] - 1) * frame)
        view = np.frombuffer(data, dtype=np.uint8)
        view[:newest_bytes].reshape(rows.shape[:2] + item.shape[1:])[...] = rows[:, :, -1]
        if count:
            view[newest_bytes:].reshape(count, item.shape[0] - 1, *item.shape[1:])[...] = rows[
                :, :, :-1
            ][whole]
        self.last[item.name] = rows[-1].copy()
        return whole.tobytes(), data


def _moved_on(older: np.ndarray, before: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: whether each env's older frames ``older[env]`` differ from ``before[env]`` (the
    newest ``S - 1`` frames of its previous row), every env in one comparison, as 4-byte words when a
    stack's bytes allow (a quarter of the elements: half the time of a ``tobytes()`` memcmp per env)."""
    num_envs = older.shape[0]
    older, before = (
        older.reshape(num_envs, -1),
        before.reshape(num_envs, -1),
    )  # views: each env's frames are contiguous
    if older.shape[1] % 4 == 0:
        older, before = older.view(np.uint32), before.view(np.uint32)
    return (older != before).any(axis=1)


def decode_stacks(
    item: StepField,
    flags_frame: memoryview,
    data_frame: memoryview,
    lead: tuple[int, ...],
    previous: np.ndarray | None,
) -> StackedRows:
    """The learner's side: the stacks of a stacked field from its two frames, checked, rebuilt where
    they are written (:meth:`StackedRows.write_into`: one copy of each row).

    Args:
        item: the stacked field, per-env shape ``(S, *frame)``.
        flags_frame, data_frame: the field's frames (module docstring).
        lead: ``(n,)`` or ``(K, n)``, the message's leading dimensions.
        previous: ``(n, S, *frame)``, the env's last rows of message ``seq - 1``, or None (none known).

    Raises:
        MessageRejected: ``"size"`` (a frame's length is not the one its flags declare), ``"schema"``
            (flag bytes other than 0 and 1; a newest-frame-only row with no stack to rebuild from).
    """
    name = item.name
    steps, num_envs = (1, lead[0]) if len(lead) == 1 else lead
    if flags_frame.nbytes != steps * num_envs:
        reject(
            "size",
            f"{name}: expected a flags frame of {steps * num_envs} bytes, received {flags_frame.nbytes}",
        )
    whole = checked_contents(np.frombuffer(flags_frame, dtype=bool), None, f"{name} flags").reshape(
        steps, num_envs
    )
    count = int(whole.sum())
    stack, frame = item.shape[0], _frame_bytes(item)
    newest_bytes = steps * num_envs * frame
    expected = newest_bytes + count * (stack - 1) * frame
    if data_frame.nbytes != expected:
        reject(
            "size",
            f"{name}: {count} whole stacks of {steps * num_envs} rows declare {expected} bytes, "
            f"received {data_frame.nbytes}",
        )
    if previous is None and not whole[0].all():
        env = int(np.flatnonzero(~whole[0])[0])
        reject(
            "schema",
            f"{name}: env {env} sent its newest frame only, but the learner holds no stack of it from "
            "the message before (a whole stack must come first)",
        )
    data = np.frombuffer(data_frame, dtype=np.uint8)
    newest = data[:newest_bytes].reshape(steps, num_envs, *item.shape[1:])
    older = data[newest_bytes:].reshape(count, stack - 1, *item.shape[1:])
    return StackedRows(item.shape, lead, whole, newest, older, previous)


def rebuild_stacks(
    item: StepField,
    flags_frame: memoryview,
    data_frame: memoryview,
    lead: tuple[int, ...],
    previous: np.ndarray | None,
) -> np.ndarray:
    """:func:`decode_stacks` rebuilt into a private, read-only ``(*lead, S, *frame)`` uint8 array."""
    return np.asarray(decode_stacks(item, flags_frame, data_frame, lead, previous))


class StackedRows:
    """The checked frames of a stacked field of one step message, an array-like of shape
    ``(*lead, S, *frame)`` and dtype uint8 that is rebuilt where it is written: :meth:`write_into` a
    view (the rollout buffer's rows: the one copy of each row), or ``np.asarray`` (a private,
    read-only array; indexing does this too). Made by :func:`decode_stacks`.

    Args:
        shape: the field's per-env shape ``(S, *frame)``.
        lead: ``(n,)`` or ``(K, n)``.
        whole: ``(K, n)`` bool, the rows sent whole.
        newest: ``(K, n, *frame)``, every row's newest frame.
        older: ``(count, S - 1, *frame)``, the older frames of the whole rows, in row order.
        previous: ``(n, S, *frame)``, the last rows of the message before, or None (every row of the
            first step whole).
    """

    dtype = np.dtype(np.uint8)

    def __init__(
        self,
        shape: tuple[int, ...],
        lead: tuple[int, ...],
        whole: np.ndarray,
        newest: np.ndarray,
        older: np.ndarray,
        previous: np.ndarray | None,
    ) -> None:
        self.shape = (*lead, *shape)
        self.ndim = len(self.shape)
        self._block = len(lead) == 2  # K > 1: (K, n, S, *frame)
        self._whole, self._newest, self._older, self._previous = whole, newest, older, previous
        self._counts = whole.sum(axis=1).tolist()  # whole rows per step
        self._array: np.ndarray | None = None

    def write_into(self, out: np.ndarray) -> None:
        """Rebuild the stacks into ``out`` (a writable array or view of :attr:`shape`; unless no row is
        whole, its step ``k - 1`` is read back to rebuild step ``k``)."""
        whole, newest, older = self._whole, self._newest, self._older
        steps, num_envs = whole.shape
        rows = out if self._block else out[None]  # (K, n, S, *frame), a view
        if not any(
            self._counts
        ):  # no whole row (decode_stacks then had the previous stacks): the usual message
            self._shift_into(rows)
            return
        taken = 0
        for k, row_count in enumerate(self._counts):
            row_whole = whole[k]
            if row_count < num_envs:
                rows[k, :, :-1] = (self._previous if k == 0 else rows[k - 1])[:, 1:]
            if row_count == num_envs:
                rows[k, :, :-1] = older[taken : taken + row_count]
            elif row_count:
                rows[k, row_whole, :-1] = older[taken : taken + row_count]
            rows[k, :, -1] = newest[k]
            taken += row_count

    def _shift_into(self, rows: np.ndarray) -> None:
        """``rows`` (``(K, n, S, *frame)``) when no row is whole, each step by :meth:`_shift_step_into`,
        every frame copied from the message (about 7 % faster into shared memory than reading step
        ``k - 1`` back)."""
        assert (
            self._previous is not None
        )  # decode_stacks: a message without whole rows has previous stacks
        for k in range(self._newest.shape[0]):
            self._shift_step_into(k, rows[k])

    def _shift_step_into(self, k: int, out: np.ndarray) -> None:
        """``out`` (``(n, S, *frame)``): step ``k``'s stacks as the previous message's last stacks moved
        on by the newest frames of steps ``0..k``: right for every env without a whole row up to step
        ``k`` (without previous stacks, the frames before them are left as they were)."""
        newest, previous = self._newest, self._previous
        stack = self._older.shape[1] + 1
        kept = max(
            0, stack - 1 - k
        )  # frames of the previous message's last stacks still in step k's
        if kept and previous is not None:
            out[:, :kept] = previous[:, stack - kept :]
        out[:, kept:] = newest[k + 1 - (stack - kept) : k + 1].swapaxes(0, 1)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The rebuilt stacks: one private read-only array made at the first call; a writable copy
        when ``copy`` is true or ``dtype`` is another (numpy's ``__array__`` protocol)."""
        if self._array is None:
            array = np.empty(self.shape, dtype=np.uint8)
            self.write_into(array)
            array.flags.writeable = False
            self._array = array
        if dtype is not None and np.dtype(dtype) != self.dtype:
            return self._array.astype(dtype)
        return self._array.copy() if copy else self._array

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.asarray(self)[key]

    def last_rows(self) -> np.ndarray:
        """A read-only ``(n, S, *frame)`` array of the last step's stacks (what the next message is
        rebuilt from), made from the frames without rebuilding the other steps: a view of them when
        the message has K >= S steps and no whole row, else a private array."""
        if self._array is not None:
            return self._array[-1] if self._block else self._array
        whole, newest, older = self._whole, self._newest, self._older
        steps, num_envs = whole.shape
        stack = older.shape[1] + 1
        if steps >= stack and not any(self._counts):  # the S newest frames of each env: no copy
            view = newest[steps - stack :].swapaxes(0, 1)
            view.flags.writeable = False
            return view
        out = np.empty((num_envs, stack, *newest.shape[2:]), dtype=np.uint8)
        # Envs without a whole row in the message: the previous stack moved on by the K newest frames
        # (without a previous stack every env's first row is whole: the loop below fills them all).
        self._shift_step_into(steps - 1, out)
        order = (
            np.cumsum(whole.ravel()).reshape(whole.shape) - 1
        )  # each whole row's place in ``older``
        for env in np.flatnonzero(
            whole.any(axis=0)
        ):  # from its last whole row on (resets, key frames)
            last = int(np.flatnonzero(whole[:, env])[-1])
            frames = [*older[order[last, env]], *newest[last:, env]]
            out[env] = np.stack(frames[-stack:])
        out.flags.writeable = False
        return out


class StackHistories:
    """The learner's side: per actor incarnation, the last rows of its stacked fields and the ``seq`` of
    the message they came from (what :func:`rebuild_stacks` rebuilds the next message from)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[int, dict[str, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def previous(
        self, actor_id: str, incarnation: str, seq: int
    ) -> Mapping[str, np.ndarray] | None:
        """The last rows (field -> ``(n, S, *frame)``) of that incarnation's message ``seq - 1``, or None."""
        entry = self._last.get((actor_id, incarnation))
        return entry[1] if entry is not None and entry[0] == seq - 1 else None

    def remember(
        self,
        actor_id: str,
        incarnation: str,
        seq: int,
        fields: Mapping[str, np.ndarray | StackedRows],
        names: Iterable[str],
        block: bool,
    ) -> None:
        """Keep the last rows of ``names`` in ``fields`` (a decoded message's arrays, ``(K, n, ...)`` when
        ``block`` else ``(n, ...)``: :class:`StackedRows`, or read-only private arrays kept without a copy)."""
        self._last[(actor_id, incarnation)] = (
            seq,
            {name: _last_rows(fields[name], block) for name in names},
        )

    def forget(self, actor_id: str, incarnation: str) -> None:
        """Forget the last rows of that incarnation (it left, timed out or rejoined)."""
        self._last.pop((actor_id, incarnation), None)

    def retain(self, keys: set[tuple[str, str]]) -> None:
        """Forget every incarnation not in ``keys`` (actors that left, timed out or rejoined)."""
        for key in [key for key in self._last if key not in keys]:
            del self._last[key]


def _last_rows(value: np.ndarray | StackedRows, block: bool) -> np.ndarray:
    if isinstance(value, StackedRows):
        return value.last_rows()
    return value[-1] if block else value
