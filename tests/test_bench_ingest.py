"""benchmarks/bench_ingest.py runs end to end on a tiny budget (the figures themselves are not checked:
speed lives in the benchmark, not in tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ingest_benchmark_prints_its_figures_with_cartpole() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_ingest.py"), "--env", "CartPole-v1", "--seconds", "1",
         "--repeats", "1", "--no-training-load"],
        capture_output=True, text=True, timeout=240, check=False, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rate = re.search(r"^ingest \(env steps/s\)\s+([\d,]+)", result.stdout, re.MULTILINE)
    assert rate is not None and int(rate.group(1).replace(",", "")) > 0, result.stdout
    assert "ingest / memcpy bandwidth:" in result.stdout and "actor cores" in result.stdout, result.stdout
