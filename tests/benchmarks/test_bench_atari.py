"""benchmarks/bench_atari_vs_sb3.py: the command OakEmu's side runs (it parses as an `oakemu train` command
line), where a record is kept, the report's arithmetic on hand-made records, and one-line refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from oakemu_services import cli

from tests.benchmarks.script_helpers import BENCHMARKS, REPO_ROOT, load_script

SCRIPT = BENCHMARKS / "bench_atari_vs_sb3.py"
bench = load_script("bench_atari_vs_sb3")


def _record(system: str, seed: int, curve: list[float], last100: float, wall: float) -> dict:
    return {
        "system": system,
        "env": "ALE/Breakout-v5",
        "seed": seed,
        "steps": 1000,
        "curve": curve,
        "last100": last100,
        "wall_s": wall,
        "sps": 1000 / wall,
        "load_1min": [1.0, 2.0],
    }


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_oakemu_side_is_the_atari_preset_with_budget_seed_and_no_evaluation(tmp_path: Path) -> None:
    command = bench.oakemu_command(
        env_id="ALE/Pong-v5",
        seed=3,
        steps=5000,
        runs_dir=tmp_path,
        run_name="r",
        extra=["--mode", "async"],
    )
    assert command[:4] == [sys.executable, "-m", "oakemu_services.cli", "train"]
    parser, _ = cli.build_parser()
    parsed = parser.parse_args(command[3:])
    assert parsed.preset == "atari"
    assert (parsed.env_id, parsed.seed, parsed.total_env_steps) == ("ALE/Pong-v5", 3, 5000)
    assert (parsed.eval_every_updates, parsed.mode) == (0, "async")


def test_records_live_per_game_label_seed_and_budget(tmp_path: Path) -> None:
    path = bench.result_path(tmp_path, "ALE/Breakout-v5", "oakemu-async", 2, 1_000_000)
    assert path == tmp_path / "breakout" / "oakemu-async-seed2-1000000.json"


def test_report_means_over_seeds_and_ratios_to_sb3_at_the_same_seeds() -> None:
    flat = [1.0] * 10
    records = [
        _record("sb3", 1, flat, 10.0, 100.0),
        _record("sb3", 2, [3.0] * 10, 20.0, 300.0),
        _record("oakemu", 1, [2.0] * 5 + [0.0] * 5, 12.0, 50.0),
        _record("oakemu", 2, [4.0] * 5 + [2.0] * 5, 18.0, 100.0),
    ]
    lines = bench.report(records).splitlines()
    oakemu = next(line for line in lines if "| oakemu |" in line)
    cells = _cells(oakemu)
    # windows: (2+4)/2 = 3.0 then (0+2)/2 = 1.0; SB3's mean window is 2.0 -> 5 of 10 at least SB3's.
    assert cells[4:14] == ["3.0"] * 5 + ["1.0"] * 5
    assert cells[14] == "15.0" and cells[15] == "75"  # last100 mean, wall mean
    assert cells[17:20] == ["1.00", "5/10", "0.38"]  # 15/15, windows >= SB3, 75/200
    sb3 = next(line for line in lines if "| sb3 |" in line)
    assert _cells(sb3)[17:20] == ["-", "-", "-"]  # no ratios for the reference itself


def test_report_leaves_ratios_out_without_sb3_runs_of_the_same_seeds() -> None:
    records = [_record("sb3", 1, [1.0] * 10, 10.0, 100.0), _record("oakemu", 2, [1.0] * 10, 9, 50)]
    oakemu = next(line for line in bench.report(records).splitlines() if "| oakemu |" in line)
    assert _cells(oakemu)[17:20] == ["-", "-", "-"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["--label", "sb3"], "--label: 'sb3' names the SB3 runs"), (["--report"], "no records")],
)
def test_mistakes_are_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and expected in done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
