"""Helpers of the benchmark scripts' tests: a script of ``benchmarks/`` as a module, and the
configuration an ``oakemu train`` command line would train with."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"


def load_script(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (executed, not run as a script), registered in
    ``sys.modules`` (dataclasses look their module up while building the class)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def train_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The configuration ``oakemu train ARGS`` would train with: no ``OAKEMU_*`` variable of the shell
    counts, and the training itself is faked."""
    from oakemu_services import cli

    for variable in [v for v in os.environ if v.startswith("OAKEMU_")]:
        monkeypatch.delenv(variable)
    calls: list[tuple[Any, ...]] = []
    fake = types.ModuleType("oakemu_services.train")
    fake.main = lambda *args, **kwargs: calls.append(args) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "oakemu_services.train", fake)
    assert cli.main(["train", *args]) == 0
    return calls[0][0]
