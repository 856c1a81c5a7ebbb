"""``oakemu train`` names a bad network setting once: ``net_arch: expected ...``, not ``net_arch: net_arch: ...``."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--net-arch", "64,-1", "net_arch: expected 'auto', 'none', sizes like '64,64'"),
        ("--impala-channels", "16,,32", "impala_channels: expected channel counts like"),
        ("--impala-channels", "16,0", "impala_channels: expected positive channel counts"),
    ],
)
def test_a_bad_network_setting_is_named_once(
    capsys: pytest.CaptureFixture[str], option: str, value: str, expected: str
) -> None:
    from oakemu_services import cli

    status = cli.main(["train", "--env", "CartPole-v1", option, value])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1
    assert expected in err
    name = expected.split(":")[0]
    assert err.count(f"{name}:") == 1, err
