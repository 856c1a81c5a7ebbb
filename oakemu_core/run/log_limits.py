"""Rate-limited logging: a peer that can trigger a log line must not be able to flood the log.

:class:`RateLimitedLog` logs the first event of each reason in full, then at most one summary line
per ``period_s`` for everything that happened since the last line::

    rejected step message: garbage: frame is not msgpack (ExtraData ...)          # first of its reason
    rejected 1234 step messages in the last 5.0 s: schema 1000, garbage 234 (last: schema: ...)

With ``burst`` > 0 the first ``burst`` further events of each period are logged in full too (the
lines of an actor joining or leaving, which a user wants to read one by one until a flood makes
them a summary). The caller keeps its own exact counters; this class only decides what reaches the log. It holds
no thread or timer: a summary is written by the next :meth:`RateLimitedLog.event` after the period
ended, or by :meth:`RateLimitedLog.flush` (call it from a loop that runs anyway, so the last burst is
reported even when no further event comes). Not thread-safe: use one instance per thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Log events by reason: the first of each reason in full, then a summary every ``period_s``.

    Args:
        logger: where the lines go.
        what: plural noun phrase for summaries, e.g. ``"step messages"`` ->
            ``"rejected 12 step messages in the last 5.0 s: ..."``.
        verb: the action of the summary line (default ``"rejected"``).
        first_prefix: prefix of the full first line of a reason, e.g. ``"rejected step message"``
            -> ``"rejected step message: <detail>"``; ``""``: the detail alone.
        period_s: shortest time (seconds) between two summary lines; > 0.
        level: logging level of every line (default WARNING; :meth:`event` may name another).
        burst: events per period logged in full beyond the first of each reason; >= 0.
        clock: monotonic clock in seconds (tests pass a fake one).

    Raises:
        ValueError: ``period_s`` <= 0 or ``burst`` < 0.

    Bound: for ``R`` distinct reasons over ``D`` seconds at most ``R + (burst + 1) * (D / period_s + 1)``
    lines are written, whatever the event rate.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        first_prefix: str,
        verb: str = "rejected",
        period_s: float = 5.0,
        level: int = logging.WARNING,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s: expected > 0, got {period_s}")
        if burst < 0:
            raise ValueError(f"burst: expected >= 0, got {burst}")
        self.logger = logger
        self.what = what
        self.first_prefix = first_prefix
        self.verb = verb
        self.period_s = float(period_s)
        self.level = level
        self.burst = int(burst)
        self.clock = clock
        self._burst_left = self.burst
        self._burst_period_end = -float("inf")
        self._seen_reasons: set[str] = set()
        self._pending: Counter[str] = Counter()  # events since the last line that no line reported
        self._last_detail = ""
        self._window_start: float | None = None
        self._next_summary = 0.0
        self.lines_written = 0
        """Log lines written so far (first lines + summaries)."""
        self.events = 0
        """Events seen so far (logged or not)."""

    def event(self, reason: str, detail: str, *, level: int | None = None) -> None:
        """Record one event of ``reason``; ``detail`` is the full message (e.g. ``str(error)``).

        The first event of a reason is logged at once (``"<first_prefix>: <detail>"``), and so are
        the first ``burst`` others of each period; later ones are counted and reported by the next
        summary line, written once ``period_s`` passed since the previous line. ``level``: this
        event's full line's level (default: the instance's).
        """
        now = self.clock()
        self.events += 1
        if self.burst and now >= self._burst_period_end:
            self._burst_left, self._burst_period_end = self.burst, now + self.period_s
        first = reason not in self._seen_reasons
        if first or (
            self._burst_left > 0 and not self._pending
        ):  # in full; a summary keeps the order
            if first:
                self._seen_reasons.add(reason)
            else:
                self._burst_left -= 1
            self._write(f"{self.first_prefix}: {detail}" if self.first_prefix else detail, level)
            if self._window_start is None:
                self._window_start = now
                self._next_summary = now + self.period_s
            return
        if self._window_start is None:
            self._window_start = now
            self._next_summary = now + self.period_s
        self._pending[reason] += 1
        self._last_detail = detail
        if now >= self._next_summary:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Write the summary line of the pending events if ``period_s`` has passed since the last line
        (or ``now`` is past it); does nothing when no event is pending."""
        now = self.clock() if now is None else now
        if not self._pending or now < self._next_summary:
            return
        total = sum(self._pending.values())
        elapsed = now - (self._window_start if self._window_start is not None else now)
        reasons = ", ".join(f"{reason} {count}" for reason, count in self._pending.most_common())
        self._write(
            f"{self.verb} {total} {self.what} in the last {elapsed:.1f} s: {reasons} "
            f"(last: {self._last_detail})"
        )
        self._pending.clear()
        self._window_start = now
        self._next_summary = now + self.period_s

    def _write(self, line: str, level: int | None = None) -> None:
        self.lines_written += 1
        self.logger.log(self.level if level is None else level, "%s", line)
