"""Elastic synchronous training under actor churn: CartPole-v1 at the rl-zoo settings, with and
without an actor killed (``kill -9``) every ``--kill-every-s`` seconds and restarted
``--restart-after-s`` later.

Each run is one ``oakemu learner`` and ``--actors`` ``oakemu actor`` processes (the envs of the
rl-zoo case split among them), all in the default mode (sync). Printed per run: wall time to the
budget, env steps until the last-20-episode mean return first reached 475, kills, the longest wait
from a kill to the next update, and the updates that trained with fewer columns than planned.

    python benchmarks/bench_churn.py --steps 200000 --seeds 1

A run takes about ``steps / SPS`` seconds (a few minutes for 200k on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import REPO, _free_ports, _read_jsonl  # noqa: E402
from bench_vs_sb3 import BENCHES, oakemu_bench_args, steps_to_threshold  # noqa: E402

THRESHOLD = 475.0
WINDOW = 20


def start(role_args: list[str], log: Path) -> subprocess.Popen:
    """``python -m oakemu_services.cli`` with ``role_args``, output to ``log``, in its own session, one
    torch thread (``OMP_NUM_THREADS=1``, as ``bench_vs_sb3.py`` gives every process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "oakemu_services.cli", *role_args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


def learner_args(train_args: list[str]) -> list[str]:
    """The ``oakemu learner`` options among ``oakemu train`` flags (``--flag value`` pairs and
    ``--flag`` / ``--no-flag`` switches): each subcommand takes only the options it uses."""
    from oakemu_services.cli import build_parser

    options = build_parser()[1]["learner"]._option_string_actions
    kept: list[str] = []
    for i, arg in enumerate(train_args):
        if arg.startswith("--"):
            if arg in options:
                kept.append(arg)
        elif i and train_args[i - 1].startswith("--") and train_args[i - 1] in options:
            kept.append(arg)
    return kept


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def run(
    *,
    seed: int,
    steps: int,
    actors: int,
    churn: bool,
    kill_every_s: float,
    restart_after_s: float,
    runs_dir: Path,
) -> dict:
    """One learner + ``actors`` actors until the budget; with ``churn``, actor i % actors is killed every
    ``kill_every_s`` and restarted ``restart_after_s`` later. Returns the run's figures."""
    bench = BENCHES["cartpole"]
    name = f"{'churn' if churn else 'steady'}-{seed}"
    ports = _free_ports(5)
    args = oakemu_bench_args(
        bench,
        mode="sync",
        seed=seed,
        steps=steps,
        runs_dir=runs_dir,
        run_name=name,
        ports=ports,
        torch_threads=1,
        num_actors=actors,
    )
    envs_per_actor = args[args.index("--envs-per-actor") + 1]
    actor_ports = ("--data-port", "--control-port", "--weights-port")  # the ports an actor uses
    port_flags = [
        a for i, a in enumerate(args) if a in actor_ports or (i and args[i - 1] in actor_ports)
    ]
    logs = runs_dir / f"{name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    learner = start(
        ["learner", *learner_args(args), "--actor-timeout-s", "5"], logs / "learner.log"
    )

    def actor(i: int) -> subprocess.Popen:
        return start(
            [
                "actor",
                "--envs-per-actor",
                envs_per_actor,
                "--actor-id",
                f"a{i}",
                "--torch-threads",
                "1",
                *port_flags,
            ],
            logs / f"a{i}.log",
        )

    processes = {i: actor(i) for i in range(actors)}
    started = time.monotonic()
    kills, next_kill, restarts, kill_times = 0, started + kill_every_s, [], []
    try:
        while learner.poll() is None:
            now = time.monotonic()
            if churn and now >= next_kill:
                victim = kills % actors
                processes[victim].kill()
                kill_times.append(time.time())
                processes[victim].wait(10)
                restarts.append((now + restart_after_s, victim))
                kills += 1
                next_kill = now + kill_every_s
            for due, victim in [r for r in restarts if r[0] <= now]:
                processes[victim] = actor(victim)
                restarts.remove((due, victim))
            time.sleep(0.2)
        wall_s = time.monotonic() - started
    finally:
        for process in processes.values():
            stop(process)
        stop(learner)
    if learner.returncode != 0:
        tail = (logs / "learner.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(
            f"{name}: the learner exited with status {learner.returncode}: " + " | ".join(tail)
        )
    run_dir = runs_dir / name
    episodes = [
        (e["global_step"], e["episodic_return"]) for e in _read_jsonl(run_dir / "episodes.jsonl")
    ]
    updates = [r for r in _read_jsonl(run_dir / "metrics.jsonl") if "charts/update" in r]
    fewer = sum(1 for r in updates if r.get("charts/rollout_columns", 0) < bench.case.num_envs)
    last = updates[-1] if updates else {}
    update_times = [r["wall_time"] for r in updates]
    waits = [min((t for t in update_times if t > k), default=k) - k for k in kill_times]
    return {
        "run": name,
        "wall_s": wall_s,
        "env_steps": int(last.get("global_step", 0)),
        "kills": kills,
        "to_475": steps_to_threshold(episodes, THRESHOLD, WINDOW),
        "updates": len(updates),
        "fewer_columns": fewer,
        "kill_to_update_s": max(waits, default=0.0),
        "exit": learner.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000, help="env steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--actors", type=int, default=2, help="actor processes (they share the case's 8 envs)"
    )
    parser.add_argument("--kill-every-s", type=float, default=20.0)
    parser.add_argument("--restart-after-s", type=float, default=10.0)
    parser.add_argument("--runs-dir", type=Path, help="keep run folders here (default: a temp dir)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for seed in args.seeds:
            for churn in (False, True):
                rows.append(
                    run(
                        seed=seed,
                        steps=args.steps,
                        actors=args.actors,
                        churn=churn,
                        kill_every_s=args.kill_every_s,
                        restart_after_s=args.restart_after_s,
                        runs_dir=runs_dir,
                    )
                )
                print(rows[-1], flush=True)
    print(
        "\n| run | env steps | wall s | steps to 475 | kills | kill to next update, max s | updates | "
        "with fewer columns |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['run']} | {r['env_steps']:,} | {r['wall_s']:.0f} | {r['to_475'] or 'not reached'} | "
            f"{r['kills']} | {r['kill_to_update_s']:.1f} | {r['updates']} | {r['fewer_columns']} |"
        )
    return 0 if all(r["exit"] == 0 and r["updates"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
