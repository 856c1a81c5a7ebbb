"""A user's encoder (``policy_module``) whose module fails to import in any way is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.encoders import UserEncoderError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.network import NetworkSpec

VECTOR = {"": ((4,), "float32")}


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("raise ZeroDivisionError('at import')", "ZeroDivisionError: at import"),
        ("def broken(:\n", "SyntaxError"),
        ("import math\nmath.nope\n", "AttributeError"),
    ],
    ids=["raises", "syntax", "attribute-at-import"],
)
def test_a_module_that_fails_to_import_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, cause: str
) -> None:
    name = f"user_encoder_fault_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserEncoderError) as caught:
        build_model(VECTOR, Categorical(2), network=NetworkSpec(policy_module=f"{name}:Encoder"))
    message = str(caught.value)
    assert "\n" not in message
    assert f"policy_module '{name}:Encoder': cannot import it" in message
    assert cause in message


ENCODER_SOURCE = """
import math
from torch import nn


class Encoder(nn.Module):
    def __init__(self, observation_layout):
        super().__init__()
        shape, _ = observation_layout[""]
        self.out_features = 8
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 8), nn.ReLU())

    def forward(self, x):
        return self.net(x)
"""


@pytest.mark.parametrize("command", ["evaluate", "record"])
def test_a_checkpoint_whose_encoder_is_not_importable_here_is_refused_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """The run trained with the module on its path; evaluate and record run where it is not."""
    from oakemu_services import cli

    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.checkpoint import save_run_checkpoint

    name = "user_encoder_elsewhere"
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / f"{name}.py").write_text(ENCODER_SOURCE)
    network = NetworkSpec(policy_module=f"{name}:Encoder", recurrent="gru", recurrent_hidden=4)
    spec = env_spec("CartPole-v1")
    schema = schema_for_env(spec, network)
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(tmp_path / "modules"))
        model = build_model(spec.observation_layout, schema.distribution, network=network)
    sys.modules.pop(name)
    checkpoint = save_run_checkpoint(
        tmp_path / "run",
        1,
        {
            "model": model.state_dict(),
            "config": {"env_id": "CartPole-v1", **network.to_dict()},
            "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
        },
    )
    arguments = {
        "evaluate": ["evaluate", str(checkpoint), "--episodes", "1"],
        "record": ["record", "--checkpoint", str(checkpoint), "--episodes", "1"],
    }[command] + ([] if command == "evaluate" else ["--output", str(tmp_path / "dataset")])
    status = cli.main(arguments)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"policy_module '{name}:Encoder': cannot import it" in err


@pytest.mark.parametrize(
    ("returns", "cause"),
    [
        ("self.net(x).double()", "float64"),
        ("self.net(x).long()", "int64"),
        ("self.net(x) * float('nan')", "not finite"),
        ("self.net(x) + float('inf')", "not finite"),
    ],
    ids=["float64", "int64", "nan", "inf"],
)
def test_features_that_are_not_finite_float32_are_refused_on_the_probe_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, returns: str, cause: str
) -> None:
    """Such features pass the shape check but stop every actor (dtype) or make every step message
    rejected (non-finite log-probs): refused before anything starts."""
    name = f"user_encoder_returns_{abs(hash(returns))}"
    source = ENCODER_SOURCE.replace("return self.net(x)", f"return {returns}")
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserEncoderError) as caught:
        build_model(VECTOR, Categorical(2), network=NetworkSpec(policy_module=f"{name}:Encoder"))
    message = str(caught.value)
    assert "\n" not in message and f"policy_module '{name}:Encoder'" in message
    assert cause in message
