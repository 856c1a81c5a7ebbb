"""stable-retro backend (Genesis, NES, SNES, ... games whose ROM the user imported).

stable-retro allows ONE emulator per process.  :class:`RetroGameEnv` counts its open instances and
refuses a second one with :class:`EmulatorProcessError` (before stable-retro's own ``RuntimeError``):
run one env per actor process (``envs_per_actor = 1``) or put each env in a process of its own
(``gymnasium.vector.AsyncVectorEnv`` over :func:`oakemu_core.envs.emulators.make_emulator_env`).
"""

from __future__ import annotations

import gzip
import weakref
from pathlib import Path
from typing import Any, ClassVar

import gymnasium
import numpy as np

from oakemu_core.envs.emulators.settings import (
    EmulatorConfigError,
    EmulatorProcessError,
    RetroSettings,
)

__all__ = [
    "EmulatorProcessError",
    "RetroGameEnv",
    "check_retro_game",
    "import_retro",
    "open_retro_envs",
]

_OPEN: weakref.WeakSet[RetroGameEnv] = weakref.WeakSet()


def import_retro() -> Any:
    """The ``stable_retro`` module (the older ``retro`` name as a fallback).

    Raises:
        EmulatorConfigError: stable-retro is not installed.
    """
    try:
        import stable_retro

        return stable_retro
    except ImportError:
        pass
    try:
        import retro  # type: ignore[import-not-found]

        return retro
    except ImportError:
        raise EmulatorConfigError(
            "retro: ids need stable-retro; install the emulator extra: pip install 'oakemu-rl[emulators]'"
        ) from None


def open_retro_envs() -> int:
    """Number of :class:`RetroGameEnv` instances open in this process (0 or 1)."""
    return sum(1 for env in _OPEN if not env.closed)


def _system_buttons(retro: Any, game: str) -> list[str]:
    rom = retro.data.get_romfile_path(game)
    system = retro.get_romfile_system(rom)
    return [button for button in retro.get_system_info(system)["buttons"] if button is not None]


