"""Emulator backends as plain Gymnasium envs: Game Boy (PyBoy) and stable-retro consoles.

Env ids owned here:

* ``gameboy:<path to .gb/.gbc ROM>`` (the user's own ROM; a reward spec in the settings file is required),
* ``retro:<Game-Id>`` (e.g. ``retro:Airstriker-Genesis-v0``; the ROM must be imported into stable-retro).

The settings (frames per action, start states, reward spec, RAM observation keys, screen size,
frame stack, retro action mode) come from one TOML file, see :mod:`oakemu_core.envs.emulators.settings`
and ``docs/emulators.md``.

Entry points for the env factory and config validation:

* :func:`make_emulator_env` returns ``None`` for ids it does not own, else a ready env,
* :func:`validate_emulator_env` checks an id and settings file without starting an emulator loop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oakemu_core.envs.emulators.settings import (
    EmulatorConfigError,
    EmulatorProcessError,
    EmulatorSettings,
    load_emulator_settings,
)

__all__ = [
    "GAMEBOY_PREFIX",
    "RETRO_PREFIX",
    "EmulatorConfigError",
    "EmulatorProcessError",
    "is_emulator_env",
    "make_emulator_env",
    "validate_emulator_env",
]

GAMEBOY_PREFIX = "gameboy:"
RETRO_PREFIX = "retro:"
_GAMEBOY_SCREEN = (72, 80)
_RETRO_SCREEN = (84, 84)


def is_emulator_env(env_id: str) -> bool:
    """True for ``gameboy:...`` and ``retro:...`` ids (cheap: no import of an emulator)."""
    return env_id.startswith((GAMEBOY_PREFIX, RETRO_PREFIX))


@dataclass
class _Resolved:
    backend: str
    target: str  # ROM path or retro game id
    settings: EmulatorSettings
    base: Path
    rom: Any = None
    states: list[bytes] | None = None
    hook: Any = None


def _require_pyboy() -> None:
    try:
        with (
            warnings.catch_warnings()
        ):  # pysdl2-dll's "Using SDL2 binaries" notice at import: not the user's concern
            warnings.simplefilter("ignore", UserWarning)
            import pyboy  # noqa: F401
    except ImportError:
        raise EmulatorConfigError(
            "gameboy: ids need PyBoy; install the emulator extra: pip install 'oakemu-rl[emulators]'"
        ) from None


def _resolve(
    env_id: str, settings_file: str | Path | None, envs_per_process: int | None
) -> _Resolved:
    backend = "gameboy" if env_id.startswith(GAMEBOY_PREFIX) else "retro"
    target = env_id.split(":", 1)[1].strip()
    if not target:
        example = "gameboy:roms/game.gb" if backend == "gameboy" else "retro:Airstriker-Genesis-v0"
        raise EmulatorConfigError(f"env_id: expected e.g. {example!r}, received {env_id!r}")
    settings, base = load_emulator_settings(settings_file)
    resolved = _Resolved(backend=backend, target=target, settings=settings, base=base)
    if backend == "gameboy":
        from oakemu_core.envs.emulators.gameboy import check_gameboy_rom, read_state_files
        from oakemu_core.envs.emulators.ram import check_gameboy_addresses, load_reward_hook

        _require_pyboy()
        resolved.rom = check_gameboy_rom(target)
        if settings.gameboy is None:
            raise EmulatorConfigError(
                f"env_id {env_id!r}: gameboy ids need an emulator settings file with a [gameboy] section and a "
                f"reward spec ([[gameboy.reward]] terms or gameboy.reward_hook); received "
                f"{'no settings file' if settings_file is None else repr(str(settings_file)) + ' without [gameboy]'}"
            )
        try:
            check_gameboy_addresses(
                settings.gameboy, has_cartridge_ram=resolved.rom.has_cartridge_ram
            )
        except EmulatorConfigError as error:
            raise EmulatorConfigError(
                f"emulator settings file {str(settings_file)!r}: {error}"
            ) from None
        if settings.gameboy.reward_hook is not None:
            resolved.hook = load_reward_hook(settings.gameboy.reward_hook)
        resolved.states = read_state_files(settings.gameboy.states, base, "gameboy")
    else:
        from oakemu_core.envs.emulators.retro_backend import check_retro_game

        if envs_per_process is not None and envs_per_process > 1:
            raise EmulatorProcessError(
                f"env_id {env_id!r}: stable-retro runs one emulator per process; expected envs_per_actor = 1 "
                f"(add actors for more envs), received {envs_per_process}"
            )
        resolved.states = check_retro_game(target, settings.retro, base)
    return resolved


def validate_emulator_env(
    env_id: str, settings_file: str | Path | None, *, envs_per_process: int | None = None
) -> None:
    """Check an emulator env id and its settings before any process starts (no-op for other ids).

    Checks: the settings file (TOML, every field); Game Boy: the ROM exists and is a Game Boy ROM
    (size, Nintendo logo, header checksum), every reward / RAM-observation / terminate address is
    readable game state, the reward hook imports, state files are readable; stable-retro: the game
    exists, its ROM is imported, states / button combos / scenario exist, and ``envs_per_process``
    (envs per actor process, when given) is 1.

    Raises:
        EmulatorConfigError: one readable message naming the setting, the expected and received value
            (:class:`EmulatorProcessError` for more than one stable-retro env per process).
    """
    if is_emulator_env(env_id):
        _resolve(env_id, settings_file, envs_per_process)


def make_emulator_env(
    env_id: str,
    *,
    max_episode_steps: int | None,
    settings_file: str | Path | None,
    seed: int | None,
    render_mode: str | None = None,
) -> Any:
    """Build a ready Gymnasium env for an emulator id, or return ``None`` for any other id.

    The env: observation ``(frame_stack, H, W)`` uint8 (grayscale; ``(frame_stack, H, W, 3)`` with
    ``screen.grayscale = false``; H x W defaults to 72x80 for the Game Boy, 84x84 for stable-retro),
    or, when ``[[gameboy.ram_observation]]`` keys are set, a ``gymnasium.spaces.Dict`` with that
    image under ``"screen"`` and one float32 Box per RAM key.  Actions: Game Boy ``Discrete(1 +
    buttons)`` (0 = no-op); stable-retro ``MultiBinary(buttons)`` or ``Discrete(len(combos))``.
    Rewards: Game Boy from the RAM reward spec; stable-retro the game's score increase (their sum
    is the raw episodic return, unclipped).  Truncation by ``gymnasium.wrappers.TimeLimit`` after
    ``max_episode_steps`` agent steps (argument, else the settings file's ``max_episode_steps``).

    Args:
        env_id: ``gameboy:<ROM path>`` or ``retro:<Game-Id>``; anything else returns ``None``.
        max_episode_steps: time limit in agent steps; ``None`` uses the settings file's value.
        settings_file: the emulator settings TOML (required for ``gameboy:`` ids: the reward spec).
        seed: seeds the env's random stream at construction (state sampling, sticky actions);
            ``reset(seed=...)`` reseeds as usual.
        render_mode: ``"rgb_array"`` to let ``env.render()`` return the full-size screen (the
            env's ``metadata["render_fps"]`` is then 60 / frames per action).

    Raises:
        EmulatorConfigError: as :func:`validate_emulator_env`.
        EmulatorProcessError: a second stable-retro env in this process.
    """
    if not is_emulator_env(env_id):
        return None
    import gymnasium
    from gymnasium.utils import seeding

    from oakemu_core.envs.emulators.preprocessing import ScreenPreprocessing

    if max_episode_steps is not None and max_episode_steps < 1:
        raise EmulatorConfigError(
            f"max_episode_steps: expected >= 1 or None, received {max_episode_steps}"
        )
    resolved = _resolve(env_id, settings_file, None)
    env, default_size, default_limit = _console_env(resolved, render_mode)
    if seed is not None:
        env.np_random, _ = seeding.np_random(seed)
        env.action_space.seed(seed)
    screen = resolved.settings.screen
    env = ScreenPreprocessing(
        env,
        height=screen.height or default_size[0],
        width=screen.width or default_size[1],
        grayscale=screen.grayscale,
        frame_stack=screen.frame_stack,
    )
    limit = max_episode_steps if max_episode_steps is not None else default_limit
    if limit is not None:
        env = gymnasium.wrappers.TimeLimit(env, max_episode_steps=limit)
    return env


def _console_env(
    resolved: _Resolved, render_mode: str | None
) -> tuple[Any, tuple[int, int], int | None]:
    """The console's own env of a resolved id (before screen preprocessing and time limit), with its
    default screen size ``(H, W)`` and its settings' ``max_episode_steps``. With a ``render_mode``,
    one rendered frame per agent step: ``metadata["render_fps"]`` is 60 / frames per action (both
    consoles run at 60 frames/s)."""
    settings = resolved.settings
    env: Any
    if resolved.backend == "gameboy":
        from oakemu_core.envs.emulators.gameboy import GameBoyEnv

        assert settings.gameboy is not None  # checked by _resolve
        env = GameBoyEnv(
            resolved.rom,
            settings.gameboy,
            states=resolved.states or [],
            hook=resolved.hook,
            render_mode=render_mode,
        )
        default_size, default_limit = _GAMEBOY_SCREEN, settings.gameboy.max_episode_steps
        frames_per_action = settings.gameboy.frames_per_action
    else:
        from oakemu_core.envs.emulators.retro_backend import RetroGameEnv

        env = RetroGameEnv(
            resolved.target, settings.retro, states=resolved.states, render_mode=render_mode
        )
        default_size, default_limit = _RETRO_SCREEN, settings.retro.max_episode_steps
        frames_per_action = settings.retro.frames_per_action
    if render_mode is not None:
        env.metadata = {**env.metadata, "render_fps": 60 / frames_per_action}
    return env, default_size, default_limit
