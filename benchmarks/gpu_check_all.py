"""The prepared device check: the learner's GPU tests and figures in one bounded run, under one
folder.

On a machine with a GPU, from the repository's root (at most about 9 minutes with 16 cores)::

    python benchmarks/gpu_check_all.py --out gpu-check

and its quick form on a CPU (a few minutes; what the tests run)::

    python benchmarks/gpu_check_all.py --out /tmp/gpu-check --quick --device cpu

Steps, in order, each in a session of its own with its own time limit (:data:`STEP_CAPS_S`, never more
than what is left of ``--budget-s``; a step with less than :data:`MIN_STEP_S` left is not started),
each writing its files into ``--out`` as it ends:

1. ``environment.json``: device name, compute capability and memory, torch, CUDA and cuDNN versions,
   the driver (``nvidia-smi``), CPU count, Python, the commit.
2. ``tests``: pytest of the CUDA-relevant tests (:data:`TEST_FILES`: PPO, learner, compiled update,
   model, buffer and GAE tests and the CartPole end-to-end test; the quick form: a few fast ones),
   each limited to ``--test-timeout-s``: ``tests.jsonl`` (one line per test as pytest reports it,
   :mod:`benchmarks.pytest_outcomes`: kept whatever happens after), ``junit.xml`` (written when
   pytest ends, also when the step's time is up: it gets SIGINT first) and ``tests.log``.
3. ``overhead_eager``, ``overhead_compiled``: ``benchmarks/gpu_check.py`` (the production update
   against a bare loop of the same SGD steps, then synthetic actors feeding the training learner)
   without and with ``--compile-update reduce-overhead`` (``default`` on a CPU):
   ``overhead_*.json`` and ``.log``. The quick form measures the CartPole preset's MLP (a compile of
   seconds to a minute on a CPU instead of minutes for the Nature CNN).
4. ``breakout``: a short real run, ``oakemu train --preset atari --device DEVICE --eval-every-updates
   0 --total-env-steps N`` (:data:`BREAKOUT_STEPS`: about 90 s on a GPU machine), in
   ``runs/breakout/``; ``breakout.log``.
5. ``central_inference``: ``benchmarks/bench_central_inference.py`` when that file exists (given
   ``--device``, ``--json`` and the quick form's :data:`CENTRAL_QUICK_ARGS` where its ``--help``
   offers them), else skipped with a note.

``summary.json`` and ``summary.md`` hold every figure, the device, the versions and each step's status
(``ok``, ``failed``, ``timeout``, ``no time``, ``skipped``), seconds, command and log; they are
rewritten after every step, so a run cut short keeps what it finished. A step whose time is up is
stopped by :func:`benchmarks.bounded_steps.run_command` (SIGINT, SIGTERM, SIGKILL; whatever it started
stopped, its ``/dev/shm`` segments removed). Exit status: 0 when every step ended ``ok`` or was
skipped (not asked for, no script), 1 otherwise, 2 for a bad option (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bounded_steps import run_command  # noqa: E402
from benchmarks.pytest_outcomes import OUTCOMES_ENV  # noqa: E402

TEST_FILES = (
    "tests/algo/test_ppo.py",
    "tests/algo/test_learner.py",
    "tests/algo/test_off_policy.py",
    "tests/algo/test_recurrent_ppo.py",
    "tests/algo/test_losses.py",
    "tests/algo/test_flat_parameters.py",
    "tests/algo/test_compiled_update.py",
    "tests/policy/test_models.py",
    "tests/storage/test_rollout_buffer.py",
    "tests/storage/test_gae.py",
    "tests/e2e/test_e2e_cartpole.py",
)
"""The tests the GPU form runs (with CUDA visible, ``device = "auto"`` is the GPU)."""
GPU_DESELECTED = (
    "tests/algo/test_compiled_update.py::"
    "test_a_compiled_update_trains_the_weights_the_eager_update_trains[cpu-default]",
    "tests/e2e/test_e2e_cartpole.py::"
    "test_cartpole_learns_with_a_fast_learner_device_and_cpu_actors[cpu-late-epochs]",
)
"""CPU stand-ins the GPU form leaves out (the CPU test runs check them; on a GPU their device
variants run)."""
QUICK_TEST_FILES = ("tests/algo/test_compiled_update.py", "tests/algo/test_losses.py")
"""The quick form's tests (with ``-m "not slow"``)."""

BREAKOUT_STEPS = {"full": 100_000, "quick": 1_024}
"""``--total-env-steps`` of the Breakout run: about 70 s at the atari preset's 1,440-1,500 env
steps/s on 16 cores and a GPU (docs/benchmarks.md) after a start of 10-20 s; one update of 1,024
rows on a CPU."""