def check_retro_game(game: str, settings: RetroSettings, base: Path) -> list[bytes] | None:
    """Check the game, its imported ROM, the states, combos and scenario; return the state pool.

    Returns:
        The bytes of each start state (``None``: the game's default state).

    Raises:
        EmulatorConfigError: unknown game, ROM not imported, unknown state / button / scenario.
    """
    retro = import_retro()
    games = retro.data.list_games()
    if game not in games:
        close = [name for name in games if game.split("-")[0].lower() in name.lower()][:5]
        hint = f"; similar: {close}" if close else ""
        raise EmulatorConfigError(
            f"retro: expected a stable-retro game id (e.g. 'Airstriker-Genesis-v0'), received {game!r}{hint}"
        )
    try:
        retro.data.get_romfile_path(game)
    except FileNotFoundError:
        raise EmulatorConfigError(
            f"retro:{game}: the game's ROM is not imported; import your ROM with `python -m stable_retro.import "
            "<folder with the ROM>` (stable-retro ships only Airstriker-Genesis-v0's ROM)"
        ) from None
    buttons = _system_buttons(retro, game)
    for index, combo in enumerate(settings.combos):
        unknown = [name for name in combo if name not in buttons]
        if unknown:
            raise EmulatorConfigError(
                f"retro.combos[{index}]: unknown button(s) {unknown} for {game}; expected names from {buttons}"
            )
    if settings.scenario is not None and not Path(settings.scenario).is_file():
        scenarios = retro.data.list_scenarios(game)
        if settings.scenario not in scenarios:
            raise EmulatorConfigError(
                f"retro.scenario: expected a scenario of {game} {scenarios} or a .json file, "
                f"received {settings.scenario!r}"
            )
    if not settings.states:
        return None
    known = retro.data.list_states(game)
    blobs = []
    for index, name in enumerate(settings.states):
        candidate = Path(name).expanduser()
        candidate = candidate if candidate.is_absolute() else base / candidate
        if name.endswith(".state") and candidate.is_file():
            path = candidate
        elif name.removesuffix(".state") in known:
            path = Path(retro.data.get_file_path(game, name.removesuffix(".state") + ".state"))
        else:
            raise EmulatorConfigError(
                f"retro.states[{index}]: expected a state of {game} {known} or a .state file, received {name!r}"
            )
        raw = path.read_bytes()
        blobs.append(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return blobs


class RetroGameEnv(gymnasium.Env):
    """One stable-retro emulator with frame skip, sticky actions and a discrete combo option.

    Observation: the game's RGB screen ``(H, W, 3)`` uint8 (Genesis: 224x320).
    Actions: ``MultiBinary(len(buttons))`` (``action_mode = "multibinary"``) or ``Discrete(len(combos))``.
    Reward: the game's scenario reward (e.g. the score increase) summed over the repeated frames;
    the sum over an episode is the raw game score.  ``terminated`` when the scenario says done.
    ``info``: the game's variables after the last frame (e.g. ``score``, ``lives``).

    Raises (at construction):
        EmulatorProcessError: this process already runs a stable-retro emulator.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 60}

    def __init__(
        self,
        game: str,
        settings: RetroSettings,
        *,
        states: list[bytes] | None,
        render_mode: str | None = None,
    ) -> None:
        self.closed = True
        if open_retro_envs():
            raise EmulatorProcessError(
                f"retro:{game}: stable-retro runs one emulator per process and this process already runs one; "
                "use envs_per_actor = 1 (more actors for more envs) or one process per env"
            )
        retro = import_retro()
        try:
            self._env = retro.make(
                game,
                state=retro.State.DEFAULT,
                scenario=settings.scenario,
                use_restricted_actions=retro.Actions.FILTERED,
                render_mode=None,
            )
        except RuntimeError as error:
            if "multiple emulator" in str(error):
                raise EmulatorProcessError(
                    f"retro:{game}: stable-retro runs one emulator per process and another one is open in this "
                    f"process ({error})"
                ) from None
            raise
        self.closed = False
        _OPEN.add(self)
        self.game = game
        self.settings = settings
        self.render_mode = render_mode
        self._states = states
        self._env_state: bytes | None = None
        self.buttons: list[str] = list(self._env.unwrapped.buttons)
        width = len(self.buttons)
        if settings.action_mode == "discrete":
            combos = np.zeros((len(settings.combos), width), dtype=np.uint8)
            for row, combo in enumerate(settings.combos):
                for name in combo:
                    combos[row, self.buttons.index(name)] = 1
            self._combos: np.ndarray | None = combos
            self.action_space = gymnasium.spaces.Discrete(len(settings.combos))
        else:
            self._combos = None
            self.action_space = gymnasium.spaces.MultiBinary(width)
        self.observation_space = self._env.observation_space
        self._previous = np.zeros(width, dtype=np.uint8)
        self._last_screen: np.ndarray | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if self._states:
            if self.settings.state_selection == "per_env":
                if self._env_state is None:
                    self._env_state = self._states[int(self.np_random.integers(len(self._states)))]
                blob = self._env_state
            else:
                blob = self._states[int(self.np_random.integers(len(self._states)))]
            self._env.unwrapped.initial_state = blob
        observation, _ = self._env.reset()
        self._previous[:] = 0
        self._last_screen = observation
        return observation, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        buttons = (
            self._combos[int(action)]
            if self._combos is not None
            else np.asarray(action, dtype=np.uint8)
        )
        sticky = self.settings.sticky_action_probability
        total = 0.0
        terminated = False
        info: dict[str, Any] = {}
        observation = self._last_screen
        for _ in range(self.settings.frames_per_action):
            if not (sticky > 0.0 and self.np_random.random() < sticky):
                self._previous = buttons
            observation, reward, done, _, info = self._env.step(self._previous)
            total += float(reward)
            if done:
                terminated = True
                break
        self._last_screen = observation
        return observation, total, terminated, False, dict(info)

    def render(self) -> np.ndarray | None:
        """The current RGB screen when ``render_mode == "rgb_array"``."""
        if self.render_mode != "rgb_array" or self._last_screen is None:
            return None
        return np.array(self._last_screen, copy=True)

    def close(self) -> None:
        """Release the emulator (a new one may then be created in this process); idempotent."""
        if not self.closed:
            self.closed = True
            self._env.close()
            _OPEN.discard(self)

    def __del__(self) -> None:
        self.close()
