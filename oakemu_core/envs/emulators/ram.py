"""Rewards, observations and terminations read from emulator RAM (declarative, see settings.py).

Everything here sees memory only through ``read_byte(address) -> int`` (0..255), so it is
independent of the emulator and testable with a plain ``bytearray``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from oakemu_core.envs.emulators.settings import (
    EmulatorConfigError,
    GameBoySettings,
    RamObservation,
    RamValue,
    RewardTerm,
    TerminateWhen,
)

__all__ = [
    "RamObservationReader",
    "RewardHook",
    "RewardTracker",
    "check_gameboy_addresses",
    "load_reward_hook",
    "read_value",
    "terminated_by",
]

ReadByte = Callable[[int], int]
RewardHook = Callable[[ReadByte, dict[str, Any]], float]
"""``hook(read_byte, episode_state) -> float``: extra reward per agent step; ``episode_state`` is a dict
the hook may keep values in, emptied at every reset (the hook is also called once at reset, its
return value ignored, so it can record start values)."""

# Game Boy memory map (Pan Docs): readable regions that hold game state.
_GAMEBOY_REGIONS = (
    (0x8000, 0x9FFF, "video RAM"),
    (0xA000, 0xBFFF, "cartridge RAM"),
    (0xC000, 0xDFFF, "work RAM"),
    (0xE000, 0xFDFF, "echo RAM"),
    (0xFE00, 0xFE9F, "object attribute memory"),
    (0xFF00, 0xFF7F, "I/O registers"),
    (0xFF80, 0xFFFF, "high RAM"),
)


def read_value(read_byte: ReadByte, address: int, spec: RamValue) -> int:
    """One value at ``address`` as ``spec.read`` says (u8, u16 little/big endian, packed BCD)."""
    if spec.read == "u8":
        return read_byte(address)
    if spec.read == "u16le":
        return read_byte(address) | (read_byte(address + 1) << 8)
    if spec.read == "u16be":
        return (read_byte(address) << 8) | read_byte(address + 1)
    value = 0
    for offset in range(spec.size):
        byte = read_byte(address + offset)
        value = value * 100 + (byte >> 4) * 10 + (byte & 0x0F)
    return value


def _describe(address: int) -> str:
    for start, end, name in _GAMEBOY_REGIONS:
        if start <= address <= end:
            return name
    return "ROM" if 0 <= address < 0x8000 else "unusable"


def check_gameboy_addresses(settings: GameBoySettings, *, has_cartridge_ram: bool) -> None:
    """Check every address of the reward spec, RAM observations and terminations against the memory map.

    Valid: 0x8000-0xFFFF except the unusable 0xFEA0-0xFEFF; cartridge RAM (0xA000-0xBFFF) only when
    the ROM header declares some; a multi-byte value must lie inside one region.

    Raises:
        EmulatorConfigError: naming the setting, the address and the valid regions.
    """
    groups: list[tuple[str, Sequence[RamValue]]] = [
        ("reward", settings.reward),
        ("ram_observation", settings.ram_observation),
        ("terminate", settings.terminate),
    ]
    valid = ", ".join(f"0x{start:04X}-0x{end:04X} {name}" for start, end, name in _GAMEBOY_REGIONS)
    for group, entries in groups:
        for index, entry in enumerate(entries):
            for address in entry.address_list:
                last = address + entry.byte_count - 1
                where = f"gameboy.{group}[{index}]"
                region = next(
                    (
                        (start, end, name)
                        for start, end, name in _GAMEBOY_REGIONS
                        if start <= address <= end
                    ),
                    None,
                )
                if region is None or last > region[1]:
                    raise EmulatorConfigError(
                        f"{where}: address 0x{address:04X} ({entry.byte_count} byte(s), {_describe(address)}) is not "
                        f"readable game state; expected an address in {valid}"
                    )
                if region[2] == "cartridge RAM" and not has_cartridge_ram:
                    raise EmulatorConfigError(
                        f"{where}: address 0x{address:04X} is cartridge RAM but the ROM header declares none"
                    )


def load_reward_hook(spec: str) -> RewardHook:
    """Import ``module:function`` and return the callable.

    Raises:
        EmulatorConfigError: module not importable, attribute missing or not callable.
    """
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's hook
        raise EmulatorConfigError(
            f"gameboy.reward_hook: cannot import module {module_name!r} ({error})"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise EmulatorConfigError(
            f"gameboy.reward_hook: expected a callable {function_name!r} in module {module_name!r}, "
            f"received {type(function).__name__}"
        )
    return function  # type: ignore[no-any-return]


class RewardTracker:
    """Per-episode reward from the declarative terms plus the optional hook.

    Call :meth:`reset` after the emulator reached the episode's start state, then :meth:`step`
    after every agent step.
    """

    def __init__(self, terms: Sequence[RewardTerm], hook: RewardHook | None = None) -> None:
        self.terms = list(terms)
        self.hook = hook
        self._last: list[int] = [0] * len(self.terms)
        self._seen: list[set[tuple[int, ...]]] = [set() for _ in self.terms]
        self._hook_state: dict[str, Any] = {}

    @staticmethod
    def _sample(read_byte: ReadByte, term: RewardTerm) -> tuple[int, ...]:
        return tuple(read_value(read_byte, address, term) for address in term.address_list)

    def reset(self, read_byte: ReadByte) -> None:
        """Record start values: no reward for the state the episode starts in."""
        for index, term in enumerate(self.terms):
            sample = self._sample(read_byte, term)
            self._last[index] = sum(sample)
            self._seen[index] = {sample}
        self._hook_state = {}
        if self.hook is not None:
            self.hook(read_byte, self._hook_state)

    def step(self, read_byte: ReadByte) -> tuple[float, dict[str, float]]:
        """Reward of the step just taken and each term's share (``{name: reward}``, hook as ``"hook"``)."""
        parts: dict[str, float] = {}
        for index, term in enumerate(self.terms):
            sample = self._sample(read_byte, term)
            if term.kind == "delta":
                value = sum(sample)
                change = value - self._last[index]
                self._last[index] = value
                parts[term.name] = term.weight * (change if term.signed else max(change, 0))
            else:
                seen = self._seen[index]
                if sample in seen:
                    parts[term.name] = 0.0
                else:
                    seen.add(sample)
                    parts[term.name] = term.weight
        if self.hook is not None:
            parts["hook"] = float(self.hook(read_byte, self._hook_state))
        return float(sum(parts.values())), parts


