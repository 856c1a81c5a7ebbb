"""Gymnasium ids for the emulator tests, usable through the ``module:EnvId`` form without a settings flag.

``tests.emulator_envs:OakEmuGameBoyTest-v0``: the generated test ROM (oakemu_core/envs/emulators/testrom.py)
with a reward of +1 per new press of A, 4 frames per action, 32-step episodes.  Importing this
module writes the ROM and its settings file to a folder under the system temp dir (atomically,
named by content, so concurrent actor processes agree) and registers the id.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import gymnasium

from oakemu_core.envs.emulators import make_emulator_env
from oakemu_core.envs.emulators.testrom import build_test_rom

EPISODE_STEPS = 32
SETTINGS = f"""
[gameboy]
frames_per_action = 4
press_frames = 2
max_episode_steps = {EPISODE_STEPS}

[[gameboy.reward]]
name = "a_presses"
kind = "delta"
address = 0xC000
"""


def _write_once(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def test_files() -> tuple[Path, Path]:
    """``(rom path, settings path)``, written if missing."""
    rom = build_test_rom()
    digest = hashlib.sha256(rom + SETTINGS.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"oakemu-test-gameboy-{digest}"
    folder.mkdir(exist_ok=True)
    _write_once(folder / "test.gb", rom)
    _write_once(folder / "emulator.toml", SETTINGS.encode())
    return folder / "test.gb", folder / "emulator.toml"


def make_gameboy_test_env(max_episode_steps: int | None = None, **_: Any) -> gymnasium.Env:
    """The Game Boy test env (what ``gymnasium.make("OakEmuGameBoyTest-v0")`` builds)."""
    rom, settings = test_files()
    return make_emulator_env(
        f"gameboy:{rom}",
        max_episode_steps=max_episode_steps,
        settings_file=str(settings),
        seed=None,
    )


test_files.__test__ = False  # type: ignore[attr-defined]  # not a pytest test

if "OakEmuGameBoyTest-v0" not in gymnasium.registry:
    gymnasium.register("OakEmuGameBoyTest-v0", entry_point=make_gameboy_test_env)
