"""Tests for benchmarks/gpu_check_all.py (the prepared device check), benchmarks/bounded_steps.py (a
step that cannot outlive its time) and benchmarks/pytest_outcomes.py (test outcomes kept as they come)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import benchmarks.bounded_steps as bounded_steps
import benchmarks.gpu_check_all as gpu_check_all
from benchmarks.pytest_outcomes import OUTCOMES_ENV
from tests.e2e_helpers import REPO_ROOT, SHM_DIR

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check_all.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_step_past_its_time_is_stopped_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that ignores SIGINT and SIGTERM and started a child in a session of its own (as
    ``oakemu train`` starts its learner) holding a shared-memory segment: after its time it is
    killed, the child too, the child's segment is removed, and its output is in the log."""
    monkeypatch.setattr(bounded_steps, "INTERRUPT_GRACE_S", 0.5)
    monkeypatch.setattr(bounded_steps, "TERMINATE_GRACE_S", 0.5)
    pid_file = tmp_path / "child.pid"
    child = textwrap.dedent(f"""
        import os, pathlib, time
        pathlib.Path({str(SHM_DIR)!r}, f"oakemu_{{os.getpid()}}_0a_test").write_bytes(b"x")
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(120)
    """)
    step = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", {child!r}], start_new_session=True)
        print("step started", flush=True)
        time.sleep(120)
    """)
    start = time.monotonic()
    status, returncode, seconds = bounded_steps.run_command(
        [sys.executable, "-c", step], tmp_path / "step.log", 2.0
    )
    assert status == "timeout" and returncode is not None and returncode < 0
    assert seconds < 30 and time.monotonic() - start < 30
    assert "step started" in (tmp_path / "step.log").read_text()
    child_pid = int(pid_file.read_text())
    assert not _alive(child_pid)
    assert not list(SHM_DIR.glob(f"oakemu_{child_pid}_*"))


def test_a_command_that_ends_is_ok_or_failed_by_its_exit_status(tmp_path: Path) -> None:
    assert bounded_steps.run_command([sys.executable, "-c", "pass"], tmp_path / "a.log", 30)[
        :2
    ] == (
        "ok",
        0,
    )
    failed = bounded_steps.run_command(
        [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "b.log", 30
    )
    assert failed[:2] == ("failed", 3)


def test_the_outcomes_plugin_keeps_one_line_per_test_as_pytest_reports_it(tmp_path: Path) -> None:
    """A pass, a failure, a skip and an error in setup: one JSON line each, with the failure's
    first ``E`` line and the skip's reason; :func:`gpu_check_all.test_figures` counts them."""
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("no device")

        def test_passes():
            assert True

        def test_fails():
            assert 1 + 1 == 3

        def test_skips():
            pytest.skip("no CUDA device")

        def test_errors(broken):
            pass
        """)
    )
    outcomes = tmp_path / "tests.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(tests),
            "-p",
            "benchmarks.pytest_outcomes",
            "-p",
            "no:cacheprovider",
            f"--junitxml={tmp_path / 'junit.xml'}",
            "-q",
            f"--rootdir={tmp_path}",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, OUTCOMES_ENV: str(outcomes)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    records = {
        r["nodeid"].split("::")[-1]: r for r in map(json.loads, outcomes.read_text().splitlines())
    }
    assert {name: r["outcome"] for name, r in records.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_errors": "failed",
    }
    assert (
        records["test_fails"]["message"].startswith("E ")
        and "assert" in records["test_fails"]["message"]
    )
    assert records["test_skips"]["message"] == "Skipped: no CUDA device"
    assert (
        records["test_errors"]["when"] == "setup"
        and "no device" in records["test_errors"]["message"]
    )
    figures = gpu_check_all.test_figures(tmp_path)
    assert figures["outcomes"] == {"passed": 1, "failed": 2, "skipped": 1}
    assert {item["test"].split("::")[-1] for item in figures["failed"]} == {
        "test_fails",
        "test_errors",
    }
    assert figures["junit"] == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1}


def test_a_spent_budget_starts_no_step_and_the_summary_says_so(tmp_path: Path) -> None:
    """With a budget below a step's minimum every asked step is ``no time``, the one not asked for
    ``skipped``; the summary is complete, and the exit status is 1 (nothing was checked)."""
    out = tmp_path / "check"
    status = gpu_check_all.main(
        [
            "--out",
            str(out),
            "--quick",
            "--device",
            "cpu",
            "--budget-s",
            "1",
            "--steps",
            "tests,overhead_eager,breakout",
        ]
    )
    assert status == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["environment"]["torch"]
    assert {name: step["status"] for name, step in summary["steps"].items()} == {
        "tests": "no time",
        "overhead_eager": "no time",
        "overhead_compiled": "skipped",
        "breakout": "no time",
        "central_inference": "skipped",
    }
    assert "| tests | no time |" in (out / "summary.md").read_text()
    assert json.loads((out / "environment.json").read_text())["device"] == "cpu"


def test_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, expected in (
        (["--out", str(tmp_path), "--steps", "tests,benchmarks"], "--steps: unknown benchmarks"),
        (["--out", str(tmp_path), "--budget-s", "0"], "expected --budget-s > 0"),
        (["--out", str(SCRIPT)], "exists and is not a folder"),
    ):
        result = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


@pytest.mark.slow
def test_the_quick_form_runs_its_steps_and_writes_every_figure(tmp_path: Path) -> None:
    """``--quick --device cpu`` (the compiled update and central inference left out: their inductor
    compile and runs are other tests' time): every step ``ok``; the tests passed with one JSON line
    each and the same totals in junit.xml; the update overhead with the actors' and learner's
    log-probs agreeing; the Breakout run trained its update on the CPU."""
    out = tmp_path / "check"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(out),
            "--quick",
            "--device",
            "cpu",
            "--steps",
            "tests,overhead_eager,breakout",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert result.returncode == 0, json.dumps(steps, indent=1) + result.stderr
    assert summary["finished"] and summary["environment"]["device_name"] == "cpu"
    tests = steps["tests"]["figures"]
    assert tests["outcomes"]["passed"] >= 5 and tests["failed"] == []
    assert tests["junit"]["tests"] == sum(tests["outcomes"].values())
    eager = steps["overhead_eager"]["figures"]
    assert eager["compile_update"] == "none"
    assert eager["update"]["ratio_deviation_max"] < 1e-5
    assert eager["update"]["production_ms"] > 0 and eager["update"]["bare_ms"] > 0
    assert eager["compile"]["mode"] == "none" and not eager["compile"]["still_compiled"]
    assert eager["end_to_end"]["updates"] >= 1
    breakout = steps["breakout"]["figures"]
    assert breakout["updates"] >= 1 and breakout["global_step"] >= 1024
    assert breakout["learner_device"] == "cpu"
    assert steps["overhead_compiled"]["status"] == steps["central_inference"]["status"] == "skipped"
    table = (out / "summary.md").read_text()
    assert all(f"| {name} | ok |" in table for name in ("tests", "overhead_eager", "breakout"))
