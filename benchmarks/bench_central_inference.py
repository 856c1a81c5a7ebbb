"""Central inference against local inference: the same short ``oakemu train`` run with the actors'
forward passes in each actor (``--actor-inference auto``: numpy for CartPole's MLP, torch for
Breakout's Nature CNN) and in one inference server process (``--actor-inference central``), in the
same invocation, interleaved, with the machine's load before each run.

Printed per run: env steps/s from the first PPO update to the last (``global_step`` and ``wall_time``
of ``metrics.jsonl``: start-up left out; a run of one update: its ``charts/SPS``), the run's wall time, and for central inference the
server's batches (requests and rows per forward pass, from its log); then per env the ratio central /
local of the median env steps/s. ``--json PATH`` writes every run.

On a CPU-only machine every forward pass still runs on a CPU core, now in another process, plus a
round trip through a socket per vector step: expect central to cost there (its use is a GPU beside
many actors). The device check (a GPU machine; what ``benchmarks/gpu_check.py`` runs) is::

    python benchmarks/bench_central_inference.py --envs breakout --device cuda --actors 15 \\
        --envs-per-actor 8 --breakout-steps 200000 --mode async

Usage: ``python benchmarks/bench_central_inference.py [--envs cartpole breakout] [--actors 2]
[--envs-per-actor 8] [--cartpole-steps 32768] [--breakout-steps 8192] [--mode async]
[--device cpu] [--repeats 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENVS = {"cartpole": "CartPole-v1", "breakout": "ALE/Breakout-v5"}
INFERENCE = {"local": "auto", "central": "central"}
RUN_TIMEOUT_S = 1800.0


def load_average() -> float:
    """The machine's 1-minute load average (``uptime``'s first figure)."""
    return os.getloadavg()[0]


def train_args(env: str, inference: str, args: argparse.Namespace, runs_dir: Path) -> list[str]:
    """``oakemu train`` options of one run: ``args``' sizes, no evaluation, no checkpoint but the last."""
    steps = args.cartpole_steps if env == "cartpole" else args.breakout_steps
    actors, per_actor = args.actors, args.envs_per_actor
    return [
        "--env",
        ENVS[env],
        "--mode",
        args.mode,
        "--seed",
        "1",
        "--num-actors",
        str(actors),
        "--envs-per-actor",
        str(per_actor),
        "--num-envs",
        str(actors * per_actor),
        "--total-env-steps",
        str(steps),
        "--device",
        args.device,
        "--inference-device",
        args.device,
        "--actor-inference",
        INFERENCE[inference],
        "--eval-every-updates",
        "0",
        "--checkpoint-every-updates",
        "0",
        "--runs-dir",
        str(runs_dir),
        "--run-name",
        f"{env}-{inference}",
    ]


def server_batches(log: str) -> dict[str, float] | None:
    """Requests and rows per forward pass of the inference server's whole run (its last log line)."""
    found = re.search(
        r"in all: (\d+) batches in \d+ s: ([\d.]+) requests per batch \(at most (\d+)\), "
        r"([\d.]+) rows per batch",
        log,
    )
    if found is None:
        return None
    batches, requests, most, rows = found.groups()
    return {
        "batches": int(batches),
        "requests_per_batch": float(requests),
        "most_requests": int(most),
        "rows_per_batch": float(rows),
    }


def run_once(env: str, inference: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``oakemu train`` run in a temporary folder; its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="oakemu-bench-central-") as scratch:
        runs_dir = Path(scratch)
        command = [
            sys.executable,
            "-m",
            "oakemu_services.cli",
            "train",
            *train_args(env, inference, args, runs_dir),
        ]
        environment = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
        load = load_average()
        started = time.perf_counter()
        process = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=environment,
            check=False,
        )
        wall_s = time.perf_counter() - started
        run_dir = runs_dir / f"{env}-{inference}"
        if process.returncode != 0:
            raise RuntimeError(
                f"{env} {inference}: oakemu train exited {process.returncode}: {process.stderr[-2000:]}"
            )
        records = [
            json.loads(line)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"charts/update"' in line
        ]
        first, last = records[0], records[-1]
        sps = (
            (last["global_step"] - first["global_step"]) / (last["wall_time"] - first["wall_time"])
            if len(records) > 1
            else last["charts/SPS"]  # one update: the learner's SPS since its start
        )
        server_log = run_dir / "logs" / "inference.log"
        return {
            "env": env,
            "inference": inference,
            "env_steps_per_s": sps,
            "updates": len(records),
            "env_steps": last["global_step"],
            "wall_s": wall_s,
            "load_before": load,
            "server": server_batches(server_log.read_text()) if server_log.exists() else None,
        }


def describe(result: dict[str, Any]) -> str:
    server = result["server"]
    batches = (
        f"; server: {server['requests_per_batch']:.2f} requests / {server['rows_per_batch']:.1f} rows "
        f"per forward pass (at most {server['most_requests']} requests)"
        if server
        else ""
    )
    return (
        f"{result['env']:9s} {result['inference']:8s} {result['env_steps_per_s']:8.0f} env steps/s "
        f"({result['updates']} updates, {result['env_steps']:,} env steps, wall {result['wall_s']:.0f} s, "
        f"load {result['load_before']:.1f} before){batches}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVS), default=["cartpole", "breakout"])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs-per-actor", type=int, default=8)
    parser.add_argument("--cartpole-steps", type=int, default=32_768)
    parser.add_argument("--breakout-steps", type=int, default=8_192)
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument(
        "--device", default="cpu", help="the learner's and the inference server's device"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(
        f"{args.actors} actors x {args.envs_per_actor} envs, {args.mode}, device {args.device}; "
        f"{os.cpu_count()} CPUs, load {load_average():.1f}",
        flush=True,
    )
    results = []
    for env in args.envs:
        for _ in range(args.repeats):
            for inference in INFERENCE:
                results.append(run_once(env, inference, args))
                print(describe(results[-1]), flush=True)
    for env in args.envs:
        medians = {
            inference: statistics.median(
                r["env_steps_per_s"]
                for r in results
                if r["env"] == env and r["inference"] == inference
            )
            for inference in INFERENCE
        }
        print(
            f"{env}: central / local env steps/s = {medians['central'] / medians['local']:.2f} "
            f"({medians['central']:.0f} / {medians['local']:.0f})",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