STEP_CAPS_S = {
    "full": {
        "tests": 200,
        "overhead_eager": 80,
        "overhead_compiled": 160,
        "breakout": 110,
        "central_inference": 120,
    },
    "quick": {
        "tests": 90,
        "overhead_eager": 90,
        "overhead_compiled": 240,
        "breakout": 120,
        "central_inference": 180,
    },
}
"""Each step's own time limit in seconds. The full form's add up to more than its 540 s budget: the
last step, another process's benchmark, gets what is left."""
MIN_STEP_S = 15.0
"""A step with less than this left of the budget is not started (status ``no time``)."""
CENTRAL_INFERENCE = REPO / "benchmarks" / "bench_central_inference.py"
CENTRAL_QUICK_ARGS = {"--envs": ["cartpole"], "--cartpole-steps": ["4096"]}
"""The quick form's arguments of the central-inference benchmark, each given where its ``--help``
offers it (a short CartPole run of each kind)."""


@dataclass
class StepResult:
    """How one step ended: ``status`` (``ok``, ``failed``, ``timeout``, ``no time``: not started for
    want of budget, ``skipped``: not asked for or no script), its seconds, exit status, command, log
    file (relative to the output folder), figures and a note."""

    status: str
    seconds: float = 0.0
    returncode: int | None = None
    command: str = ""
    log: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""


# ------------------------------------------------------------------------------- the figures
def environment(device: str) -> dict[str, Any]:
    """The machine and its versions (torch imported here; the CUDA figures when it sees a GPU)."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "device": device,
        "device_name": "cpu",
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(device)
        info.update(
            device_name=properties.name,
            compute_capability=f"{properties.major}.{properties.minor}",
            device_memory_gib=round(properties.total_memory / 2**30, 1),
        )
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        info["commit"] = commit.stdout.strip() or None
    return info


def test_figures(out: Path) -> dict[str, Any]:
    """Counts by outcome and the failed tests (node id, first error line) from ``tests.jsonl``, the
    slowest five; and ``junit.xml``'s totals when pytest wrote it."""
    path = out / "tests.jsonl"
    records = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.is_file()
        else []
    )
    counts: dict[str, int] = {}
    for record in records:
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    figures: dict[str, Any] = {
        "outcomes": counts,
        "failed": [
            {"test": r["nodeid"], "when": r["when"], "message": r.get("message", "")}
            for r in records
            if r["outcome"] == "failed"
        ],
        "slowest": sorted(
            ({"test": r["nodeid"], "seconds": r["seconds"]} for r in records),
            key=lambda item: -item["seconds"],
        )[:5],
    }
    junit = out / "junit.xml"
    if junit.is_file():
        with contextlib.suppress(ElementTree.ParseError):
            suite = ElementTree.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            if suite is not None:
                figures["junit"] = {
                    key: int(suite.get(key, 0))
                    for key in ("tests", "failures", "errors", "skipped")
                }
    return figures