class RamObservationReader:
    """Builds the RAM observation keys: ``{key: float32 (len(addresses),)}``."""

    def __init__(self, entries: Sequence[RamObservation]) -> None:
        self.entries = list(entries)

    def spaces(self) -> dict[str, Any]:
        """One ``gymnasium.spaces.Box`` per key (bounds [0, 1] when normalized, else [0, max value])."""
        import gymnasium

        return {
            entry.key: gymnasium.spaces.Box(
                low=0.0,
                high=1.0 if entry.normalize else float(entry.max_value),
                shape=(len(entry.address_list),),
                dtype=np.float32,
            )
            for entry in self.entries
        }

    def read(self, read_byte: ReadByte) -> dict[str, np.ndarray]:
        """The current values, float32."""
        observation = {}
        for entry in self.entries:
            values = np.array(
                [read_value(read_byte, a, entry) for a in entry.address_list], dtype=np.float32
            )
            if entry.normalize:
                values /= np.float32(entry.max_value)
            observation[entry.key] = values
        return observation


def terminated_by(read_byte: ReadByte, conditions: Sequence[TerminateWhen]) -> bool:
    """True when any condition holds (the value at one of its addresses equals ``equals``)."""
    return any(
        read_value(read_byte, address, condition) == condition.equals
        for condition in conditions
        for address in condition.address_list
    )
