"""Faults end to end (real ``oakemu learner`` / ``oakemu actor`` / ``oakemu train`` processes):

- a full disk during a run (a real 2 MiB tmpfs mounted by the test): training goes on, the previous
  checkpoint stays loadable, the error names the file, JSON lines stay whole, checkpoints resume after
  space comes back; a final checkpoint that cannot be written makes ``oakemu train`` exit 1 naming it;
- ``kill -9`` + resume, three times: ``global_step`` never goes back in ``metrics.jsonl`` / ``episodes.jsonl``;
- a flood of malformed frames: a bounded number of log lines, exact counters, and every message the
  learner read is accepted, rejected by reason or a late step (books balanced over real sockets);
- resume with another env id: one clear line, exit status 2, no traceback, nothing in the run folder changed;
- a run folder belongs to one run: two runs named in the same second get a folder each; a live run's
  folder is refused (naming its pid) until its processes are gone, also after ``kill -9``; a damaged
  newest checkpoint is skipped on resume.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import tomllib
from pathlib import Path

import numpy as np
import pytest
import zmq

from oakemu_core.policy.distributions import Categorical
from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint
from oakemu_core.run.run_lock import holder_pid
from oakemu_core.run.telemetry import TelemetrySnapshot
from oakemu_core.step_schema import build_schema
from oakemu_core.transport.auth import new_routing_id
from oakemu_core.transport.control import (
    Heartbeat,
    JoinRequest,
    Leave,
    decode_message,
    encode_heartbeat,
    encode_join_request,
    encode_leave,
)
from oakemu_core.transport.steps import StepMessage, StepSpec, encode_step
from tests.e2e_helpers import (
    E2EProcesses,
    describe_all,
    python_path_with_site_hook,
    read_jsonl,
    wait_for,
)
from tests.fault_helpers import fill_disk

pytestmark = pytest.mark.slow

RUN_NAME = "faults"


def learner_args(e2e: E2EProcesses, *extra: str, env: str = "CartPole-v1") -> list[str]:
    """A learner for 1 actor x 2 envs, rollouts of 16 steps, a budget it never reaches."""
    return [
        "learner",
        "--env",
        env,
        "--num-actors",
        "1",
        "--envs-per-actor",
        "2",
        "--rollout-length",
        "16",
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        "2",
        "--total-env-steps",
        "100000000",
        "--run-name",
        RUN_NAME,
        "--log-format",
        "plain",
        *e2e.flags(*extra),
    ]


def actor_args(e2e: E2EProcesses, actor_id: str = "actor-0") -> list[str]:
    return [
        "actor",
        "--envs-per-actor",
        "2",
        "--actor-id",
        actor_id,
        "--log-format",
        "plain",
        *e2e.flags(role="actor"),
    ]


def checkpoint_update(path: Path | None) -> int:
    return -1 if path is None else int(path.name.split("_")[1].split(".")[0])


def assert_whole_json_lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path.name} ends in a torn record: {text[-120:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def global_steps(path: Path) -> list[int]:
    return [int(r["global_step"]) for r in read_jsonl(path)]


# ------------------------------------------------------------------------------- full disk
def test_full_disk_does_not_stop_training(small_tmpfs: Path, e2e: E2EProcesses) -> None:
    e2e.runs_dir = small_tmpfs / "runs"
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    learner = e2e.start(
        "learner",
        learner_args(e2e, "--checkpoint-every-updates", "1", "--max-checkpoint-failures", "1000"),
    )
    actor = e2e.start("actor", actor_args(e2e))
    explain = describe_all(learner, actor)
    telemetry.wait(lambda s: s.iterations >= 3, 120, "3 updates", explain)
    wait_for(lambda: latest_checkpoint(run_dir) is not None, 30, "a checkpoint", on_timeout=explain)

    filler = fill_disk(small_tmpfs)  # the run folder's file system is now full
    kept = latest_checkpoint(run_dir)
    full_at = telemetry.wait(lambda s: True, 10, "a snapshot", explain)
    during = telemetry.wait(
        lambda s: s.checkpoint_failures >= 3 and s.iterations >= full_at.iterations + 4,
        120,
        "3 failed checkpoints while training goes on",
        explain,
    )
    assert learner.poll() is None, learner.describe()
    assert during.log_write_failures > 0  # metrics records dropped (whole), counted
    # The previous checkpoint is untouched and loadable; no temporary file is left behind.
    assert latest_checkpoint(run_dir) == kept
    assert load_checkpoint(kept)["env"]["env_id"] == "CartPole-v1"
    # A checkpoint write may be in flight right now (one per update): its temporary file must be
    # gone once that write failed; none may stay.
    in_flight = {p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")}
    wait_for(
        lambda: not in_flight & {p.name for p in (run_dir / "checkpoints").iterdir()},
        10,
        f"the temporary files {sorted(in_flight)} removed",
        on_timeout=explain,
    )
    log = learner.stderr()
    failure_lines = [
        line
        for line in log.splitlines()
        if "not written: [Errno 28] No space left on device" in line
    ]
    assert failure_lines, explain()
    assert re.search(
        rf"checkpoint {re.escape(str(run_dir))}/checkpoints/checkpoint_\d{{8}}\.pt not written", log
    )
    assert "bytes needed" in failure_lines[0] and "bytes free" in failure_lines[0]
    assert f"{kept} is kept and loadable" in failure_lines[0]
    # One line per failed checkpoint (training went on meanwhile, so the log may hold more than
    # the snapshot counted): their "N of M failures in a row" numbers are 1, 2, 3, ...
    assert len(failure_lines) >= during.checkpoint_failures
    in_a_row = [
        int(m.group(1))
        for m in map(re.compile(r"\((\d+) of \d+ failures in a row").search, failure_lines)
        if m
    ]
    assert in_a_row == list(range(1, len(failure_lines) + 1)), in_a_row
    assert_whole_json_lines(run_dir / "metrics.jsonl")
    assert_whole_json_lines(run_dir / "episodes.jsonl")

    # Space comes back: the next checkpoint time writes again (the retry), counters stay.
    filler.unlink()
    wait_for(
        lambda: checkpoint_update(latest_checkpoint(run_dir)) > checkpoint_update(kept),
        60,
        "a checkpoint after the space came back",
        on_timeout=explain,
    )
    load_checkpoint(latest_checkpoint(run_dir))

    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    assert actor.wait(timeout_s=30) == 0, actor.describe()
    assert "Traceback" not in learner.stderr() and "Exception in thread" not in learner.stderr()
    e2e.assert_clean(timeout_s=10)


def test_checkpoints_that_keep_failing_make_oakemu_train_exit_1_naming_the_file(
    small_tmpfs: Path, e2e: E2EProcesses
) -> None:
    e2e.runs_dir = small_tmpfs / "runs"
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "16",
            "--ppo-epochs",
            "1",
            "--num-minibatches",
            "2",
            "--total-env-steps",
            "100000000",
            "--run-name",
            RUN_NAME,
            "--checkpoint-every-updates",
            "1",
            "--max-checkpoint-failures",
            "2",
            *e2e.flags(),
        ],
    )
    explain = describe_all(train)
    telemetry.wait(lambda s: s.iterations >= 2, 120, "2 updates", explain)
    wait_for(lambda: latest_checkpoint(run_dir) is not None, 30, "a checkpoint", on_timeout=explain)
    # Room for log lines, not for a checkpoint: the next two checkpoint writes fail, the run stops.
    fill_disk(small_tmpfs, leave_bytes=48 * 1024)
    status = train.wait(timeout_s=90)
    out = train.stderr()
    assert status == 1, train.describe()
    assert "error: the learner exited with status 1" in out and "done:" not in out, train.describe()
    assert "checkpoint writes in a row failed" in out and str(run_dir / "checkpoints") in out, (
        train.describe()
    )
    assert "No space left on device" in out and "Traceback" not in out, train.describe()
    e2e.assert_clean(timeout_s=10)


def test_a_run_whose_final_checkpoint_cannot_be_written_exits_1_naming_the_file_and_the_bytes(
    small_tmpfs: Path, e2e: E2EProcesses
) -> None:
    """The disk fills during the run, before any checkpoint: the budget is trained, the final checkpoint
    fails, and ``oakemu train`` ends with one error line naming it (not ``done:`` and a ``next:`` line
    naming a ``latest.pt`` that does not exist), exit 1, also though the learner's log is cut off."""
    e2e.runs_dir = small_tmpfs / "runs"
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "16",
            "--ppo-epochs",
            "1",
            "--num-minibatches",
            "2",
            "--total-env-steps",
            "6400",
            "--run-name",
            RUN_NAME,
            "--checkpoint-every-updates",
            "100000",
            *e2e.flags(),
        ],
    )
    explain = describe_all(train)
    telemetry.wait(lambda s: s.iterations >= 1, 120, "an update", explain)
    fill_disk(small_tmpfs)
    status = train.wait(timeout_s=180)
    out = train.stderr()
    assert status == 1, train.describe()
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "error: the learner exited with status 1: final checkpoint "
        f"{run_dir}/checkpoints/checkpoint_"
    ), train.describe()
    assert "not written: [Errno 28] No space left on device" in last and "bytes needed" in last, (
        last
    )
    assert "bytes free" in last and "Traceback" not in out, last
    assert "done:" not in out and "next:" not in out, train.describe()
    assert not list((run_dir / "checkpoints").glob("checkpoint_*.pt"))
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------------- kill -9 + resume
def test_logs_are_not_written_twice_after_kill_9_and_resume(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / RUN_NAME
    records_past_checkpoint = 0
    iterations = 0
    for round_number in range(4):  # 3 kills, then a clean stop
        telemetry = (
            e2e.telemetry()
        )  # a subscriber per round: no snapshot of an earlier round is read
        learner = e2e.start(
            f"learner-{round_number}", learner_args(e2e, "--checkpoint-every-updates", "3")
        )
        actor = e2e.start(f"actor-{round_number}", actor_args(e2e))
        explain = describe_all(learner, actor)
        start = iterations
        snapshot = telemetry.wait(
            lambda s, start=start: s.iterations >= start + 4,
            120,
            f"round {round_number}: 4 more updates",
            explain,
        )
        iterations = snapshot.iterations
        telemetry.close()
        if round_number < 3:
            learner.popen.kill()
            actor.popen.kill()
            learner.wait(timeout_s=10)
            actor.wait(timeout_s=10)
            checkpoint_step = int(load_checkpoint(latest_checkpoint(run_dir))["global_step"])
            records_past_checkpoint += sum(
                step > checkpoint_step
                for name in ("metrics.jsonl", "episodes.jsonl")
                for step in global_steps(run_dir / name)
            )
        else:  # Ctrl-C on the learner: final checkpoint, exit 130; its actor is told to stop (exit 0)
            learner.send_signal(signal.SIGINT)
            assert learner.wait(timeout_s=60) == 130, learner.describe()
            assert "final checkpoint" in learner.stderr() and "Traceback" not in learner.stderr(), (
                learner.describe()
            )
            assert actor.wait(timeout_s=30) == 0, actor.describe()
    # The kills did leave records past the checkpoint (else this test would prove nothing) ...
    assert records_past_checkpoint > 0
    # ... and each resume cut them: global_step never goes back in either file.
    for name in ("metrics.jsonl", "episodes.jsonl"):
        steps = global_steps(run_dir / name)
        assert steps, name
        backs = [(a, b) for a, b in zip(steps, steps[1:]) if b < a]
        assert backs == [], f"{name}: global_step went back {len(backs)} times: {backs[:5]}"
    # ... and kept each checkpointed update's own record: charts/update has no gap and no repeat.
    updates = [
        int(r["charts/update"])
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "charts/update" in r
    ]
    assert updates == list(range(1, len(updates) + 1)), updates
    assert any(
        "removed records past the checkpoint" in e2e.started[i].stderr()
        for i in range(len(e2e.started))
    )
    e2e.assert_clean(timeout_s=10)


# ----------------------------------------------------------------------- flood + every frame
def _step(
    actor_id: str,
    incarnation: str,
    seq: int,
    n: int = 2,
    obs_dtype=np.float32,
    obs_rows: int | None = None,
) -> list[bytes]:
    """The frames of a CartPole step message; another observation dtype or row count: the bytes of
    such an array in the observations' frame."""
    rows = n if obs_rows is None else obs_rows
    frames = encode_step(
        StepMessage(
            actor_id=actor_id,
            incarnation=incarnation,
            seq=seq,
            policy_version=0,
            fields={
                "observations": np.zeros((n, 4), np.float32),
                "actions": np.zeros(n, np.int64),
                "log_probs": np.full(n, -0.69, np.float32),
                "values": np.zeros(n, np.float32),
                "rewards": np.ones(n, np.float32),
                "dones": np.zeros(n, bool),
                "truncated": np.zeros(n, bool),
                "bootstrap_values": np.zeros(n, np.float32),
                "next_values": np.zeros(n, np.float32),
                "trainable": np.ones(n, bool),
            },
        ),
        StepSpec(n, build_schema({"": ((4,), np.float32)}, Categorical(2))),
    )
    return [bytes(frames[0]), np.zeros((rows, 4), obs_dtype).tobytes(), *map(bytes, frames[2:])]


def test_flood_of_malformed_frames_is_counted_exactly_with_a_bounded_log(e2e: E2EProcesses) -> None:
    telemetry = e2e.telemetry()
    context = zmq.Context()
    e2e.defer(context.destroy, linger=0)
    learner = e2e.start(
        "learner",
        learner_args(
            e2e,
            "--rollout-length",
            "64",
            "--steps-per-message",
            "1",
            "--checkpoint-every-updates",
            "0",
        ),
    )
    explain = describe_all(learner)
    telemetry.wait(lambda s: True, 60, "the learner's first snapshot", explain)
    control = context.socket(zmq.DEALER)  # REQ envelopes by hand: many requests without waiting
    control.routing_id = (
        new_routing_id()
    )  # as an actor's control socket (without: anonymous_connection)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(e2e.ports.control_address)
    data = context.socket(zmq.PUSH)
    data.setsockopt(zmq.LINGER, 0)
    data.setsockopt(zmq.SNDHWM, 100_000)
    data.connect(e2e.ports.data_address)
    sent = {"data": 0, "control": 0}

    def request(body: bytes, wait: bool = True) -> None:
        control.send_multipart([b"", body])
        sent["control"] += 1
        if wait:
            assert control.poll(10_000), "no reply"
            reply = control.recv_multipart()
            decode_message(reply[-1], max_bytes=64 * 2**20)

    def push(frames: list[bytes]) -> None:
        data.send_multipart(frames)
        sent["data"] += 1

    request(encode_join_request(JoinRequest("intruder", "inc-1", 2, "test")))
    for seq in range(10):
        push(_step("intruder", "inc-1", seq))
    telemetry.wait(
        lambda s: s.messages_accepted.get("step", 0) >= 10, 30, "10 accepted steps", explain
    )
    request(encode_heartbeat(Heartbeat("intruder", "inc-1", 10, 0, 1.0, 0.0, 0)))
    request(
        encode_heartbeat(Heartbeat("ghost", "inc-x", 0, 0, 1.0, 0.0, 0))
    )  # unknown: answered "rejoin"
    request(encode_leave(Leave("ghost", "inc-x")))
    request(b"\xc1 not a control message")  # garbage, answered
    request(_step("intruder", "inc-1", 99)[0])  # a step's header on the control socket: schema
    control.send_multipart([b"not-empty", b"body"])  # a bad REQ envelope: garbage, not answered
    control.send(b"one frame")  # [identity, body]: garbage, not answered
    sent["control"] += 2
    push([b"\xc1 not a header", b"second frame"])  # garbage
    push(_step("stranger", "inc-9", 0))  # unknown_actor
    push(_step("intruder", "inc-1", 10, obs_dtype=np.float64))  # a frame of another dtype: size
    push(
        _step("intruder", "inc-1", 50)
    )  # a gap (seq 10 was rejected): accepted, the gap counted as dropped
    push(_step("intruder", "inc-1", 5))  # a replayed seq: out_of_order
    # The flood: 3,000 garbage frames and 1,000 of a wrong shape.
    for i in range(3000):
        push([b"\xc1 garbage %d" % i])
    for _ in range(1000):
        push(_step("intruder", "inc-1", 51, obs_rows=3))
    # The two sockets are not ordered with each other: let the learner read every data message first.
    telemetry.wait(
        lambda s: s.messages_received.get("data", 0) >= sent["data"], 60, "the flood read", explain
    )
    request(encode_leave(Leave("intruder", "inc-1")))
    for seq in range(51, 56):  # in flight after the leave: late steps
        push(_step("intruder", "inc-1", seq))
    expected_rejected = {
        "garbage": 1 + 2 + 1 + 3000,
        "schema": 1,
        "unknown_actor": 1,
        "size": 1 + 1000,
        "out_of_order": 1,
    }

    def settled(s: TelemetrySnapshot) -> bool:
        return (
            sum(s.messages_received.values()) >= sent["data"] + sent["control"]
            and s.dropped.get("late_step_messages", 0) >= 5
        )

    final = telemetry.wait(settled, 60, f"{sent} messages received", explain)
    assert final.messages_received == sent
    assert final.rejected_messages == expected_rejected, (
        final.rejected_messages,
        final.messages_accepted,
        final.dropped,
    )
    assert final.messages_accepted == {
        "join": 1,
        "step": 11,
        "heartbeat": 1,
        "unknown_actor_control": 2,
        "leave": 1,
    }
    assert final.dropped.get("late_step_messages") == 5 and final.dropped.get("late_steps") == 10
    accounted = (
        sum(final.messages_accepted.values())
        + sum(final.rejected_messages.values())
        + final.dropped["late_step_messages"]
    )
    assert accounted == sum(sent.values()) == 4029

    # The log: the first rejection of each reason in full, then a summary every 5 s.
    def rejection_lines() -> list[str]:
        return [line for line in learner.stderr().splitlines() if " rejected " in line]

    def reported_total() -> int:
        total = 0
        for line in rejection_lines():
            match = re.search(r"rejected (\d+) (?:step|control) messages in the last", line)
            total += int(match.group(1)) if match else 1
        return total

    wait_for(
        lambda: reported_total() == sum(expected_rejected.values()),
        20,
        "the summary lines to report every rejection",
        on_timeout=lambda: "\n".join(rejection_lines()),
    )
    lines = rejection_lines()
    assert len(lines) <= 20, "\n".join(lines)
    assert any("rejected step message: garbage" in line for line in lines)
    assert any("rejected control message: garbage" in line for line in lines)
    assert learner.poll() is None and "Traceback" not in learner.stderr()
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------------- resume mismatch
def folder_checksums(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        )
        for p in sorted(run_dir.rglob("*"))
    }


