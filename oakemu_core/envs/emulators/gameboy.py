"""Game Boy / Game Boy Color backend (PyBoy, headless, no sound).

:class:`GameBoyEnv` is the raw Gymnasium env (full RGBA screen, or a ``Dict`` with RAM keys);
:func:`oakemu_core.envs.emulators.make_emulator_env` adds the screen preprocessing and the time limit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import gymnasium
import numpy as np

from oakemu_core.envs.emulators.ram import (
    RamObservationReader,
    RewardHook,
    RewardTracker,
    terminated_by,
)
from oakemu_core.envs.emulators.settings import EmulatorConfigError, GameBoySettings
from oakemu_core.envs.emulators.testrom import NINTENDO_LOGO, header_checksum

__all__ = [
    "SCREEN_HEIGHT",
    "SCREEN_WIDTH",
    "GameBoyEnv",
    "RomHeader",
    "check_gameboy_rom",
    "read_state_files",
]

SCREEN_HEIGHT, SCREEN_WIDTH = 144, 160
_MIN_ROM_SIZE = 0x8000  # the smallest cartridge: 32 KiB
_BOOT_FRAMES_MAX = 1200
_MBC2_TYPES = (0x05, 0x06)  # MBC2 has 512 half-bytes of RAM at 0xA000 without declaring a RAM size


@dataclass(frozen=True)
class RomHeader:
    """What the backend needs from a checked ROM header."""

    path: Path
    title: str
    cartridge_type: int
    has_cartridge_ram: bool
    color: bool


def check_gameboy_rom(path: str | Path) -> RomHeader:
    """Check that ``path`` is a Game Boy / Game Boy Color ROM: size, Nintendo logo, header checksum.

    (The global checksum at 0x14E is not checked: the hardware ignores it and many ROMs get it wrong.)

    Raises:
        EmulatorConfigError: the file is missing, unreadable, too small, or its header is not a Game Boy header.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise EmulatorConfigError(
            f"Game Boy ROM: expected an existing .gb/.gbc file, received {str(path)!r} (not found)"
        )
    try:
        with path.open("rb") as handle:
            header = handle.read(0x150)
        size = path.stat().st_size
    except OSError as error:
        raise EmulatorConfigError(f"Game Boy ROM {str(path)!r}: cannot be read ({error})") from None
    if size < _MIN_ROM_SIZE:
        raise EmulatorConfigError(
            f"Game Boy ROM {str(path)!r}: expected a ROM of at least 32768 bytes, received a file of {size} bytes"
        )
    if header[0x104:0x134] != NINTENDO_LOGO:
        raise EmulatorConfigError(
            f"Game Boy ROM {str(path)!r}: not a Game Boy ROM (the Nintendo logo at 0x104-0x133 is missing)"
        )
    expected = header_checksum(header)
    if header[0x14D] != expected:
        raise EmulatorConfigError(
            f"Game Boy ROM {str(path)!r}: header checksum at 0x14D is 0x{header[0x14D]:02X}, expected 0x{expected:02X} "
            "(corrupt or modified ROM)"
        )
    title = header[0x134:0x143].split(b"\0")[0].decode("ascii", errors="replace").strip()
    cartridge_type = header[0x147]
    return RomHeader(
        path=path,
        title=title,
        cartridge_type=cartridge_type,
        has_cartridge_ram=header[0x149] != 0 or cartridge_type in _MBC2_TYPES,
        color=bool(header[0x143] & 0x80),
    )


def read_state_files(paths: list[str], base: Path, section: str) -> list[bytes]:
    """Read each state file (relative paths against ``base``).

    Raises:
        EmulatorConfigError: a file is missing, unreadable or empty.
    """
    blobs = []
    for index, name in enumerate(paths):
        path = Path(name).expanduser()
        path = path if path.is_absolute() else base / path
        try:
            blob = path.read_bytes()
        except OSError as error:
            raise EmulatorConfigError(
                f"{section}.states[{index}]: expected a readable .state file, received {str(path)!r} ({error.strerror})"
            ) from None
        if not blob:
            raise EmulatorConfigError(
                f"{section}.states[{index}]: state file {str(path)!r} is empty"
            )
        blobs.append(blob)
    return blobs


