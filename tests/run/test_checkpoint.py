"""Tests for oakemu_core.run.checkpoint: atomic writes, crash safety, latest lookup, RNG state."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oakemu_core.run import checkpoint as ckpt
from oakemu_core.run.checkpoint import (
    CheckpointError,
    capture_rng_state,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    save_run_checkpoint,
)


def _model_and_optimizer_state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "counters": {"update": 3},
    }


def test_save_and_load_round_trip_with_model_optimizer_and_rng(tmp_path: Path) -> None:
    state = _model_and_optimizer_state()
    state["rng"] = capture_rng_state()
    path = tmp_path / "sub" / "c.pt"
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded["counters"] == {"update": 3}
    for name, tensor in state["model"].items():
        torch.testing.assert_close(loaded["model"][name], tensor)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]  # no temp file left


def test_crash_mid_write_keeps_previous_checkpoint_and_removes_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"version": 1})
    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        real_save({"version": "partial"}, f)  # some bytes reach the temp file first
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt.torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, {"version": 2})
    monkeypatch.undo()
    assert load_checkpoint(path) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_save_rejects_values_a_safe_load_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    with pytest.raises(TypeError, match=r"state\['stats'\]\['x'\].*ndarray"):
        save_checkpoint(path, {"stats": {"x": np.zeros(3)}})
    with pytest.raises(TypeError, match="float64"):
        save_checkpoint(path, {"lr": np.float64(0.1)})  # a float subclass, refused by weights_only
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_load_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no file"):
        load_checkpoint(tmp_path / "absent.pt")
    save_checkpoint(tmp_path / "good.pt", {"a": torch.arange(1000)})
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        load_checkpoint(tmp_path / "truncated.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="garbage.pt"):
        load_checkpoint(tmp_path / "garbage.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a dict"):
        load_checkpoint(tmp_path / "list.pt")


def test_run_checkpoints_latest_pointer_and_pruning(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert checkpoint_path(tmp_path, 7) == tmp_path / "checkpoints" / "checkpoint_00000007.pt"
    for update in (2, 10, 5):  # latest.pt follows the last save, not the highest number
        save_run_checkpoint(tmp_path, update, {"update": update}, keep_last=2)
    directory = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) == directory / "checkpoint_00000005.pt"
    assert load_checkpoint(directory / "latest.pt") == {"update": 5}
    # keep_last=2 deleted the lowest-numbered one.
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint_00000005.pt",
        "checkpoint_00000010.pt",
        "latest.pt",
    ]
    # Without a usable latest.pt, the highest number wins.
    (directory / "latest.pt").unlink()
    os.symlink("checkpoint_99999999.pt", directory / "latest.pt")  # dangling
    assert latest_checkpoint(tmp_path) == directory / "checkpoint_00000010.pt"


def test_best_pt_alone_is_no_resume_point_and_the_paths_need_no_torch(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"")
    assert latest_checkpoint(tmp_path) is None
    code = "import sys, oakemu_core.run.checkpoint_paths; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"


def test_rng_state_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng_state()})
    expected = (random.random(), np.random.normal(), np.random.rand(3), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (random.random(), np.random.normal(), np.random.rand(3), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1]
    np.testing.assert_array_equal(got[2], expected[2])
    torch.testing.assert_close(got[3], expected[3], rtol=0, atol=0)
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state({"python": random.getstate(), "torch": torch.get_rng_state()})


def test_a_damaged_latest_target_is_set_aside_once_with_a_relative_run_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``latest.pt`` (a symlink) and ``checkpoint_<n>.pt`` are one file: with a relative run folder (the
    README's ``runs/NAME``) it is still tried, and set aside, once; ``latest.pt`` then points at the
    checkpoint the run resumes from, and paths keep the form the run folder was given in."""
    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs") / "r6"
    for update in (50, 79):
        save_run_checkpoint(run_dir, update, {"update": update})
    directory = run_dir / "checkpoints"
    assert latest_checkpoint(run_dir) == directory / "checkpoint_00000079.pt"  # relative, as given
    os.truncate(directory / "latest.pt", 20)  # through the link: checkpoint_00000079.pt is damaged
    found = ckpt.newest_readable_checkpoint(run_dir)
    assert found is not None
    resumed, state, unreadable = found
    assert resumed == directory / "checkpoint_00000050.pt" and state == {"update": 50}
    assert [path for path, _ in unreadable] == [directory / "checkpoint_00000079.pt"]
    [note] = ckpt.set_aside_unreadable(resumed, unreadable)
    assert f"checkpoint {directory / 'checkpoint_00000079.pt'} is not readable" in note
    assert (directory / "checkpoint_00000079.pt.unreadable").is_file()
    assert os.readlink(directory / "latest.pt") == "checkpoint_00000050.pt"
    assert load_checkpoint(directory / "latest.pt") == {"update": 50}


def test_a_runs_checkpoints_keep_the_path_form_of_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Run.latest_checkpoint`` is relative when the run folder was given relative, as ``run_dir`` and
    ``best_checkpoint`` are (not latest.pt's target resolved to an absolute path)."""
    from oakemu_core.run.results import read_run

    monkeypatch.chdir(tmp_path)
    for run_dir in (Path("runs") / "r", tmp_path / "runs" / "r"):
        save_run_checkpoint(run_dir, 3, {"update": 3})
        (run_dir / "checkpoints" / "best.pt").write_bytes(b"")
        run = read_run(run_dir)
        assert run.run_dir == run_dir
        assert run.latest_checkpoint == run_dir / "checkpoints" / "checkpoint_00000003.pt"
        assert run.best_checkpoint == run_dir / "checkpoints" / "best.pt"