def test_resume_with_another_env_is_refused_and_changes_nothing(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    learner = e2e.start("learner", learner_args(e2e))
    telemetry.wait(lambda s: True, 60, "the learner's first snapshot", describe_all(learner))
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    assert latest_checkpoint(run_dir) is not None
    (run_dir / "metrics.jsonl").write_text('{"global_step": 1}\n')  # something to protect
    before = folder_checksums(run_dir)

    attempts = {
        "learner": learner_args(e2e, env="Acrobot-v1"),
        "train-resume": [
            "train",
            "--resume",
            str(run_dir),
            "--env",
            "Acrobot-v1",
            *e2e.ports.flags(),
        ],
    }
    for name, args in attempts.items():
        process = e2e.start(name, args)
        status = process.wait(timeout_s=120)
        err = process.stderr() + process.stdout()
        assert status == 2, process.describe()
        assert "Traceback" not in err, process.describe()
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, process.describe()
        line = errors[0]
        assert line.startswith(f"oakemu {args[0]}: error: cannot resume"), line
        assert "CartPole-v1" in line and "Acrobot-v1" in line, line
        assert (
            "--run-name" in line
            and "OAKEMU_RUN_NAME" in line
            and "nothing in the run folder was changed" in line
        )
        assert folder_checksums(run_dir) == before, f"{name} changed the run folder"
    # A new run given the stopped run's name is refused too: it would silently continue that run.
    same_name = e2e.start(
        "train-same-name",
        [
            "train",
            "--env",
            "Acrobot-v1",
            "--run-name",
            RUN_NAME,
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "16",
            *e2e.flags(),
        ],
    )
    assert same_name.wait(timeout_s=120) == 2, same_name.describe()
    [line] = [line for line in same_name.stderr().splitlines() if "error" in line]
    assert f"{run_dir} exists and holds an earlier run" in line and f"--resume {run_dir}" in line, (
        line
    )
    assert folder_checksums(run_dir) == before
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------------ two runs, one machine
FROZEN_CLOCK_HOOK = """
import time
_strftime = time.strftime
time.strftime = lambda fmt, *args: "20240102-030405" if fmt == "%Y%m%d-%H%M%S" else _strftime(fmt, *args)
"""
"""A site hook that names every run of a process in the same second."""


def test_two_oakemu_train_runs_share_a_machine_and_the_monitor_finds_each_by_its_folder(
    e2e: E2EProcesses,
) -> None:
    """Two runs of one env and seed started in the same second: each launcher makes a folder of its
    own (``-2`` for the second), picks free ports (Prometheus included) and records them in its
    config.toml, and `oakemu monitor RUN_DIR` reads them there; both runs finish, each learner.log holds
    one learner."""
    args = [
        "--env",
        "CartPole-v1",
        "--num-actors",
        "1",
        "--envs-per-actor",
        "4",
        "--rollout-length",
        "32",
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        "2",
        "--total-env-steps",
        "2048",
        "--eval-every-updates",
        "0",
        "--runs-dir",
        str(e2e.runs_dir),
    ]
    frozen = {"PYTHONPATH": python_path_with_site_hook(e2e.tmp_path, FROZEN_CLOCK_HOOK)}
    runs = {name: e2e.start(name, ["train", *args], env=frozen) for name in ("first", "second")}
    explain = describe_all(*runs.values())
    name = "CartPole-v1__1__20240102-030405"
    run_dirs = [e2e.runs_dir / name, e2e.runs_dir / f"{name}-2"]
    config_files = [run_dir / "config.toml" for run_dir in run_dirs]
    wait_for(
        lambda: all(path.is_file() for path in config_files),
        60,
        "both config.toml",
        on_timeout=explain,
    )
    monitor = e2e.start(
        "monitor", ["monitor", str(run_dirs[1]), "--once", "--json", "--timeout", "60"]
    )
    assert monitor.wait(timeout_s=90) == 0, monitor.describe()
    assert json.loads(monitor.stdout().splitlines()[0])["run_name"] == f"{name}-2"
    for process in runs.values():
        assert process.wait(timeout_s=180) == 0, process.describe()
        assert "done: run folder" in process.stderr(), process.describe()
    assert sorted(p.name for p in e2e.runs_dir.iterdir()) == [name, f"{name}-2"]
    settings = [tomllib.loads(path.read_text()) for path in config_files]
    assert [s["run_name"] for s in settings] == [name, f"{name}-2"]
    ports = [{key: value for key, value in s.items() if key.endswith("_port")} for s in settings]
    assert len(set(ports[0].values()) | set(ports[1].values())) == 10, ports  # ten distinct ports
    assert 5555 not in ports[0].values() and ports[0]["metrics_port"] != 9100
    for run_dir in run_dirs:
        log = (run_dir / "logs" / "learner.log").read_text()
        assert log.count("learner torch threads") == 1 and "Traceback" not in log, log[-2000:]
        assert not (run_dir / "run.lock").exists()  # given up at the end
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------------ a live run's folder
def test_a_live_run_holds_its_folder_until_it_is_gone_then_resumes_past_a_damaged_checkpoint(
    e2e: E2EProcesses,
) -> None:
    """While `oakemu train --run-name exp1` runs, a second run of that name and a --resume of it are
    refused at once naming its launcher's pid. kill -9 of the launcher: its learner writes a final
    checkpoint and exits, the folder is free. A damaged newest checkpoint does not block the resume:
    it resumes from the one before, with a warning, and trains to the end."""
    run_dir = e2e.runs_dir / "exp1"
    small = [
        "--num-actors",
        "1",
        "--envs-per-actor",
        "2",
        "--rollout-length",
        "16",
        "--ppo-epochs",
        "1",
        "--num-minibatches",
        "2",
        "--eval-every-updates",
        "0",
        "--checkpoint-every-updates",
        "1",
    ]
    telemetry = e2e.telemetry()
    first = e2e.start(
        "first",
        [
            "train",
            "--env",
            "CartPole-v1",
            *small,
            "--total-env-steps",
            "100000000",
            "--run-name",
            "exp1",
            *e2e.flags(),
        ],
    )
    telemetry.wait(lambda s: s.iterations >= 3, 120, "3 updates", describe_all(first))
    assert holder_pid(run_dir) == first.pid
    for name, args in {
        "same-name": [
            "train",
            "--env",
            "CartPole-v1",
            "--run-name",
            "exp1",
            "--runs-dir",
            str(e2e.runs_dir),
        ],
        "resume": ["train", "--resume", str(run_dir)],
    }.items():
        refused = e2e.start(name, args)
        assert refused.wait(timeout_s=60) == 2, refused.describe()
        [line] = [line for line in refused.stderr().splitlines() if line.strip()]
        assert f"{run_dir} is in use by a live run (pid {first.pid})" in line, line
    first.popen.kill()  # kill -9 of the launcher
    first.wait(timeout_s=10)
    wait_for(
        lambda: holder_pid(run_dir) is None,
        90,
        "the run folder given up by the stopped learner",
        on_timeout=describe_all(first),
    )
    checkpoints = sorted((run_dir / "checkpoints").glob("checkpoint_*.pt"))
    newest, previous = checkpoints[-1], checkpoints[-2]
    newest.write_bytes(newest.read_bytes()[:1000])  # damaged outside oakemu (a bad copy)
    budget = int(load_checkpoint(previous)["ppo"]["trained_env_steps"]) + 64  # two more updates
    resumed = e2e.start(
        "resumed",
        ["train", "--resume", str(run_dir), "--total-env-steps", str(budget), *e2e.ports.flags()],
    )
    e2e.finish(resumed, timeout_s=180, run_dir=run_dir)
    err = resumed.stderr()
    assert (
        f"warning: checkpoint {newest} is not readable" in err
        and f"resuming from {previous.name}" in err
    ), err
    assert "(resumed)" in err and (newest.parent / (newest.name + ".unreadable")).is_file()
    assert holder_pid(run_dir) is None
