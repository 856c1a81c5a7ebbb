"""Writing an actor's segment: its step messages into its columns of a rollout buffer, row by row.

A *segment* (:class:`~oakemu_core.storage.buffer_ring.Segment`) is up to ``num_envs`` columns of one
filling buffer that one actor fills for ``T`` rows. :class:`SegmentWriter` writes a message's ``K``
rows (an actor given fewer columns than it has envs loses the rows of its extra envs, counted as
``no_capacity_steps``), completes the segment with the bootstrap data of its last row, or discards
an unfinished one (its rows counted as ``discarded_segment_rows``). Which actor gets columns and
which messages are written is the rollout assembler's
(:class:`~oakemu_core.storage.assembler.RolloutAssembler`).
"""

from __future__ import annotations

import itertools

from oakemu_core.storage.actors import ActorRecord, IngestCounters
from oakemu_core.storage.buffer_ring import BufferRing
from oakemu_core.transport.steps import StepMessage

__all__ = ["SegmentWriter"]


class SegmentWriter:
    """Writes segments into the buffers of ``ring``, counting in ``counters``.

    Args:
        ring: the learner's buffer ring.
        counters: the ingest counters (``env_steps``, dropped rows).
        full_when_all: a buffer is full when every column is complete (asynchronous mode); False:
            the caller decides (synchronous mode, :meth:`BufferRing.mark_full`).
    """

    def __init__(self, ring: BufferRing, counters: IngestCounters, *, full_when_all: bool) -> None:
        self._ring = ring
        self.counters = counters
        self.full_when_all = full_when_all
        self._started = itertools.count(1)  # numbers the segments started: ActorRecord.served

    def write(self, record: ActorRecord, message: StepMessage) -> bool:
        """Write one message (validated against the buffers' schema) into the actor's segment; the
        segment's last row completes it (``record.segment`` becomes None). Returns True when this
        made its buffer full.

        Raises:
            ValueError, OverflowError: the row bookkeeping disagrees; nothing was written and the
                segment is discarded.
        """
        segment = record.segment
        assert segment is not None
        num_envs, rows, k = record.spec.num_envs, message.num_steps, len(segment.columns)
        fields = message.fields
        if k < num_envs:  # fewer free columns than envs: the first k envs are written
            fields = {
                name: array[:k] if rows == 1 else array[:, :k] for name, array in fields.items()
            }
        try:  # decode_step validated the fields against the buffers' schema (checked at join)
            self._ring.buffers[segment.slot].write(
                segment.rows_written,
                segment.index,
                fields,
                rows=None if rows == 1 else rows,
                policy_version=message.policy_version,
                policy_revision=message.revision,
                validated=True,
            )
        except (ValueError, OverflowError):
            self.discard(record)
            raise
        if segment.rows_written == 0:  # its place in the drain order
            record.served = next(self._started)
        segment.rows_written += rows
        record.env_steps += k * rows
        self.counters.env_steps += k * rows
        if k < num_envs:
            self.counters.dropped["no_capacity_steps"] += (num_envs - k) * rows
        if segment.rows_written < self._ring.rollout_length:
            return False
        last = message.num_steps - 1  # the block's last step ends the segment
        next_values, dones = message.fields["next_values"], message.fields["dones"]
        record.segment = None
        return self._ring.complete(
            segment,
            (next_values if last == 0 else next_values[last])[:k],
            (dones if last == 0 else dones[last])[:k],
            full_when_all=self.full_when_all,
        )

    def discard(self, record: ActorRecord) -> None:
        """Empty and free the actor's unfinished segment, if it has one."""
        segment = record.segment
        if segment is None:
            return
        self._ring.discard(segment)
        self.counters.dropped["discarded_segment_rows"] += segment.rows_written * len(
            segment.columns
        )
        record.segment = None
