"""The monitor shows the newest evaluation video and the best evaluation return so far; both
travel in the telemetry snapshot and through a checkpoint of the history."""

from __future__ import annotations

import dataclasses

from oakemu_services import monitor
from rich.console import Console

from oakemu_core.run.telemetry import decode_snapshot, encode_snapshot
from oakemu_core.run.telemetry_history import TelemetryHistory
from tests.run.test_eval_telemetry import report
from tests.services.test_monitor import make_snapshot


def test_the_newest_video_and_the_best_return_reach_the_monitor() -> None:
    history = TelemetryHistory()
    history.record_evaluation(
        dataclasses.replace(report(10, 30.0), video_path="runs/r/videos/update_10.mp4")
    )
    history.record_evaluation(
        dataclasses.replace(report(20, 25.0), video_path="runs/r/videos/update_20.mp4")
    )
    history.record_evaluation(
        report(30, 12.0)
    )  # no video this time (e.g. the env could not render)
    fields = history.snapshot_fields()
    assert (
        fields["eval_video"] == "runs/r/videos/update_20.mp4" and fields["best_eval_return"] == 30.0
    )

    snapshot = decode_snapshot(encode_snapshot(make_snapshot(5000, **fields)))
    assert snapshot.eval_video == "runs/r/videos/update_20.mp4"
    console = Console(width=200, record=True)
    console.print(monitor.render_snapshot(snapshot, address="tcp://127.0.0.1:5558", age_s=0.5))
    text = console.export_text()
    assert "runs/r/videos/update_20.mp4" in text and "30.00" in text

    restored = TelemetryHistory()
    restored.load_state_dict(history.state_dict())
    assert restored.snapshot_fields()["eval_video"] == "runs/r/videos/update_20.mp4"