class GameBoyEnv(gymnasium.Env):
    """One PyBoy emulator as a Gymnasium env (raw screen; wrap with ``ScreenPreprocessing``).

    Observation: ``(144, 160, 4)`` uint8 RGBA screen, or, with ``ram_observation`` entries, a
    ``Dict`` with that screen under ``"screen"`` plus one float32 Box per RAM key.
    Actions: ``Discrete(noop + len(buttons))``; action 0 is the no-op when ``noop_action``, then
    the buttons in settings order.  A button is held for ``press_frames`` frames and released for
    the rest of ``frames_per_action`` frames.
    Reward: the reward spec (:class:`RewardTracker`) after each step.  ``terminated`` when a
    ``terminate`` condition holds; never truncates (the time limit is a wrapper).
    Reset: loads a start state (sampled from ``states`` per episode, or drawn once per env with
    ``state_selection = "per_env"``; without states, the moment the game starts after the boot
    ROM) and runs one frame to draw the screen.

    Raises (at construction):
        EmulatorConfigError: PyBoy cannot load the ROM or a state file.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 60}

    def __init__(
        self,
        rom: RomHeader,
        settings: GameBoySettings,
        *,
        states: list[bytes],
        hook: RewardHook | None = None,
        render_mode: str | None = None,
    ) -> None:
        from pyboy import PyBoy

        self.settings = settings
        self.render_mode = render_mode
        self._pyboy = PyBoy(
            str(rom.path),
            window="null",
            sound_emulated=False,
            log_level="ERROR",
            cgb=settings.cgb,
            no_input=False,
        )
        self._pyboy.set_emulation_speed(0)
        self._memory = self._pyboy.memory
        self._closed = False
        self._run_boot_rom()
        power_on = io.BytesIO()
        self._pyboy.save_state(power_on)
        self._power_on_state = power_on.getvalue()
        self._states = states
        for index, blob in enumerate(states):
            try:
                self._pyboy.load_state(io.BytesIO(blob))
            except Exception as error:  # noqa: BLE001 - PyBoy raises assorted errors for foreign files
                self.close()
                raise EmulatorConfigError(
                    f"gameboy.states[{index}]: PyBoy cannot load this state for ROM {str(rom.path)!r} ({error})"
                ) from None
        self._env_state: bytes | None = None
        self._buttons: list[str | None] = ([None] if settings.noop_action else []) + list(
            settings.buttons
        )
        self._tracker = RewardTracker(settings.reward, hook)
        self._ram = RamObservationReader(settings.ram_observation)
        self.reward_terms: dict[str, float] = {}
        """Each reward term's share of the last step's reward (for debugging a reward spec)."""
        self.action_space = gymnasium.spaces.Discrete(len(self._buttons))
        screen = gymnasium.spaces.Box(
            0, 255, shape=(SCREEN_HEIGHT, SCREEN_WIDTH, 4), dtype=np.uint8
        )
        if settings.ram_observation:
            self.observation_space = gymnasium.spaces.Dict({"screen": screen, **self._ram.spaces()})
        else:
            self.observation_space = screen

    def _run_boot_rom(self) -> None:
        """Run the built-in boot ROM until the cartridge's entry point (0x100) executes (at most 20 s of frames)."""
        entered: list[bool] = []
        self._pyboy.hook_register(0, 0x100, lambda _context: entered.append(True), None)
        try:
            for _ in range(_BOOT_FRAMES_MAX):
                if entered:
                    break
                self._pyboy.tick(1, False)
        finally:
            self._pyboy.hook_deregister(0, 0x100)

    @property
    def buttons(self) -> list[str | None]:
        """Button of each action (``None`` for the no-op)."""
        return list(self._buttons)

    def read_byte(self, address: int) -> int:
        """The byte at ``address`` (0..0xFFFF) of the emulated memory."""
        return int(self._memory[address])

    def save_state(self) -> bytes:
        """The emulator's current state (write it to a ``.state`` file to start episodes from here)."""
        buffer = io.BytesIO()
        self._pyboy.save_state(buffer)
        return buffer.getvalue()

    def _observation(self) -> Any:
        screen = np.array(self._pyboy.screen.ndarray, dtype=np.uint8, copy=True)
        if not self.settings.ram_observation:
            return screen
        return {"screen": screen, **self._ram.read(self.read_byte)}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if not self._states:
            blob = self._power_on_state
        elif self.settings.state_selection == "per_env":
            if self._env_state is None:
                self._env_state = self._states[int(self.np_random.integers(len(self._states)))]
            blob = self._env_state
        else:
            blob = self._states[int(self.np_random.integers(len(self._states)))]
        self._pyboy.load_state(io.BytesIO(blob))
        self._pyboy.tick(1, True)
        self._tracker.reset(self.read_byte)
        self.reward_terms = {}
        return self._observation(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        button = self._buttons[int(action)]
        pyboy, settings = self._pyboy, self.settings
        if button is None:
            pyboy.tick(settings.frames_per_action, True)
        else:
            pyboy.button_press(button)
            pyboy.tick(settings.press_frames, False)
            pyboy.button_release(button)
            pyboy.tick(settings.frames_per_action - settings.press_frames, True)
        reward, self.reward_terms = self._tracker.step(self.read_byte)
        terminated = bool(settings.terminate) and terminated_by(self.read_byte, settings.terminate)
        return self._observation(), reward, terminated, False, {}

    def render(self) -> np.ndarray | None:
        """``(144, 160, 3)`` uint8 RGB of the current screen when ``render_mode == "rgb_array"``."""
        if self.render_mode != "rgb_array":
            return None
        return np.array(self._pyboy.screen.ndarray[:, :, :3], copy=True)

    def close(self) -> None:
        """Stop the emulator without writing ``.ram`` files next to the ROM; idempotent."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._pyboy.stop(save=False)
