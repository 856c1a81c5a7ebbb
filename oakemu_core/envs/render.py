"""Frames of evaluation episodes as a person sees them: the game's full-colour screen, not the
policy's preprocessed observation. Only :func:`oakemu_core.envs.make_eval_env` with a
``frame_sink`` builds this path; training envs never render.

* Gymnasium and emulator ids: the raw env is made with ``render_mode="rgb_array"`` and wrapped
  (outside its time limit, inside the space adapter) by :func:`rendered_episodes`, which hands
  ``env.render()`` after the reset and after every step to the sink: Gymnasium's own frames
  (CartPole 400 x 600), the Game Boy screen (144 x 160), a stable-retro console's screen.
* Atari ids: ale-py's vector env renders nothing, so :class:`RecordingAtariBackend` steps a second
  one-env vector env of the same game, settings and seed in lockstep with the same actions and
  colour frames at the emulator's resolution (210 x 160, max-pooled over the last two frames as
  the observation is). Both emulators draw their sticky actions and no-op resets from the same
  seed, so they play the same game; the policy still acts on the usual observation, and the
  returns are those of the evaluation without video.

Rendering never changes what the policy sees or the episode's returns.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import gymnasium
import numpy as np

from oakemu_core.envs.atari import ATARI_FRAME_SKIP, AtariBackend

if TYPE_CHECKING:
    from oakemu_core.envs.options import EnvOptions

__all__ = ["ALE_FPS", "FrameSink", "RecordingAtariBackend", "rendered_episodes"]

ALE_FPS = 60.0
"""Frames per second of the Atari 2600 (NTSC)."""
DEFAULT_FPS = 30.0
"""Video frame rate of an env whose metadata names no ``render_fps``."""


class FrameSink(Protocol):
    """Receives the frames of the episodes of env 0 (see :class:`oakemu_core.run.video.EpisodeVideos`).

    Calls, per episode: :meth:`begin` (after the reset), then :meth:`add` for the first frame and
    for the frame after every step, then :meth:`end` after the step that ends it. Once
    :meth:`begin` has returned False, or :meth:`fail` was called, the sink is asked nothing more.
    """

    def begin(self, fps: float) -> bool:
        """A new episode starts, shown at ``fps`` frames per second (one frame per agent step);
        return whether to record it."""

    def add(self, frame: np.ndarray) -> None:
        """One ``(H, W, 3)`` uint8 RGB frame of the recorded episode."""

    def end(self) -> None:
        """The recorded episode ended (terminated or truncated)."""

    def fail(self, reason: str) -> None:
        """The env cannot render (``reason`` says why); no frame follows."""


def _checked_frame(frame: Any) -> str:
    """Why ``frame`` is not an ``(H, W, 3)`` uint8 array, or the empty string."""
    if not isinstance(frame, np.ndarray):
        return f"render() returned {type(frame).__name__}, expected an (H, W, 3) uint8 array"
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        return f"render() returned an array of shape {frame.shape} and dtype {frame.dtype}, expected (H, W, 3) uint8"
    return ""


class _RenderedEpisodes(gymnasium.Wrapper):
    """See :func:`rendered_episodes`."""

    def __init__(self, env: Any, sink: FrameSink, env_id: str) -> None:
        super().__init__(env)
        self._sink, self._env_id = sink, env_id
        self._fps = float(env.metadata.get("render_fps") or DEFAULT_FPS)
        self._recording = False
        self._finished = False  # the sink declined an episode or failed: it is asked nothing more

    def reset(self, **kwargs: Any) -> Any:
        result = self.env.reset(**kwargs)
        if self._recording:  # reset in the middle of an episode: it ends here
            self._sink.end()
        self._recording = not self._finished and self._sink.begin(self._fps)
        self._finished = not self._recording
        self._capture()
        return result

    def step(self, action: Any) -> Any:
        result = self.env.step(action)
        self._capture()
        if self._recording and (result[2] or result[3]):
            self._recording = False
            self._sink.end()
        return result

    def _capture(self) -> None:
        if not self._recording:
            return
        try:
            frame = self.env.render()
            problem = _checked_frame(frame)
        except Exception as error:  # noqa: BLE001 - e.g. pygame missing for classic control
            problem = f"render() raised {type(error).__name__}: {error}"
        if problem:
            self._recording, self._finished = False, True
            self._sink.fail(f"{self._env_id!r} cannot be recorded: {problem}")
            return
        self._sink.add(frame)


def rendered_episodes(env: Any, sink: FrameSink, env_id: str) -> Any:
    """``env`` (made with ``render_mode="rgb_array"``) wrapped so that its episodes' frames reach ``sink``.

    The frame rate is the env's ``metadata["render_fps"]`` (emulator envs set it to 60 / frames per
    action), else :data:`DEFAULT_FPS`. A ``render()`` that raises or returns anything but an
    ``(H, W, 3)`` uint8 array calls ``sink.fail`` once; the episode goes on unrecorded.
    """
    # rgb_array frames need no display: pygame (classic control) draws off screen instead of probing
    # for a window system (which prints errors on a headless machine).
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    return _RenderedEpisodes(env, sink, env_id)


class RecordingAtariBackend:
    """A one-env :class:`~oakemu_core.envs.atari.AtariBackend` plus a colour twin stepped in lockstep
    (module docstring); implements :class:`oakemu_core.envs.vector.Backend` with ``send``/``recv``.

    Frames are ``(210, 160, 3)`` uint8 at ``60 / frame skip`` = 15 frames per second. The twin is
    closed once the sink declines an episode, so later episodes cost what they cost without video.
    Should the twin ever disagree with the env about an episode's end, the sink is failed and the
    twin closed.
    """

    def __init__(
        self,
        env_id: str,
        *,
        max_episode_steps: int | None,
        sink: FrameSink,
        options: EnvOptions | None = None,
    ) -> None:
        self._env = AtariBackend(
            env_id, 1, max_episode_steps=max_episode_steps, num_threads=1, options=options
        )
        self.spec = self._env.spec
        self.num_envs = 1
        self._sink = sink
        self._screen: AtariBackend | None = None
        try:
            self._screen = AtariBackend(
                env_id,
                1,
                max_episode_steps=max_episode_steps,
                num_threads=1,
                options=options,
                screen=True,
            )
        except BaseException:
            self._env.close()
            raise
        self._recording = False

    def reset(self, seed: int | None) -> tuple[np.ndarray, None]:
        observations, masks = self._env.reset(seed)
        if self._screen is not None:
            frames, _ = self._screen.reset(seed)
            self._begin(frames)
        return observations, masks

    def send(self, actions: np.ndarray) -> None:
        self._env.send(actions)
        if self._screen is not None:
            self._screen.send(actions)

    @property
    def games_ended(self) -> np.ndarray:
        """``(1,)`` bool: the env's game ended on the last step (a video is one game, not one life)."""
        return self._env.games_ended

    def forced_actions(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The env's :meth:`~oakemu_core.envs.atari.AtariBackend.forced_actions` (the twin forces the same)."""
        return self._env.forced_actions()

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        result = self._env.recv()
        if self._screen is not None:
            frames, _, _, _, final_frames, _ = self._screen.recv()
            done = bool(self._env.games_ended[0])
            if done != bool(self._screen.games_ended[0]):
                self._close_screen()
                self._sink.fail("the colour twin of the Atari env went out of step; video stopped")
            elif self._recording:
                self._sink.add(final_frames[0, -1])
                if done:
                    self._sink.end()
                    self._begin(frames)
        return result

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, None]:
        self.send(actions)
        return self.recv()

    def _begin(self, frames: np.ndarray) -> None:
        self._recording = self._sink.begin(ALE_FPS / ATARI_FRAME_SKIP)
        if self._recording:
            self._sink.add(frames[0, -1])
        else:
            self._close_screen()

    def _close_screen(self) -> None:
        screen, self._screen, self._recording = self._screen, None, False
        if screen is not None:
            screen.close()

    def close(self) -> None:
        self._close_screen()
        self._env.close()
