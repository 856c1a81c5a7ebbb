"""The emulator settings file (TOML): one pydantic model per section.

One file serves both backends; the env id picks the section (``gameboy:...`` reads ``[gameboy]``,
``retro:...`` reads ``[retro]``) and both read ``[screen]``.  Integers may be written in hex
(TOML ``0xD35E``).  Paths inside the file (state files) are relative to the file's folder.

A mistake in the file raises :class:`EmulatorConfigError` naming the file, the setting, what was
expected and what was received.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from oakemu_core.errors import UserError

__all__ = [
    "GAMEBOY_BUTTONS",
    "EmulatorConfigError",
    "EmulatorProcessError",
    "EmulatorSettings",
    "GameBoySettings",
    "RamObservation",
    "RamValue",
    "RetroSettings",
    "RewardTerm",
    "ScreenSettings",
    "TerminateWhen",
    "load_emulator_settings",
]

GAMEBOY_BUTTONS = ("a", "b", "start", "select", "up", "down", "left", "right")
ReadKind = Literal["u8", "u16le", "u16be", "bcd"]
_HOOK_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_KEY_PATTERN = re.compile(r"^[A-Za-z_]\w*$")


class EmulatorConfigError(UserError, ValueError):
    """An emulator env id or settings file is unusable (message names what, expected, received)."""


class EmulatorProcessError(EmulatorConfigError):
    """A second stable-retro emulator was requested in a process that already runs one (or would)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScreenSettings(_Strict):
    """``[screen]``: the image observation, as for Atari (grayscale, downsampled, stacked).

    ``height``/``width`` default per backend: 72x80 (half the Game Boy's 144x160) and 84x84 for
    stable-retro.  The observation is ``(frame_stack, height, width)`` uint8 when grayscale,
    ``(frame_stack, height, width, 3)`` uint8 otherwise.
    """

    grayscale: bool = True
    height: int | None = Field(None, ge=8, le=1024)
    width: int | None = Field(None, ge=8, le=1024)
    frame_stack: int = Field(4, ge=1, le=32)


class RamValue(_Strict):
    """A value read from emulator memory: one address or several (summed or tupled, see users).

    ``read``: ``u8`` one byte; ``u16le``/``u16be`` two bytes little/big endian; ``bcd`` ``size``
    bytes of packed binary-coded decimal, most significant byte first (e.g. Pokemon's money).
    """

    address: int | None = None
    addresses: list[int] | None = None
    read: ReadKind = "u8"
    size: int = Field(1, ge=1, le=4, description="bytes per value for bcd (u8: 1, u16*: 2)")

    @model_validator(mode="after")
    def _one_address_form(self) -> RamValue:
        if (self.address is None) == (self.addresses is None):
            raise ValueError("expected exactly one of 'address' or 'addresses'")
        if self.addresses is not None and not self.addresses:
            raise ValueError("addresses: expected at least one address, received []")
        if self.read != "bcd" and self.size != 1:
            raise ValueError(
                f"size: only used with read = 'bcd', received size = {self.size} with read = {self.read!r}"
            )
        return self

    @property
    def address_list(self) -> list[int]:
        """The addresses in order (a single ``address`` as a one-element list)."""
        return [self.address] if self.address is not None else list(self.addresses or [])

    @property
    def byte_count(self) -> int:
        """Bytes read per address."""
        return {"u8": 1, "u16le": 2, "u16be": 2, "bcd": self.size}[self.read]

    @property
    def max_value(self) -> int:
        """Largest value one address can yield (255, 65535, 10**(2*size) - 1)."""
        return {"u8": 0xFF, "u16le": 0xFFFF, "u16be": 0xFFFF, "bcd": 10 ** (2 * self.size) - 1}[
            self.read
        ]


class RewardTerm(RamValue):
    """``[[gameboy.reward]]``: one term of the reward, read from RAM after every agent step.

    Kinds:
        ``delta``: ``weight * increase`` of the value (the sum over ``addresses``, e.g. the party's
            levels); decreases give 0 unless ``signed = true``.
        ``new_value``: ``weight`` for each value not seen before in the episode; with several
            ``addresses`` the value is the tuple (e.g. ``(map, x, y)``: +weight per new tile).
    """

    name: str = Field(min_length=1)
    kind: Literal["delta", "new_value"]
    weight: float = 1.0
    signed: bool = False


class RamObservation(RamValue):
    """``[[gameboy.ram_observation]]``: a RAM-derived observation key (float32 Box, one entry per address).

    With ``normalize`` (default) each value is divided by its largest possible value, so entries
    are in [0, 1].
    """

    key: str
    normalize: bool = True

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        if not _KEY_PATTERN.match(value) or value == "screen":
            raise ValueError(f"expected an identifier other than 'screen', received {value!r}")
        return value


class TerminateWhen(RamValue):
    """``[[gameboy.terminate]]``: the episode terminates (no bootstrap) when the value equals ``equals``."""

    equals: int


