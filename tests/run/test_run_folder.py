"""Run-folder faults, library level: rate-limited logs, whole-or-nothing JSON lines, checkpoint writes on a
full disk, logs cut back to the checkpoint, resume compatibility checks.

Disk-full cases run on a real 2 MiB tmpfs where this process may mount one (root), else on an injected
``OSError(ENOSPC)``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from oakemu_core.envs import env_spec
from oakemu_core.errors import DiskFullError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env, schema_from_dict
from oakemu_core.run.checkpoint import (
    CheckpointWriteFailed,
    CheckpointWriter,
    latest_checkpoint,
    load_checkpoint,
)
from oakemu_core.run.log_limits import RateLimitedLog
from oakemu_core.run.metrics import JsonLinesWriter, MetricsLogger
from oakemu_core.run.run_folder import (
    ResumeMismatchError,
    check_resume_compatible,
    config_changes,
    resume_step,
    truncate_after,
    truncate_run_logs,
    write_text_atomic,
)
from tests.fault_helpers import fill_disk, small_tmpfs_fixture  # noqa: F401 - the `small_tmpfs` fixture


# ------------------------------------------------------------------------------ RateLimitedLog
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_bounds_lines_and_reports_exact_totals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    logger = logging.getLogger("test.ratelimit")
    limiter = RateLimitedLog(
        logger, "step messages", first_prefix="rejected step message", period_s=5.0, clock=clock
    )
    events = {"schema": 0, "garbage": 0}
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for i in range(12_000):  # 12,000 events over 12 s (1 ms apart)
            clock.now = i / 1000
            reason = "schema" if i % 3 else "garbage"
            events[reason] += 1
            limiter.event(reason, f"{reason}: frame {i}")
        clock.now = 100.0
        limiter.flush()
    lines = [r.getMessage() for r in caplog.records]
    # 2 first lines + one summary per 5 s (12 s -> 2) + the final flush
    assert len(lines) <= 2 + 12 // 5 + 1, lines
    assert lines[0] == "rejected step message: garbage: frame 0"
    assert lines[1] == "rejected step message: schema: frame 1"
    assert (
        lines[2].startswith("rejected ") and "step messages in the last 5.0 s: schema " in lines[2]
    )
    reported = {"schema": 1, "garbage": 1}  # the first lines
    for line in lines[2:]:
        counts = line.split(": ", 1)[1].split(" (last: ")[0]
        for part in counts.split(", "):
            reason, count = part.split()
            reported[reason] += int(count)
    assert reported == events  # nothing lost from the summaries
    assert limiter.events == 12_000 and limiter.lines_written == len(lines)
    with pytest.raises(ValueError, match="period_s"):
        RateLimitedLog(logger, "x", first_prefix="x", period_s=0)


# --------------------------------------------------------------------------- JsonLinesWriter
def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"torn last line: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_writer_writes_whole_records_or_none_on_a_full_disk(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = small_tmpfs / "metrics.jsonl"
    writer = JsonLinesWriter(path)
    assert writer.write({"global_step": 1, "x": 1.0})
    # The file's last page has room: a large record fits partly, then ENOSPC (a short write) -> undone.
    filler = fill_disk(small_tmpfs)
    with caplog.at_level(logging.WARNING, logger="oakemu.metrics"):
        for step in range(2, 50):
            assert not writer.write({"global_step": step, "pad": "x" * 6000})
    assert _lines(path) == [{"global_step": 1, "x": 1.0}]
    assert writer.failures == 48 and writer.records == 1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages  # one line per 30 s, not one per failure
    assert str(path) in messages[0] and "No space left on device" in messages[0]
    assert "bytes needed" in messages[0] and "free" in messages[0]
    filler.unlink()
    assert writer.write({"global_step": 50})
    assert [r["global_step"] for r in _lines(path)] == [1, 50]
    writer.close()
    writer.close()


def test_metrics_logger_keeps_going_on_a_full_disk(small_tmpfs: Path) -> None:
    logger = MetricsLogger(small_tmpfs)
    logger.log(100, {"charts/SPS": 1.0})
    filler = fill_disk(small_tmpfs)
    for step in range(200, 3000, 100):
        logger.log(step, {f"charts/x{i}": float(i) for i in range(60)})  # never raises
    logger.flush()
    assert logger.write_failures > 0
    filler.unlink()
    logger.log(5000, {"charts/SPS": 2.0})
    logger.close()
    steps = [r["global_step"] for r in _lines(small_tmpfs / "metrics.jsonl")]
    assert steps[0] == 100 and steps[-1] == 5000 and steps == sorted(steps)


# --------------------------------------------------------------------------- CheckpointWriter
def _state(update: int, size: int = 50_000) -> dict:
    return {"update": update, "weights": torch.zeros(size)}


def _check_full_disk_checkpoints(
    run_dir: Path, make_full, make_free, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CheckpointWriter(run_dir, keep_last=2, max_consecutive_failures=3)
    first = writer.save(1, _state(1))
    assert first is not None and writer.last_saved == first
    make_full()
    with caplog.at_level(logging.ERROR, logger="oakemu.checkpoint"):
        assert writer.save(2, _state(2)) is None
        assert writer.save(3, _state(3)) is None
    assert (writer.failures, writer.consecutive_failures) == (2, 2)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # one line per failure
    assert str(run_dir / "checkpoints" / "checkpoint_00000002.pt") in messages[0]
    assert (
        "No space left on device" in messages[0]
        and "bytes needed" in messages[0]
        and "bytes free" in messages[0]
    )
    assert f"{first} is kept and loadable" in messages[0]
    # The previous checkpoint is untouched and loadable; no temporary file is left behind.
    assert latest_checkpoint(run_dir) == first and load_checkpoint(first)["update"] == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "checkpoint_00000001.pt",
        "latest.pt",
    ]
    with pytest.raises(
        CheckpointWriteFailed,
        match=r"3 checkpoint writes in a row failed .*checkpoint_00000004\.pt",
    ):
        writer.save(4, _state(4))
    make_free()
    assert writer.save(5, _state(5)) is not None  # a retry after the space came back
    assert writer.consecutive_failures == 0 and writer.failures == 3
    assert load_checkpoint(latest_checkpoint(run_dir))["update"] == 5


def test_checkpoint_writer_on_a_full_tmpfs(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = small_tmpfs / "run"
    fillers: list[Path] = []
    _check_full_disk_checkpoints(
        run_dir,
        lambda: fillers.append(fill_disk(small_tmpfs)),
        lambda: fillers.pop().unlink(),
        caplog,
    )


def test_checkpoint_writer_with_an_injected_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The bytes reach the page cache; the fsync that must put them on the disk fails (as a full disk
    # or a quota reports a delayed write): the temporary file goes, the previous checkpoint stays.
    from oakemu_core.run import checkpoint as checkpoint_module

    real_fsync = os.fsync
    full = {"on": False}

    def fsync(fd: int) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_module.os, "fsync", fsync)
    _check_full_disk_checkpoints(
        tmp_path / "run", lambda: full.update(on=True), lambda: full.update(on=False), caplog
    )


def test_a_failed_final_checkpoint_is_logged_as_the_final_one_and_known_as_not_written(
    small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = small_tmpfs / "run"
    writer = CheckpointWriter(run_dir, keep_last=2, max_consecutive_failures=1)
    filler = fill_disk(small_tmpfs)
    with caplog.at_level(logging.ERROR, logger="oakemu.checkpoint"):
        assert (
            writer.save(7, _state(7), final=True) is None
        )  # no CheckpointWriteFailed: no retry follows anyway
    [message] = [r.getMessage() for r in caplog.records]
    path = run_dir / "checkpoints" / "checkpoint_00000007.pt"
    assert message.startswith(
        f"final checkpoint {path} not written: [Errno 28] No space left on device ("
    ), message
    assert (
        "bytes needed" in message and "bytes free" in message and "no earlier checkpoint" in message
    )
    assert "training goes on" not in message and writer.final_saved is None
    filler.unlink()
    assert (
        writer.save(7, _state(7)) == path and writer.final_saved is None
    )  # a periodic save is not the final one
    assert (
        writer.save(8, _state(8), final=True) == run_dir / "checkpoints" / "checkpoint_00000008.pt"
    )
    assert writer.final_saved == run_dir / "checkpoints" / "checkpoint_00000008.pt"


# ------------------------------------------------------------------------------- log cuts
def test_truncate_after_keeps_records_up_to_the_checkpoint_and_drops_torn_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "episodes.jsonl"
    records = [{"global_step": s, "episodic_return": 1.0} for s in (10, 20, 30, 40)]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"global_step": 50, "episodic_ret'
    )
    assert truncate_after(path, 30) == 2  # step 40 and the torn line
    assert [r["global_step"] for r in _lines(path)] == [10, 20, 30]
    inode = path.stat().st_ino
    assert (
        truncate_after(path, 30) == 0 and path.stat().st_ino == inode
    )  # nothing to cut: not rewritten
    assert (
        truncate_after(tmp_path / "missing.jsonl", 5) == 0
        and not (tmp_path / "missing.jsonl").exists()
    )
    (tmp_path / "metrics.jsonl").write_text('{"global_step": 5}\n{"global_step": 35}\n')
    assert truncate_run_logs(tmp_path, 20) == {"metrics.jsonl": 1, "episodes.jsonl": 1}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_resume_keeps_the_checkpointed_updates_record_so_charts_update_has_no_gap(
    tmp_path: Path,
) -> None:
    """The checkpoint of update 2 records the steps at its rollout's hand-off (200); its metrics record
    came later (256). The resumed count starts at 256: the record stays, later ones go, even one that
    shares its global_step (update 3 here)."""
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"global_step": 128, "charts/update": 1},
                {"global_step": 256, "charts/update": 2},
                {"global_step": 256, "eval/episodic_return": 9.0},
                {"global_step": 256, "charts/update": 3},
                {"global_step": 384, "charts/update": 4},
            ]
        )
    )
    (tmp_path / "episodes.jsonl").write_text(
        '{"global_step": 190}\n{"global_step": 250}\n{"global_step": 300}\n'
    )
    step = resume_step(tmp_path, 200, update=2)
    assert step == 256
    assert truncate_run_logs(tmp_path, step, update=2) == {"metrics.jsonl": 2, "episodes.jsonl": 1}
    assert [r.get("charts/update") for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, None]
    assert resume_step(tmp_path, 500, update=2) == 500  # never below the checkpoint's count
    assert resume_step(tmp_path / "nothing", 200, update=2) == 200


def test_config_toml_is_written_atomically_and_a_full_disk_names_path_and_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "config.toml"
    write_text_atomic(target, "seed = 1\n")
    assert target.read_text() == "seed = 1\n"

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DiskFullError) as caught:
        write_text_atomic(target, "seed = 2\n")
    message = str(caught.value)
    assert f"cannot write {target}: No space left on device (9 bytes needed, " in message
    assert "bytes free on" in message
    assert target.read_text() == "seed = 1\n"  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no temporary file left


def test_config_toml_on_a_full_tmpfs(small_tmpfs: Path) -> None:
    fill_disk(small_tmpfs)
    with pytest.raises(
        DiskFullError,
        match=rf"cannot write {small_tmpfs}/config.toml: .*bytes needed, \d+ bytes free",
    ):
        write_text_atomic(small_tmpfs / "config.toml", "x" * 20_000)
    assert not (small_tmpfs / "config.toml").exists()


# ------------------------------------------------------------------------------ resume checks
def _learner_parts(env_id: str, normalize: bool = False):
    spec = env_spec(env_id)
    schema = schema_for_env(spec)
    model = build_model(
        spec.observation_layout, schema.distribution, normalize_observations=normalize
    )
    return schema, model


def test_resume_check_refuses_another_env_or_model_with_one_clear_message() -> None:
    schema, model = _learner_parts("CartPole-v1")
    state = {
        "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
        "model": model.state_dict(),
    }
    check_resume_compatible(
        state, env_id="CartPole-v1", schema=schema, model=model
    )  # the same: fine

    other_schema, other_model = _learner_parts("Acrobot-v1")
    with pytest.raises(ResumeMismatchError) as caught:
        check_resume_compatible(
            state,
            env_id="Acrobot-v1",
            schema=other_schema,
            model=other_model,
            checkpoint_path="runs/main/checkpoints/checkpoint_00000003.pt",
        )
    message = str(caught.value)
    assert "\n" not in message
    assert "'CartPole-v1' vs requested 'Acrobot-v1'" in message
    assert "observations float32 (4,)" in message and "observations float32 (6,)" in message
    assert "num_actions=2" in message and "num_actions=3" in message
    assert (
        "checkpoint_00000003.pt" in message
        and "--run-name" in message
        and "OAKEMU_RUN_NAME" in message
    )

    # Same env, another model (observation normaliser on): parameter names differ.
    _, normalised = _learner_parts("CartPole-v1", normalize=True)
    with pytest.raises(ResumeMismatchError, match="model"):
        check_resume_compatible(state, env_id="CartPole-v1", schema=schema, model=normalised)
    # An older checkpoint without "env" is checked on the model alone.
    check_resume_compatible(
        {"model": model.state_dict()}, env_id="CartPole-v1", schema=schema, model=model
    )
    with pytest.raises(ResumeMismatchError, match="shapes differ"):
        check_resume_compatible(
            {"model": model.state_dict()},
            env_id="Acrobot-v1",
            schema=other_schema,
            model=other_model,
        )


def test_config_changes_lists_changed_fields_and_refuses_the_immutable_ones() -> None:
    old = {
        "env_id": "CartPole-v1",
        "seed": 1,
        "learning_rate": 0.00025,
        "run_name": "a",
        "runs_dir": "runs",
    }
    new = {
        "env_id": "CartPole-v1",
        "seed": 2,
        "learning_rate": 2.5e-4,
        "run_name": "a",
        "runs_dir": "other",
        "target_kl": None,
    }
    assert config_changes(old, new) == {"seed": (1, 2)}
    with pytest.raises(
        ResumeMismatchError, match=r"env_id: 'CartPole-v1' -> 'Acrobot-v1'.*--run-name"
    ):
        config_changes(old, dict(new, env_id="Acrobot-v1"))
    with pytest.raises(ResumeMismatchError, match="normalize_observations: False -> True"):
        config_changes(
            dict(old, normalize_observations=False), dict(new, normalize_observations=True)
        )


def test_a_schema_saved_before_rows_carried_the_revision_still_resumes_and_loads() -> None:
    """Checkpoints of earlier runs hold a schema without ``policy_revisions``: resume accepts it
    (only the fields actors send, and the distribution, must match) and ``from_dict`` adds it."""
    schema, model = _learner_parts("CartPole-v1")
    old = schema.to_dict()
    old["fields"] = [f for f in old["fields"] if f["name"] != "policy_revisions"]
    assert len(old["fields"]) == len(schema.fields) - 1
    check_resume_compatible(
        {"env": {"env_id": "CartPole-v1", "schema": old}, "model": model.state_dict()},
        env_id="CartPole-v1",
        schema=schema,
        model=model,
    )
    assert schema_from_dict(old).to_dict() == schema.to_dict()

    changed = schema.to_dict()  # a sent field of another shape is still another space
    next(f for f in changed["fields"] if f["name"] == "observations")["shape"] = [5]
    with pytest.raises(ResumeMismatchError, match="spaces"):
        check_resume_compatible(
            {"env": {"env_id": "CartPole-v1", "schema": changed}},
            env_id="CartPole-v1",
            schema=schema,
        )
