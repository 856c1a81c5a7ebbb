"""The JSON-lines logs of a run folder (``metrics.jsonl``, ``episodes.jsonl``): reading them, and
cutting them back to a checkpoint when a run resumes, so ``global_step`` never goes back in either
file whatever the number of crashes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oakemu_core.run.atomic_files import replace_atomically

__all__ = [
    "LOG_FILE_NAMES",
    "read_json_lines",
    "resume_step",
    "truncate_after",
    "truncate_run_logs",
]

LOG_FILE_NAMES = ("metrics.jsonl", "episodes.jsonl")
"""The JSON-lines logs of a run folder that carry ``global_step``."""


def _read_records(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], int]:
    """``([(line, record), ...], torn)``: the complete JSON-object lines of a JSON-lines file, and how
    many lines were not (a record half-written by a crash, garbage)."""
    records: list[tuple[bytes, dict[str, Any]]] = []
    torn = 0
    with open(path, "rb") as source:
        for line in source:
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append((line, record))
            else:
                torn += 1
    return records, torn


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON-object records of a JSON-lines file (``metrics.jsonl``, ``episodes.jsonl``), in
    order; a torn or malformed line is skipped, a missing file reads as none.

    Raises:
        OSError: the file exists but cannot be read.
    """
    path = Path(path)
    return [record for _, record in _read_records(path)[0]] if path.is_file() else []


def truncate_after(path: Path, global_step: int, *, update: int | None = None) -> int:
    """Keep only the records of a JSON-lines file whose ``global_step`` is <= ``global_step`` and,
    with ``update``, whose ``charts/update`` is <= ``update``.

    Lines that are not complete JSON objects (a record half-written by a crash) are dropped too;
    records without a ``global_step`` are kept. The file is rewritten atomically (temporary file in
    the same folder, fsync, rename), so a crash during the cut leaves the old or the new file. A file
    with nothing to cut is not touched.

    Args:
        path: the ``.jsonl`` file; a missing file is left missing.
        global_step: the env-step count the resumed run starts from (:func:`resume_step`).
        update: the checkpoint's PPO update (None: records are cut by ``global_step`` alone).

    Returns:
        The number of lines removed.

    Raises:
        OSError: the file cannot be read or rewritten (the original is then untouched).
    """
    path = Path(path)
    if not path.is_file():
        return 0
    records, removed = _read_records(path)
    kept: list[bytes] = []
    for line, record in records:
        step, record_update = record.get("global_step"), record.get("charts/update")
        if (isinstance(step, (int, float)) and step > global_step) or (
            update is not None
            and isinstance(record_update, (int, float))
            and record_update > update
        ):
            removed += 1
        else:
            kept.append(line)
    if removed == 0:
        return 0
    replace_atomically(path, kept)
    return removed


def resume_step(run_dir: Path, checkpoint_step: int, update: int) -> int:
    """The env-step count a run resumed from the checkpoint of ``update`` starts from.

    A periodic checkpoint records the env steps received when its update's rollout was handed to
    training (``checkpoint_step``); the update's own metrics record was written when its result came
    back, some steps later. The resumed count starts at that record's ``global_step`` (when
    ``metrics.jsonl`` holds it), so the record is kept, ``charts/update`` continues without a gap and
    ``global_step`` never goes back. The steps in between were received and lost with the crash, as
    discarded rows are: ``global_step`` counts them, the budget (trained env steps) does not.
    """
    path = Path(run_dir) / LOG_FILE_NAMES[0]
    if not path.is_file():
        return int(checkpoint_step)
    steps = [
        record.get("global_step")
        for _, record in _read_records(path)[0]
        if record.get("charts/update") == update
    ]
    return max(
        [int(checkpoint_step)] + [int(step) for step in steps if isinstance(step, (int, float))]
    )


def truncate_run_logs(
    run_dir: Path, global_step: int, *, update: int | None = None
) -> dict[str, int]:
    """:func:`truncate_after` on each of :data:`LOG_FILE_NAMES` in ``run_dir``; returns lines removed by file name."""
    return {
        name: truncate_after(Path(run_dir) / name, global_step, update=update)
        for name in LOG_FILE_NAMES
    }
