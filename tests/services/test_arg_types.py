"""Tests for oakemu_services.arg_types: the converters accept what they name and refuse the rest with
one ``ArgumentTypeError`` line; through the CLI a refused value is a usage line and exit status 2."""

from __future__ import annotations

import argparse
import math

import pytest
from oakemu_services.arg_types import positive_float, positive_int
from oakemu_services.cli import main


def test_positive_int_takes_integers_from_one() -> None:
    assert positive_int("1") == 1 and positive_int("250") == 250


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "x", ""])
def test_positive_int_refuses_the_rest(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"integer >= 1, received {text!r}$"):
        positive_int(text)


def test_positive_float_takes_numbers_above_zero() -> None:
    assert positive_float("0.25") == 0.25 and positive_float("1e3") == 1000.0
    assert math.isinf(positive_float("inf"))


@pytest.mark.parametrize("text", ["0", "-1", "nan", "ten"])
def test_positive_float_refuses_the_rest(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"number > 0, received {text!r}$"):
        positive_float(text)


@pytest.mark.parametrize(
    "argv",
    [["tune", "--trials", "0"], ["tune", "--timeout", "-5"], ["evaluate", "x", "--episodes", "0"]],
)
def test_a_refused_value_is_one_usage_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "received" in error and "Traceback" not in error