class GameBoySettings(_Strict):
    """``[gameboy]``: PyBoy backend for ``gameboy:<ROM path>`` ids.

    Each agent step presses one button for ``press_frames`` frames, releases it and runs to
    ``frames_per_action`` frames (the release must be seen by the game, so
    ``press_frames < frames_per_action``).  Action 0 is the no-op when ``noop_action`` is on,
    then ``buttons`` in order.
    """

    frames_per_action: int = Field(24, ge=1, le=600)
    press_frames: int = Field(8, ge=1)
    buttons: list[Literal["a", "b", "start", "select", "up", "down", "left", "right"]] = Field(
        default_factory=lambda: list(GAMEBOY_BUTTONS), min_length=1
    )
    noop_action: bool = True
    states: list[str] = Field(default_factory=list, description=".state files (PyBoy save_state)")
    state_selection: Literal["per_episode", "per_env"] = "per_episode"
    reward: list[RewardTerm] = Field(default_factory=list)
    reward_hook: str | None = None
    ram_observation: list[RamObservation] = Field(default_factory=list)
    terminate: list[TerminateWhen] = Field(default_factory=list)
    max_episode_steps: int | None = Field(10_000, ge=1)
    cgb: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> GameBoySettings:
        if self.press_frames >= self.frames_per_action:
            raise ValueError(
                f"press_frames: expected < frames_per_action ({self.frames_per_action}) so the game sees the "
                f"release, received {self.press_frames}"
            )
        if len(set(self.buttons)) != len(self.buttons):
            raise ValueError(f"buttons: expected each button once, received {self.buttons}")
        if self.reward_hook is not None and not _HOOK_PATTERN.match(self.reward_hook):
            raise ValueError(
                f"reward_hook: expected 'module:function', received {self.reward_hook!r}"
            )
        names = [term.name for term in self.reward]
        if len(set(names)) != len(names):
            raise ValueError(f"reward: expected distinct names, received {names}")
        keys = [entry.key for entry in self.ram_observation]
        if len(set(keys)) != len(keys):
            raise ValueError(f"ram_observation: expected distinct keys, received {keys}")
        if not self.reward and self.reward_hook is None:
            raise ValueError(
                "reward: expected at least one [[gameboy.reward]] term or a reward_hook (a Game Boy game has no "
                "built-in score: every reward would be 0)"
            )
        return self


class RetroSettings(_Strict):
    """``[retro]``: stable-retro backend for ``retro:<Game-Id>`` ids.

    ``action_mode = "multibinary"`` uses the game's filtered button space (MultiBinary, one bit per
    button); ``"discrete"`` offers one action per entry of ``combos`` (each a list of button names,
    ``[]`` is the no-op).  Each agent step repeats the action for ``frames_per_action`` frames and sums
    the rewards; with ``sticky_action_probability`` p the previous action is kept for a frame with
    probability p (as ALE's sticky actions).  ``states`` are stable-retro state names (e.g.
    ``"Level1"``) or ``.state`` files; empty means the game's default state.
    """

    action_mode: Literal["multibinary", "discrete"] = "multibinary"
    combos: list[list[str]] = Field(default_factory=list)
    frames_per_action: int = Field(4, ge=1, le=600)
    sticky_action_probability: float = Field(0.0, ge=0.0, le=1.0)
    states: list[str] = Field(default_factory=list)
    state_selection: Literal["per_episode", "per_env"] = "per_episode"
    scenario: str | None = None
    max_episode_steps: int | None = Field(27_000, ge=1)

    @model_validator(mode="after")
    def _check(self) -> RetroSettings:
        if self.action_mode == "discrete" and not self.combos:
            raise ValueError(
                "combos: expected at least one button combo with action_mode = 'discrete', received []"
            )
        if self.action_mode == "multibinary" and self.combos:
            raise ValueError("combos: only used with action_mode = 'discrete'")
        return self


class EmulatorSettings(_Strict):
    """The whole settings file: ``[screen]``, ``[gameboy]``, ``[retro]`` (sections optional)."""

    screen: ScreenSettings = Field(default_factory=ScreenSettings)
    gameboy: GameBoySettings | None = None
    retro: RetroSettings = Field(default_factory=RetroSettings)


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ""
        for part in item["loc"]:
            where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
        where = where or "(file)"
        message = item["msg"].removeprefix("Value error, ")
        received = item.get("input")
        if item["type"] == "missing":
            lines.append(f"{where}: required setting is missing")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown setting (a typo?)")
        elif isinstance(received, dict):
            lines.append(f"{where}: {message}")
        else:
            lines.append(f"{where}: {message} (received {received!r})")
    return "; ".join(lines)


def load_emulator_settings(settings_file: str | Path | None) -> tuple[EmulatorSettings, Path]:
    """Read and validate the settings file; returns the settings and the folder paths are relative to.

    ``None`` gives the defaults (no ``[gameboy]`` section) and the current folder.

    Raises:
        EmulatorConfigError: missing or unreadable file, TOML syntax error, invalid settings.
    """
    if settings_file is None:
        return EmulatorSettings(), Path.cwd()
    path = Path(settings_file)
    if not path.is_file():
        raise EmulatorConfigError(
            f"emulator settings file: expected an existing TOML file, received {str(path)!r}"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise EmulatorConfigError(
            f"emulator settings file {str(path)!r}: not valid TOML ({error})"
        ) from None
    try:
        settings = EmulatorSettings.model_validate(data)
    except ValidationError as error:
        raise EmulatorConfigError(
            f"emulator settings file {str(path)!r}: {_format_validation_error(error)}"
        ) from None
    return settings, path.resolve().parent
