"""Callbacks of the Python API's ``train``: user code called on each PPO update and each evaluation of
a run, able to stop it early.

    import oakemu_core

    class StopAtReturn(oakemu_core.Callback):
        def on_evaluation(self, info):
            return info.return_mean < 475      # False stops the run

    run = oakemu_core.train(preset="cartpole", callbacks=[StopAtReturn()])
    run.stopped_by_callback                    # True when it stopped the run

A callback is a :class:`Callback` (override :meth:`Callback.on_update`, :meth:`Callback.on_evaluation`
or both) or a plain callable, called with an :class:`UpdateInfo` after each update and an
:class:`EvaluationInfo` after each evaluation. Returning ``False`` stops the run (as
Stable-Baselines3's ``_on_step``); ``None`` or ``True`` lets it go on.

The callbacks run in the process that called ``train`` (not in the learner) from the run's
``metrics.jsonl`` records, in order, each record once: the learner trains on while a callback runs,
so a callback that stops the run stops it within an update or so, never in the middle of one.
:class:`CallbackRunner` is the launcher's side: it feeds the records to the callbacks and keeps why
the run should stop (a ``False``, or the first exception a callback raised).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oakemu_core.run.metrics import EVAL_EPISODIC_RETURN, record_number

__all__ = ["Callback", "CallbackRunner", "EvaluationInfo", "RecordFollower", "UpdateInfo"]


@dataclass(frozen=True)
class UpdateInfo:
    """One PPO update, from its ``metrics.jsonl`` record (CleanRL's names in :attr:`metrics`).

    Attributes:
        update: the update's number (1 for the run's first; a resumed run goes on counting).
        global_step: env steps received when the update was made.
        episodic_return: mean raw return of the recent episodes (``charts/episodic_return``); None
            before the first episode ended.
        episodic_length: their mean length in env steps.
        policy_loss, value_loss, entropy, approx_kl, clip_fraction, explained_variance: the update's
            statistics (``losses/*``); None for an update without trainable rows.
        learning_rate: the optimizer's learning rate.
        sps: env steps per second since the learner started (``charts/SPS``).
        metrics: the whole record (``charts/*``, ``losses/*``, ``diagnostics/*``; numbers or None).
    """

    update: int
    global_step: int
    episodic_return: float | None
    episodic_length: float | None
    policy_loss: float | None
    value_loss: float | None
    entropy: float | None
    approx_kl: float | None
    clip_fraction: float | None
    explained_variance: float | None
    learning_rate: float | None
    sps: float | None
    metrics: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> UpdateInfo:
        """The info of a ``metrics.jsonl`` update record (one with ``charts/update``)."""

        def number(name: str) -> float | None:
            return record_number(record, name)

        return cls(
            update=int(record["charts/update"]),
            global_step=int(record.get("global_step", 0)),
            episodic_return=number("charts/episodic_return"),
            episodic_length=number("charts/episodic_length"),
            policy_loss=number("losses/policy_loss"),
            value_loss=number("losses/value_loss"),
            entropy=number("losses/entropy"),
            approx_kl=number("losses/approx_kl"),
            clip_fraction=number("losses/clipfrac"),
            explained_variance=number("losses/explained_variance"),
            learning_rate=number("charts/learning_rate"),
            sps=number("charts/SPS"),
            metrics=dict(record),
        )


@dataclass(frozen=True)
class EvaluationInfo:
    """One evaluation of the tester (the run's periodic evaluation in a process of its own).

    Attributes:
        policy_version: version of the weights it played (0: the initial weights).
        global_step: env steps received when it was recorded.
        return_mean: mean raw episodic return (``eval/episodic_return``).
        return_std: population std of the returns, None when not recorded.
        length_mean: mean episode length in agent steps, None when not recorded.
        best_return: the highest ``return_mean`` of the run so far, this one included.
        is_best: this evaluation is the best so far (the tester keeps its weights as ``best.pt``).
        metrics: the whole record (``eval/*``).
    """

    policy_version: int
    global_step: int
    return_mean: float
    return_std: float | None
    length_mean: float | None
    best_return: float
    is_best: bool
    metrics: Mapping[str, Any] = field(repr=False)


class Callback:
    """Base class of a ``train`` callback: override what you need; each returns ``False`` to stop the
    run, ``None`` (or ``True``) to go on. An exception stops the run too, and ``train`` raises it
    once the run is stopped."""

    def on_update(self, info: UpdateInfo) -> bool | None:
        """Called after each PPO update."""
        return None

    def on_evaluation(self, info: EvaluationInfo) -> bool | None:
        """Called after each evaluation."""
        return None


CallbackLike = Callback | Callable[[UpdateInfo | EvaluationInfo], bool | None]
"""A :class:`Callback`, or a callable taking an :class:`UpdateInfo` or :class:`EvaluationInfo`."""


def _name(callback: object) -> str:
    return getattr(callback, "__name__", None) or type(callback).__name__


class CallbackRunner:
    """Calls ``callbacks`` (in their order) for ``metrics.jsonl`` records and keeps why to stop.

    Args:
        callbacks: one :data:`CallbackLike` or an iterable of them.

    Raises:
        TypeError: a callback is neither a :class:`Callback` nor callable.
    """

    def __init__(self, callbacks: CallbackLike | Iterable[CallbackLike]) -> None:
        items = (
            [callbacks]
            if isinstance(callbacks, Callback) or callable(callbacks)
            else list(callbacks)
        )
        for item in items:
            if not (isinstance(item, Callback) or callable(item)):
                raise TypeError(
                    f"callbacks: expected a Callback or a callable, received {type(item).__name__}"
                )
        self.callbacks: list[Any] = items
        self.stop_reason: str | None = None
        """Why a callback stopped the run (``"<name> returned False at update N"``); None while none did."""
        self.error: BaseException | None = None
        """The first exception a callback raised (the run stops; ``train`` raises it afterwards)."""
        self.best_return: float | None = None
        self._may_stop = True

    @property
    def stopping(self) -> bool:
        """A callback returned False or raised: the run should stop."""
        return self.stop_reason is not None

    def feed(self, records: Iterable[Mapping[str, Any]], *, may_stop: bool = True) -> bool:
        """Call the callbacks for each update and evaluation record of ``records`` until one asks to
        stop; returns :attr:`stopping`. Records after a stop are not given to callbacks.
        ``may_stop=False`` (the records of a run that has ended) ignores a ``False``; an exception
        is still kept."""
        self._may_stop = may_stop
        for record in records:
            if self.stopping:
                break
            if "charts/update" in record:
                self._call(
                    "on_update",
                    UpdateInfo.from_record(record),
                    f"update {int(record['charts/update'])}",
                )
            value = record_number(record, EVAL_EPISODIC_RETURN)
            if value is not None and not self.stopping:
                self.best_return = (
                    value if self.best_return is None else max(self.best_return, value)
                )
                version = int(record_number(record, "eval/policy_version") or 0)
                info = EvaluationInfo(
                    policy_version=version,
                    global_step=int(record.get("global_step", 0)),
                    return_mean=value,
                    return_std=record_number(record, "eval/episodic_return_std"),
                    length_mean=record_number(record, "eval/episodic_length"),
                    best_return=self.best_return,
                    is_best=value >= self.best_return,
                    metrics=dict(record),
                )
                self._call("on_evaluation", info, f"the evaluation of policy version {version}")
        return self.stopping

    def _call(self, method: str, info: UpdateInfo | EvaluationInfo, where: str) -> None:
        for callback in self.callbacks:
            function = getattr(callback, method) if isinstance(callback, Callback) else callback
            name = (
                f"{_name(type(callback))}.{method}"
                if isinstance(callback, Callback)
                else _name(callback)
            )
            try:
                answer = function(info)
            except Exception as error:  # noqa: BLE001 - any user error stops the run; train() re-raises it
                self.error = error
                self.stop_reason = f"{name} raised {type(error).__name__}: {error} at {where}"
                return
            if answer is False and self._may_stop:
                self.stop_reason = f"{name} returned False at {where}"
                return


class RecordFollower:
    """The records appended to a JSON-lines file (``metrics.jsonl``) since the last call, each once.

    Records whose ``wall_time`` is before ``since`` (epoch seconds: those of an earlier session of a
    resumed run) are skipped; a torn last line waits for the rest of it; a malformed line is skipped.
    A file that shrank (a resumed run's learner cut it) is read again from its start.
    """

    def __init__(self, path: Path, since: float) -> None:
        self.path = Path(path)
        self.since = float(since)
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        """The complete records appended since the last call ([] when the file is missing or unreadable)."""
        try:
            with open(self.path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size < self._offset:
                    self._offset = 0
                if size == self._offset:
                    return []
                file.seek(self._offset)
                data = file.read(size - self._offset)
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(record, dict)
                and (record_number(record, "wall_time") or self.since) >= self.since
            ):
                records.append(record)
        return records