def breakout_figures(run_dir: Path) -> dict[str, Any]:
    """From the Breakout run's ``metrics.jsonl``: updates, env steps, the last SPS figures, the
    median update seconds after the first, the last mean return; the device the learner logged."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    updates = [r for r in records if "charts/update" in r]
    if not updates:
        return {"updates": 0}
    last = updates[-1]
    seconds = [r["diagnostics/update_seconds"] for r in updates[1:] or updates]
    figures = {
        "updates": len(updates),
        "global_step": last.get("global_step"),
        "sps": last.get("charts/SPS"),
        "sps_recent": last.get("charts/SPS_recent"),
        "update_s_median": statistics.median(seconds),
        "first_update_s": updates[0].get("diagnostics/update_seconds"),
        "episodic_return": last.get("charts/episodic_return"),
    }
    log = run_dir / "logs" / "learner.log"
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            if ", device " in line:
                figures["learner_device"] = line.split(", device ", 1)[1].split(",", 1)[0]
                break
    return figures


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------- the run
class Check:
    """One run of the steps into ``out``: the budget, the child environment, the summary files."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.form = "quick" if args.quick else "full"
        self.deadline = time.monotonic() + args.budget_s
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.environment: dict[str, Any] = {}
        self.steps: dict[str, StepResult] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
        self.env["PYTHONUNBUFFERED"] = "1"

    # -- summary ---------------------------------------------------------------------------
    def write_summary(self, *, finished: bool = False) -> None:
        """``summary.json`` and ``summary.md`` as they stand (written to a temporary file, then
        renamed: a reader never sees half a file)."""
        summary = {
            "started": self.started,
            "finished": finished,
            "form": self.form,
            "device": self.args.device,
            "budget_s": self.args.budget_s,
            "environment": self.environment,
            "steps": {name: vars(result) for name, result in self.steps.items()},
        }
        for name, text in (
            ("summary.json", json.dumps(summary, indent=1) + "\n"),
            ("summary.md", self.markdown(summary)),
        ):
            temporary = self.out / f".{name}.tmp"
            temporary.write_text(text, encoding="utf-8")
            temporary.replace(self.out / name)

    @staticmethod
    def markdown(summary: dict[str, Any]) -> str:
        env = summary["environment"]
        lines = [
            f"# Device check ({summary['form']} form), started {summary['started']}",
            "",
            f"- device: {env.get('device', summary['device'])} ({env.get('device_name', '?')}), "
            f"torch {env.get('torch', '?')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
            f"{env.get('cpus_usable', '?')} usable CPUs, Python {env.get('python', '?')}, "
            f"commit {env.get('commit')}",
            f"- finished: {summary['finished']} (budget {summary['budget_s']:.0f} s)",
            "",
            "| step | status | seconds | figures | note |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, step in summary["steps"].items():
            # Lists stay in summary.json (every update, the slowest tests); the failed tests show.
            shown = {
                k: v for k, v in step["figures"].items() if k == "failed" or not isinstance(v, list)
            }
            if isinstance(shown.get("update"), dict):  # gpu_check: its medians, not every update
                shown["update"] = {
                    k: v for k, v in shown["update"].items() if not isinstance(v, list)
                }
            figures = json.dumps(shown, default=str).replace("|", "/")
            lines.append(
                f"| {name} | {step['status']} | {step['seconds']:.1f} | {figures} | {step['note']} |"
            )
        return "\n".join(lines) + "\n"

    # -- steps -----------------------------------------------------------------------------
    def skip(self, name: str, note: str) -> None:
        """Record ``name`` as skipped (not asked for, no script), without running anything."""
        self.record(name, StepResult("skipped", note=note))

    def record(self, name: str, result: StepResult) -> None:
        self.steps[name] = result
        print(f"gpu_check_all: {name} {result.status} {result.note}".rstrip(), flush=True)
        self.write_summary()

    def run(self, name: str, command: list[str], figures: Any = None, **env: str) -> None:
        """Run one step's ``command`` within its cap and the budget left (not at all with less than
        :data:`MIN_STEP_S` left: ``no time``), then ``figures()`` (a callable returning the step's
        figures, read also after a failure or a timeout: whatever was written), then the summary."""
        left = self.deadline - time.monotonic()
        if left < MIN_STEP_S:
            note = f"not started: {left:.0f} s of the budget left"
            self.record(name, StepResult("no time", command=" ".join(command), note=note))
            return
        timeout_s = min(STEP_CAPS_S[self.form][name], left)
        log = f"{name}.log"
        print(f"gpu_check_all: {name} (at most {timeout_s:.0f} s) ...", flush=True)
        status, returncode, seconds = run_command(
            command, self.out / log, timeout_s, cwd=REPO, env={**self.env, **env}
        )
        result = StepResult(status, seconds, returncode, " ".join(command), log)
        if status == "timeout":
            result.note = f"stopped after {timeout_s:.0f} s"
        elif status == "failed":
            result.note = _last_line(self.out / log)
        if figures is not None:
            try:
                result.figures = figures()
            except (OSError, ValueError, KeyError, TypeError) as error:
                result.note = (result.note + f"; figures unreadable: {error}").lstrip("; ")
        self.record(name, result)

    def tests(self) -> None:
        out, quick = self.out, self.form == "quick"
        command = [
            sys.executable,
            "-m",
            "pytest",
            *(QUICK_TEST_FILES if quick else TEST_FILES),
            "-p",
            "benchmarks.pytest_outcomes",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out / 'junit.xml'}",
            "-q",
            "-rfE",
        ]
        if quick:
            command += ["-m", "not slow"]
        else:
            command += [f"--deselect={test}" for test in GPU_DESELECTED]
        if importlib.util.find_spec("pytest_timeout") is not None:
            command.append(f"--timeout={self.args.test_timeout_s}")
        for stale in ("tests.jsonl", "junit.xml"):
            (out / stale).unlink(missing_ok=True)
        self.run(
            "tests", command, lambda: test_figures(out), **{OUTCOMES_ENV: str(out / "tests.jsonl")}
        )

    def overhead(self, name: str, compile_mode: str) -> None:
        json_path = self.out / f"{name}.json"
        json_path.unlink(missing_ok=True)
        command = [sys.executable, "benchmarks/gpu_check.py", "--device", self.args.device]
        if self.form == "quick":
            command += ["--quick", "--preset", "cartpole"]
        else:
            command += ["--seconds", "20"]
        if compile_mode != "none":  # the first update compiles, the second (decoupled) too
            command += ["--compile-update", compile_mode, "--updates", "4"]
        self.run(name, [*command, "--json", str(json_path)], lambda: _read_json(json_path))

    def breakout(self) -> None:
        runs = self.out / "runs"
        shutil.rmtree(runs / "breakout", ignore_errors=True)
        steps = self.args.breakout_steps or BREAKOUT_STEPS[self.form]
        command = [sys.executable, "-m", "oakemu_services.cli", "train", "--preset", "atari"]
        command += ["--device", self.args.device, "--total-env-steps", str(steps)]
        command += ["--eval-every-updates", "0", "--runs-dir", str(runs), "--run-name", "breakout"]
        self.run("breakout", command, lambda: breakout_figures(runs / "breakout"))

    def central_inference(self) -> None:
        if not CENTRAL_INFERENCE.is_file():
            self.skip("central_inference", f"{CENTRAL_INFERENCE.relative_to(REPO)} not found")
            return
        offered = _help_text(CENTRAL_INFERENCE)
        json_path = self.out / "central_inference.json"
        json_path.unlink(missing_ok=True)
        command = [sys.executable, str(CENTRAL_INFERENCE.relative_to(REPO))]
        wanted = {"--device": [self.args.device], "--json": [str(json_path)]}
        if self.form == "quick":
            wanted.update(CENTRAL_QUICK_ARGS)
        for flag, values in wanted.items():
            if flag in offered:
                command += [flag, *values]
        self.run("central_inference", command, lambda: _read_json(json_path))

    def all(self) -> int:
        """Every step asked for, in order; the exit status (see the module docstring)."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.environment = environment(self.args.device)
        (self.out / "environment.json").write_text(json.dumps(self.environment, indent=1) + "\n")
        self.write_summary()
        compiled = "default" if self.args.device == "cpu" else "reduce-overhead"
        steps = {
            "tests": self.tests,
            "overhead_eager": lambda: self.overhead("overhead_eager", "none"),
            "overhead_compiled": lambda: self.overhead("overhead_compiled", compiled),
            "breakout": self.breakout,
            "central_inference": self.central_inference,
        }
        try:
            for name, step in steps.items():
                if name in self.args.steps:
                    step()
                else:
                    self.skip(name, "not asked for")
        except KeyboardInterrupt:  # the step's processes are stopped; what finished is kept
            print("gpu_check_all: interrupted", file=sys.stderr)
            return 130
        self.write_summary(finished=True)
        print(f"gpu_check_all: summary in {self.out / 'summary.md'}", flush=True)
        return 0 if all(r.status in ("ok", "skipped") for r in self.steps.values()) else 1


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""
    return ""


def _help_text(script: Path) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            [sys.executable, str(script), "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    return ""


STEPS = ("tests", "overhead_eager", "overhead_compiled", "breakout", "central_inference")


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes in one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gpu_check_all: {message} (--help lists the options)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder everything goes into")
    parser.add_argument(
        "--device",
        default=None,
        help="the learner's device (default: cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the CPU form: tiny sizes, a few tests (minutes)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole run's time limit in seconds (default: 540; quick: 420)",
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"the steps to run, comma-separated (default: all of {','.join(STEPS)})",
    )
    parser.add_argument(
        "--test-timeout-s", type=int, default=180, help="each test's time limit (pytest-timeout)"
    )
    parser.add_argument(
        "--breakout-steps",
        type=int,
        default=None,
        help=f"env steps of the Breakout run (default: {BREAKOUT_STEPS['full']:,}; quick: "
        f"{BREAKOUT_STEPS['quick']:,})",
    )
    args = parser.parse_args(argv)
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {', '.join(unknown)} (expected some of {', '.join(STEPS)})")
    if args.budget_s is None:
        args.budget_s = 420.0 if args.quick else 540.0
    if args.budget_s <= 0 or args.test_timeout_s < 1 or (args.breakout_steps or 1) < 1:
        parser.error("expected --budget-s > 0, --test-timeout-s >= 1 and --breakout-steps >= 1")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    return Check(parse_args(argv)).all()


if __name__ == "__main__":
    sys.exit(main())
