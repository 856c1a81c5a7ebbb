"""A checkpoint whose weights do not fit the network its settings describe: one line, exit 2, from
``load_policy``, ``oakemu evaluate`` and ``oakemu export``; never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oakemu_services import cli

from oakemu_core.envs import env_spec
from oakemu_core.errors import CheckpointError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import save_checkpoint
from oakemu_core.run.loading import load_policy


@pytest.fixture
def mismatched(tmp_path: Path) -> Path:
    """A CartPole checkpoint holding feed-forward weights under settings that say LSTM."""
    spec = env_spec("CartPole-v1")
    schema = schema_for_env(spec)
    torch.manual_seed(0)
    model = build_model(spec.observation_layout, schema.distribution)
    path = tmp_path / "checkpoint_00000001.pt"
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
            "config": {"recurrent": "lstm", "recurrent_hidden": 8},
            "ppo": {"policy_version": 1},
            "global_step": 64,
        },
    )
    return path


def test_load_policy_names_the_checkpoint_and_the_difference(mismatched: Path) -> None:
    with pytest.raises(
        CheckpointError, match="weights do not fit the network its settings describe"
    ) as caught:
        load_policy(mismatched)
    message = str(caught.value)
    assert str(mismatched) in message and "\n" not in message and "core" in message


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_evaluate_and_export_refuse_it_in_one_line(
    mismatched: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [command, str(mismatched)] + (
        [str(tmp_path / "out"), "--no-video"] if command == "export" else ["--episodes", "1"]
    )
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights do not fit" in err[0] and "Traceback" not in err[0], err
