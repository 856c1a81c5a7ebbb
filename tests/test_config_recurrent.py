"""A recurrent policy's settings that cannot be served are refused by config validation: env groups
(each actor steps its envs in one group) and the ONNX Runtime and bfloat16 inference backends."""

from __future__ import annotations

import os

import pytest
from oakemu_services import cli

from oakemu_core.config import OakEmuConfig


@pytest.fixture(autouse=True)
def _clean_oakemu_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OAKEMU_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--recurrent", "lstm", "--env-groups", "2"], "env_groups"),
        (["--recurrent", "gru", "--actor-inference", "bfloat16"], "actor_inference"),
        (["--recurrent", "lstm", "--actor-inference", "onnxruntime"], "actor_inference"),
    ],
)
def test_a_recurrent_policy_with_env_groups_or_a_non_torch_backend_is_one_line_exit_2(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    assert cli.main(["train", "--env-id", "CartPole-v1", "--runs-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "recurrent" in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_recurrent_policy_keeps_one_env_group_and_auto_or_torch_inference() -> None:
    for inference in ("auto", "torch"):
        config = OakEmuConfig(env_id="CartPole-v1", recurrent="lstm", actor_inference=inference)
        assert config.env_groups == 1 and config.network.is_recurrent
    assert OakEmuConfig(env_id="CartPole-v1", env_groups=2).env_groups == 2  # feed-forward: allowed
