"""The learner's tester (oakemu_core/run/tester.py): its own process, the ``oakemu evaluate`` code path,
newest-weights-only queueing, clean shutdown, and best.pt.

Every test closes its testers in a fixture, also when it fails, and checks that no child is left.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from oakemu_services.evaluate import evaluate

from oakemu_core.envs import env_spec
from oakemu_core.policy.models import load_weight_arrays, weights_to_arrays
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import load_checkpoint
from oakemu_core.run.evaluation import build_evaluation, play_episodes
from oakemu_core.run.tester import (
    BEST_NAME,
    BestCheckpointTracker,
    EvaluationReport,
    Tester,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CARTPOLE = "CartPole-v1"
SLOW_CARTPOLE = "tests.slow_envs:SlowCartPole-v0"
READY_TIMEOUT_S = 120.0  # a spawned interpreter imports torch; minutes on a loaded 2-core machine


def schema_of(env_id: str) -> dict:
    return schema_for_env(env_spec(env_id)).to_dict()


def random_weights(env_id: str, torch_seed: int) -> dict[str, np.ndarray]:
    """Freshly initialised weights of the run's model (different per ``torch_seed``)."""
    torch.manual_seed(torch_seed)
    model, env = build_evaluation(env_id, schema_of(env_id), seed=None)
    env.close()
    return weights_to_arrays(model)


