"""A pytest plugin that appends each test's outcome to a JSON-lines file as pytest reports it, so that
a run cut short (a time limit, a killed machine) keeps the outcomes it had reached; pytest's own
``--junitxml`` report is written only when the session ends.

Load it with ``python -m pytest -p benchmarks.pytest_outcomes`` from the repository's root and name
the file in the environment variable :data:`OUTCOMES_ENV` (no variable: the plugin does nothing).
Each line is one JSON object: ``nodeid``, ``when`` (``call``, or ``setup`` / ``teardown`` for a
failed or skipped one), ``outcome`` (``passed``, ``failed``, ``skipped``), ``seconds`` and, for a
failed or skipped test, ``message`` (its first ``E`` line, or the skip reason; at most 300 chars).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["OUTCOMES_ENV", "pytest_runtest_logreport"]

OUTCOMES_ENV = "PYTEST_OUTCOMES_JSONL"


def pytest_runtest_logreport(report: Any) -> None:
    """Append ``report``'s line (a call phase, or a setup or teardown that did not pass), flushed."""
    path = os.environ.get(OUTCOMES_ENV)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 3),
    }
    if report.failed or report.skipped:
        if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, reason)
            text = str(report.longrepr[2])
        else:
            text = report.longreprtext
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E ")]
        record["message"] = (errors or lines or [""])[0][:300]
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
