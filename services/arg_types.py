"""argparse ``type=`` converters shared by the ``oakemu`` subcommands: a bad value is one usage line
(``argparse.ArgumentTypeError``), exit status 2."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """``text`` as an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, received {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, received {text!r}")
    return value


def positive_float(text: str) -> float:
    """``text`` as a finite or infinite float > 0 (NaN is refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, received {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, received {text!r}")
    return value