def in_process_returns(
    env_id: str, weights: dict[str, np.ndarray], *, seed: int, episodes: int, greedy: bool = True
) -> list[float]:
    model, env = build_evaluation(env_id, schema_of(env_id), seed=seed)
    try:
        load_weight_arrays(model, weights)
        return play_episodes(model, env, episodes=episodes, greedy=greedy).returns
    finally:
        env.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """True when ``pid`` does not exist (or is a zombie, i.e. no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def testers() -> Iterator[Callable[..., Tester]]:
    """Make started testers; all are closed on teardown and none may leave a process."""
    made: list[Tester] = []

    def make(env_id: str = CARTPOLE, **kwargs) -> Tester:
        options = dict(episodes=3, greedy=True, seed=7) | kwargs
        if "schema_dict" not in options:
            options["schema_dict"] = schema_of(env_id)
        tester = Tester(env_id, **options)
        made.append(tester)
        tester.start()
        return tester

    try:
        yield make
    finally:
        pids = [t.pid for t in made if t.pid is not None]
        for tester in made:
            tester.close()
        assert all(process_gone(pid) for pid in pids), f"tester processes left: {pids}"
        assert multiprocessing.active_children() == []


def test_tester_evaluates_in_its_own_process_like_oakemu_evaluate(testers) -> None:
    tester = testers(episodes=4, seed=11)
    weights = random_weights(CARTPOLE, 1)
    assert tester.submit(3, weights, 1234)
    reports = tester.drain(READY_TIMEOUT_S)
    assert len(reports) == 1, tester.last_error
    report = reports[0]
    assert tester.pid is not None and tester.pid != os.getpid()
    assert (report.policy_version, report.global_step, report.episodes, report.greedy) == (
        3,
        1234,
        4,
        True,
    )
    expected = in_process_returns(CARTPOLE, weights, seed=11, episodes=4)
    assert list(report.returns) == expected  # the same code path and seed: the same episodes
    assert report.return_mean == pytest.approx(np.mean(expected))
    assert report.return_std == pytest.approx(np.std(expected))
    assert report.length_mean == pytest.approx(np.mean(report.lengths))
    assert report.wall_seconds > 0 and report.finished_at <= time.time()
    assert (
        report.weights is weights
    )  # kept parent-side for best.pt, not a copy that went through the pipe

    # Determinism: the same weights again play the same episodes; other weights play others.
    other = random_weights(CARTPOLE, 2)
    assert tester.submit(4, weights, 2000)
    again = tester.drain(READY_TIMEOUT_S)
    assert tester.submit(5, other, 3000)
    different = tester.drain(READY_TIMEOUT_S)
    assert [r.returns for r in again] == [report.returns]
    assert [r.returns for r in different] == [
        tuple(in_process_returns(CARTPOLE, other, seed=11, episodes=4))
    ]
    assert (tester.submitted, tester.completed, tester.superseded, tester.failed) == (3, 3, 0, 0)


def test_a_slow_evaluation_never_blocks_submit_and_only_the_newest_waits(testers) -> None:
    tester = testers(SLOW_CARTPOLE, episodes=6, seed=3)
    wait_until(lambda: tester.ready, READY_TIMEOUT_S, "the tester process to start")
    weights = [random_weights(SLOW_CARTPOLE, seed) for seed in range(3)]
    assert tester.submit(1, weights[0], 100)
    wait_until(lambda: tester.evaluating == 1, 10, "evaluation 1 to start")
    durations = []
    for version in range(2, 42):
        started = time.perf_counter()
        assert tester.submit(version, weights[version % 3], 100 * version)
        durations.append(time.perf_counter() - started)
    # While version 1 still runs (each evaluation takes > 6 episodes x ~10 steps x 10 ms).
    assert tester.evaluating == 1 and tester.pending == 41
    reports = tester.drain(READY_TIMEOUT_S)
    assert [r.policy_version for r in reports] == [1, 41], (
        "only the newest waiting weights are evaluated"
    )
    assert tester.superseded == 39
    assert reports[1].returns == tuple(
        in_process_returns(SLOW_CARTPOLE, weights[41 % 3], seed=3, episodes=6)
    )
    assert reports[0].wall_seconds > 0.3
    # submit() is a lock and a one-byte write, whatever the evaluation does meanwhile.
    assert max(durations) < 0.05, f"slowest submit {max(durations) * 1e3:.1f} ms"
    assert float(np.median(durations)) < 0.002, f"median submit {np.median(durations) * 1e3:.2f} ms"


def test_the_process_is_niced_from_its_start(testers) -> None:
    # Its torch import takes seconds of CPU: it must already yield to training then, not only later.
    tester = testers(CARTPOLE, episodes=1, seed=0, nice=7)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
    assert not tester.ready
    assert os.getpriority(os.PRIO_PROCESS, tester.pid) == expected
    wait_until(lambda: tester.ready, READY_TIMEOUT_S, "the tester process to start")
    assert os.getpriority(os.PRIO_PROCESS, tester.pid) == expected


def test_kept_weights_are_evaluated_even_when_newer_ones_follow(testers) -> None:
    # A run's first weights (e.g. behaviour-cloned) are submitted while the process still starts;
    # a fast run submits newer ones before it is ready. The kept set must not be replaced.
    tester = testers(SLOW_CARTPOLE, episodes=2, seed=5)
    weights = [random_weights(SLOW_CARTPOLE, seed) for seed in range(3)]
    assert tester.submit(1, weights[0], 100, keep=True)
    for version in range(2, 6):
        assert tester.submit(version, weights[version % 3], 100 * version)
    assert tester.pending == 5
    reports = tester.drain(READY_TIMEOUT_S)
    assert [r.policy_version for r in reports] == [1, 5]
    assert tester.superseded == 3
    # A kept set behind a plain one: the plain one is still replaced, the kept one is not.
    assert tester.submit(6, weights[0], 600)
    wait_until(lambda: tester.evaluating == 6, 10, "evaluation 6 to start")
    assert tester.submit(7, weights[1], 700)
    assert tester.submit(8, weights[2], 800, keep=True)
    assert tester.submit(9, weights[0], 900)
    assert tester.submit(10, weights[1], 1000)
    reports = tester.drain(READY_TIMEOUT_S)
    assert [r.policy_version for r in reports] == [6, 8, 10]
    assert tester.superseded == 3 + 2
    assert reports[1].returns == tuple(
        in_process_returns(SLOW_CARTPOLE, weights[2], seed=5, episodes=2)
    )


def test_periodic_evaluations_are_paced_to_a_share_of_the_wall_time(testers) -> None:
    # max_share 0.1: an evaluation that took s seconds holds the next plain one until 10 s after it
    # started. Weights submitted meanwhile replace the waiting set; kept ones and drain() do not wait.
    tester = testers(SLOW_CARTPOLE, episodes=3, seed=2, max_share=0.1)
    weights = [random_weights(SLOW_CARTPOLE, seed) for seed in range(3)]
    assert tester.submit(1, weights[0], 100)
    wait_until(lambda: tester.completed == 1, READY_TIMEOUT_S, "evaluation 1")
    [first] = tester.poll()
    assert first.wall_seconds > 0.1  # SlowCartPole: 10 ms a step
    assert tester.submit(2, weights[1], 200) and tester.submit(3, weights[2], 300)
    time.sleep(min(2.0, 5 * first.wall_seconds))
    assert (tester.evaluating, tester.pending, tester.superseded) == (None, 3, 1), (
        "the next one waits its turn"
    )
    assert tester.submit(4, weights[0], 400, keep=True)  # kept weights start at once
    wait_until(lambda: tester.completed == 2, READY_TIMEOUT_S, "the kept evaluation")
    [kept] = tester.poll()
    assert kept.policy_version == 4 and tester.superseded == 2
    assert tester.submit(5, weights[1], 500)
    reports = tester.drain(READY_TIMEOUT_S)  # the end of a run: no pacing
    assert [r.policy_version for r in reports] == [5]
    # Pacing would hold evaluation 5 until at least wall_seconds / max_share after evaluation 4 started
    # (the tester's hand-off comes before the child's start, its report after the child's finish).
    paced_start = kept.finished_at - kept.wall_seconds + kept.wall_seconds / 0.1
    assert reports[0].finished_at - reports[0].wall_seconds < paced_start, (
        "drain() waited for pacing"
    )


def test_pacing_and_video_settings_are_checked() -> None:
    schema = schema_of(CARTPOLE)
    for bad in ({"max_share": 0.0}, {"max_share": 1.5}, {"video_every": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Tester(CARTPOLE, episodes=1, greedy=True, seed=0, schema_dict=schema, **bad)


def test_close_stops_a_running_evaluation_and_leaves_no_process(testers) -> None:
    tester = testers(SLOW_CARTPOLE, episodes=500, seed=1)  # minutes of evaluation
    assert tester.submit(1, random_weights(SLOW_CARTPOLE, 0), 0)
    wait_until(lambda: tester.evaluating == 1, READY_TIMEOUT_S, "the evaluation to start")
    pid = tester.pid
    started = time.monotonic()
    tester.close()
    assert time.monotonic() - started < 10
    assert process_gone(pid)
    tester.close()  # idempotent
    assert not tester.alive and tester.submit(2, {}, 0) is False and tester.poll() == []


def test_close_on_errors_and_before_start() -> None:
    Tester(CARTPOLE, episodes=1, greedy=True, seed=0, schema_dict=schema_of(CARTPOLE)).close()
    pid = None
    with pytest.raises(RuntimeError, match="boom"):
        with Tester(
            CARTPOLE, episodes=1, greedy=True, seed=0, schema_dict=schema_of(CARTPOLE)
        ) as tester:
            tester.start()
            pid = tester.pid
            raise RuntimeError("boom")
    assert pid is not None and process_gone(pid)
    assert multiprocessing.active_children() == []


def test_a_tester_that_cannot_start_says_why(testers) -> None:
    tester = testers("NoSuchEnv-v0", schema_dict=schema_of(CARTPOLE))
    wait_until(lambda: not tester.alive, READY_TIMEOUT_S, "the tester to fail")
    assert tester.last_error is not None and "cannot start" in tester.last_error
    assert "NoSuchEnv-v0" in tester.last_error
    assert tester.submit(1, random_weights(CARTPOLE, 0), 0) is False


def test_bad_weights_fail_one_evaluation_not_the_tester(testers) -> None:
    tester = testers()
    weights = random_weights(CARTPOLE, 0)
    bad = dict(weights)
    bad.pop(sorted(bad)[0])
    assert tester.submit(1, bad, 0)
    assert tester.drain(READY_TIMEOUT_S) == []
    assert (
        tester.failed == 1
        and "policy version 1" in tester.last_error
        and "missing names" in tester.last_error
    )
    assert tester.submit(2, weights, 0)
    assert [r.policy_version for r in tester.drain(READY_TIMEOUT_S)] == [2]


def test_the_tester_process_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from oakemu_core.run.tester import Tester
        from tests.run.test_tester import random_weights, schema_of
        if __name__ == "__main__":
            tester = Tester({SLOW_CARTPOLE!r}, episodes=500, greedy=True, seed=0,
                            schema_dict=schema_of({SLOW_CARTPOLE!r}))
            tester.start()
            tester.submit(1, random_weights({SLOW_CARTPOLE!r}, 0), 0)
            while tester.evaluating != 1:
                time.sleep(0.05)
            print(tester.pid, flush=True)
            time.sleep(600)
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child_pid = None
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"parent printed {line!r}"
        child_pid = int(line)
        assert not process_gone(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: process_gone(child_pid), 10, f"the orphaned tester {child_pid} to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child_pid is not None and not process_gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------- best.pt
def report(version: int, mean: float, weights: dict[str, np.ndarray] | None) -> EvaluationReport:
    return EvaluationReport(
        policy_version=version,
        global_step=100 * version,
        episodes=2,
        return_mean=mean,
        return_std=1.0,
        length_mean=mean,
        returns=(mean - 1, mean + 1),
        lengths=(1, 2),
        greedy=True,
        wall_seconds=0.1,
        finished_at=time.time(),
        weights=weights,
    )


def test_best_checkpoint_is_written_only_on_improvement_with_the_evaluated_weights(
    tmp_path: Path,
) -> None:
    schema = schema_of(CARTPOLE)
    torch.manual_seed(0)
    current, env = build_evaluation(CARTPOLE, schema, seed=None)  # the learner's newer weights
    env.close()
    calls = []

    def state_fn() -> dict:
        calls.append(1)
        return {
            "model": current.state_dict(),
            "optimizer": {"lr": 1e-3},
            "env": {"env_id": CARTPOLE, "schema": schema},
            "config": {"normalize_observations": False},
        }

    tracker = BestCheckpointTracker(tmp_path)
    path = tmp_path / "checkpoints" / BEST_NAME
    evaluated = {version: random_weights(CARTPOLE, version) for version in (1, 2, 3)}
    assert tracker.consider(report(1, 20.0, evaluated[1]), state_fn) and path.is_file()
    first_bytes = path.read_bytes()
    assert not tracker.consider(report(2, 15.0, evaluated[2]), state_fn)  # worse
    assert not tracker.consider(report(2, 20.0, evaluated[2]), state_fn)  # equal is not better
    assert not tracker.consider(report(2, math.nan, evaluated[2]), state_fn)
    assert path.read_bytes() == first_bytes and len(calls) == 1  # state_fn only called to write
    assert tracker.consider(report(3, 31.5, evaluated[3]), state_fn)
    assert (tracker.best_return, tracker.best_policy_version) == (31.5, 3)

    state = load_checkpoint(path)
    assert (
        state["best_evaluation"]["policy_version"] == 3
        and state["best_evaluation"]["return_mean"] == 31.5
    )
    assert state["optimizer"] == {"lr": 1e-3}
    for name, array in evaluated[
        3
    ].items():  # the evaluated weights, not the learner's current ones
        np.testing.assert_array_equal(state["model"][name].numpy(), array)
        assert state["model"][name].dtype == current.state_dict()[name].dtype
    # `oakemu evaluate best.pt` plays the evaluated policy.
    assert evaluate(path, episodes=2, greedy=True, seed=5) == in_process_returns(
        CARTPOLE, evaluated[3], seed=5, episodes=2
    )
    # A resumed run reads the best so far from best.pt and only replaces it when it improves.
    resumed = BestCheckpointTracker(tmp_path)
    assert (resumed.best_return, resumed.best_policy_version) == (31.5, 3)
    assert not resumed.consider(report(4, 30.0, evaluated[1]), state_fn)
    restored = BestCheckpointTracker(tmp_path / "other", best_return=None)
    restored.load_state_dict(tracker.state_dict())
    assert restored.best_return == 31.5


def test_best_checkpoint_refuses_weights_that_do_not_fit_and_keeps_the_old_file(
    tmp_path: Path,
) -> None:
    schema = schema_of(CARTPOLE)
    model, env = build_evaluation(CARTPOLE, schema, seed=0)
    env.close()

    def state_fn() -> dict:
        return {
            "model": model.state_dict(),
            "env": {"env_id": CARTPOLE, "schema": schema},
            "config": {},
        }

    tracker = BestCheckpointTracker(tmp_path)
    assert tracker.consider(report(1, 5.0, random_weights(CARTPOLE, 1)), state_fn)
    before = (tmp_path / "checkpoints" / BEST_NAME).read_bytes()
    bad = random_weights(CARTPOLE, 2)
    bad.pop(sorted(bad)[0])
    with pytest.raises(ValueError, match="missing"):
        tracker.consider(report(2, 50.0, bad), state_fn)
    assert (
        tmp_path / "checkpoints" / BEST_NAME
    ).read_bytes() == before and tracker.best_return == 5.0
