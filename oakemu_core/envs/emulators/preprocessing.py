"""Screen preprocessing shared by the emulator backends: grayscale, downsample, frame stack.

A small :class:`gymnasium.Wrapper` instead of Gymnasium's ``GrayscaleObservation`` /
``ResizeObservation`` / ``FrameStackObservation`` chain because it must also handle a ``Dict``
observation (stack only the ``"screen"`` key, pass the RAM keys through) and because one OpenCV
call per stage is cheaper than three wrapper layers per step.
"""

from __future__ import annotations

from typing import Any

import cv2
import gymnasium
import numpy as np

__all__ = ["ScreenPreprocessing"]


class ScreenPreprocessing(gymnasium.Wrapper):
    """Turn an RGB screen (``(H, W, 3)`` or ``(H, W, 4)`` uint8) into stacked, downsampled frames.

    The wrapped env's observation is either that screen (a ``Box``) or a ``Dict`` holding it under
    ``"screen"``.  The output replaces the screen with ``(frame_stack, height, width)`` uint8 when
    ``grayscale``, else ``(frame_stack, height, width, 3)`` uint8; oldest frame first.  At reset the
    first frame fills the whole stack.  Every returned array is a fresh copy (safe to keep, e.g. as
    a vector env's final observation).

    Downsampling uses area interpolation (``cv2.INTER_AREA``); grayscale uses ITU-R 601 luma weights.
    """

    def __init__(
        self, env: gymnasium.Env, *, height: int, width: int, grayscale: bool, frame_stack: int
    ) -> None:
        super().__init__(env)
        source = env.observation_space
        self._is_dict = isinstance(source, gymnasium.spaces.Dict)
        screen = source["screen"] if self._is_dict else source
        if not (
            isinstance(screen, gymnasium.spaces.Box)
            and screen.dtype == np.uint8
            and len(screen.shape) == 3
            and screen.shape[2] in (3, 4)
        ):
            raise ValueError(
                f"screen: expected a uint8 Box of shape (H, W, 3 or 4), received {screen}"
            )
        self._size = (int(width), int(height))
        self._grayscale = grayscale
        self._resize = tuple(screen.shape[:2]) != (height, width)
        frame_shape = (height, width) if grayscale else (height, width, 3)
        self._frames = np.zeros((frame_stack, *frame_shape), dtype=np.uint8)
        stacked = gymnasium.spaces.Box(0, 255, shape=self._frames.shape, dtype=np.uint8)
        if self._is_dict:
            self.observation_space = gymnasium.spaces.Dict({**source.spaces, "screen": stacked})
        else:
            self.observation_space = stacked

    def _frame(self, screen: np.ndarray) -> np.ndarray:
        channels = screen.shape[2]
        if self._grayscale:
            image = cv2.cvtColor(
                screen, cv2.COLOR_RGBA2GRAY if channels == 4 else cv2.COLOR_RGB2GRAY
            )
        else:
            image = screen[:, :, :3]
        if self._resize:
            image = cv2.resize(image, self._size, interpolation=cv2.INTER_AREA)
        return image

    def _output(self, observation: Any) -> Any:
        stacked = self._frames.copy()
        if self._is_dict:
            return {**observation, "screen": stacked}
        return stacked

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        observation, info = self.env.reset(seed=seed, options=options)
        self._frames[:] = self._frame(observation["screen"] if self._is_dict else observation)
        return self._output(observation), info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        self._frames[:-1] = self._frames[1:]
        self._frames[-1] = self._frame(observation["screen"] if self._is_dict else observation)
        return self._output(observation), reward, terminated, truncated, info
