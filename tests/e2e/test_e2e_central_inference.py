"""End to end: ``oakemu train --actor-inference central`` (one inference server process runs both
actors' forward passes) learns CartPole-v1 as local inference does in ``test_e2e_cartpole.py``,
survives the server's death, and stops in one line when the server keeps failing.

Success criterion, as ``test_e2e_cartpole.py``'s: the mean episodic return of 20 consecutive finished
episodes reaches 195 within a fixed env-step budget, with a fixed seed, here in the synchronous mode
(actors act with the weights trained on their rollout: each request names them). The learner's
first-minibatch ratio check holds the actors' log-probs, computed from the server's outputs, to the
learner's on every update. ``e2e.train`` also checks that every process (the server included) exited
and left no shared-memory segment.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.e2e_helpers import (
    CARTPOLE_PPO_FLAGS,
    E2EProcesses,
    describe_all,
    only_run_dir,
    python_path_with_site_hook,
    read_jsonl,
    update_records,
)

STEP_BUDGET = 24_576
"""Env steps: 24 rollouts of 128 steps x 8 columns."""
SOLVED_RETURN = 195.0
LAST_EPISODES = 20
RATIO_TOLERANCE = 1e-5

SETTINGS = [
    *("--env", "CartPole-v1", "--mode", "sync", "--seed", "1"),
    *CARTPOLE_PPO_FLAGS,
    *("--eval-every-updates", "0"),
]


def best_window_mean(episodes: list[dict]) -> tuple[int | None, float]:
    """``(global_step at which the mean of 20 consecutive episodes first reached 195, or None; the
    best such mean)``."""
    returns = [float(e["episodic_return"]) for e in episodes]
    best = float("-inf")
    for end in range(LAST_EPISODES, len(returns) + 1):
        mean = sum(returns[end - LAST_EPISODES : end]) / LAST_EPISODES
        best = max(best, mean)
        if mean >= SOLVED_RETURN:
            return int(episodes[end - 1]["global_step"]), mean
    return None, best


def served_requests(log: str) -> dict[str, int]:
    """The server's requests per client from its last statistics line (``actor-0 12, actor-1 9``)."""
    lines = re.findall(r"requests per client: (.*)$", log, re.MULTILINE)
    assert lines, log[-2000:]
    return {name: int(count) for name, count in re.findall(r"(\S+) (\d+)", lines[-1])}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cartpole_learns_with_central_inference(e2e: E2EProcesses) -> None:
    """The synchronous run at ``test_e2e_cartpole.py``'s settings, the forward passes in the inference
    server: it solves within the budget, with both actors' episodes, and the actors' log-probs match
    the learner's on every update; the server logged the batches it served to both actors, and the
    folder of its socket is gone after the run."""
    args = [*SETTINGS, "--total-env-steps", str(STEP_BUDGET), "--actor-inference", "central"]
    run = e2e.train(args, timeout_s=540)
    run_dir = run.run_dir
    episodes = read_jsonl(run_dir / "episodes.jsonl")
    assert {e["actor_id"] for e in episodes} == {"actor-0", "actor-1"}
    solved_at, best_mean = best_window_mean(episodes)
    assert solved_at is not None and solved_at <= STEP_BUDGET, (
        f"the mean return of {LAST_EPISODES} consecutive episodes never reached {SOLVED_RETURN} "
        f"(best {best_mean:.1f}) in {STEP_BUDGET} env steps"
    )
    updates = update_records(run_dir)
    assert len(updates) == STEP_BUDGET // (128 * 8), f"{len(updates)} PPO updates"
    deviations = [u["diagnostics/first_minibatch_ratio_max_abs_dev"] for u in updates]
    assert all(d is not None for d in deviations) and max(deviations) < RATIO_TOLERANCE, deviations
    logs = run_dir / "logs"
    actor_logs = "".join(p.read_text(errors="replace") for p in logs.glob("actor*.log"))
    assert actor_logs.count("forward passes by the inference server") == 2
    server_log = (logs / "inference.log").read_text(errors="replace")
    assert "inference in all:" in server_log and "ERROR" not in server_log, server_log[-2000:]
    requests = served_requests(server_log)
    # Every vector step of each actor is at least one request (4 envs, 1,536 steps each at least).
    assert set(requests) == {"actor-0", "actor-1"} and min(requests.values()) >= STEP_BUDGET // 8
    # Both actors' requests met in one forward pass (1.2 requests per pass on average here).
    batches = re.search(r"in all: (\d+) batches .*?\(at most (\d+)\)", server_log)
    assert batches is not None and int(batches.group(2)) == 2, server_log[-2000:]
    address = re.search(r"the inference server at ipc://(\S+)/inference", actor_logs)
    assert address is not None and not Path(address.group(1)).exists(), "its folder was left"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_inference_server_is_restarted_and_the_run_finishes(e2e: E2EProcesses) -> None:
    """SIGKILL of the inference server mid-run: ``oakemu train`` restarts it, the actors' requests
    reach the new server (which gets the weights from them), and the run trains its budget."""
    budget = 5 * 128 * 8
    telemetry = e2e.telemetry()
    train = e2e.start(
        "train",
        [
            "train",
            *SETTINGS,
            "--total-env-steps",
            str(budget),
            "--actor-inference",
            "central",
            *e2e.flags(),
        ],
    )
    telemetry.wait(lambda s: s.iterations >= 1, 300, "1 update", describe_all(train))
    servers = [pid for pid, command in e2e.alive() if "oakemu_services.inference" in command]
    assert len(servers) == 1, e2e.alive()
    os.kill(servers[0], signal.SIGKILL)
    run = e2e.finish(train, timeout_s=280)
    assert "inference was killed by SIGKILL; restarting (1/" in train.stderr(), train.stderr()
    updates = update_records(run.run_dir)
    assert len(updates) == budget // (128 * 8)
    deviations = [u["diagnostics/first_minibatch_ratio_max_abs_dev"] for u in updates]
    assert max(d for d in deviations if d is not None) < RATIO_TOLERANCE
    server_log = (run.run_dir / "logs" / "inference.log").read_text(errors="replace")
    assert server_log.count("inference server on cpu") == 2, server_log[-2000:]


