"""A user's encoder (``policy_module``) whose module fails to import in any way is refused in one line."""

from __future__ import annotations

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