BROKEN_SERVER = """
import os
if os.environ.get("OAKEMU_INFERENCE_ADDRESS") and not os.environ.get("OAKEMU_ACTOR_ID"):
    print("RuntimeError: the inference server broke", flush=True)
    os._exit(1)
"""
"""A site hook that ends the inference server at its start (the actors have an actor id)."""


@pytest.mark.slow
def test_a_server_that_keeps_failing_stops_the_run_with_one_line(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    """An inference server that exits with an error at every start is restarted ``actor_restarts``
    times, then the run stops: exit 1, the reason and the server's error in one line, every process
    stopped (the actors were waiting for the server), nothing left in /dev/shm."""
    path = python_path_with_site_hook(tmp_path, BROKEN_SERVER)
    args = [*SETTINGS, "--total-env-steps", "4096", "--actor-inference", "central"]
    train = e2e.start(
        "train", ["train", *args, "--actor-restarts", "1", *e2e.flags()], env={"PYTHONPATH": path}
    )
    assert train.wait(240) == 1, train.describe()
    stderr = train.stderr()
    assert "inference exited with status 1; restarting (1/1)" in stderr, stderr
    assert (
        "inference exited with status 1 (same error: RuntimeError: the inference server broke)"
        in stderr
    )
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: the inference server stopped for good, the run cannot go on; its error: "
        f"RuntimeError: the inference server broke (logs: {only_run_dir(e2e.runs_dir) / 'logs'})"
    ], stderr
    e2e.assert_clean(30.0)
