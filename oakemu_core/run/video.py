"""MP4 videos of evaluation episodes, and the short animated GIF of one that TensorBoard shows.

:class:`EpisodeVideos` is the :class:`oakemu_core.envs.render.FrameSink` that the tester and
``oakemu evaluate --video`` hand to :func:`oakemu_core.envs.make_eval_env`. Videos are H.264 in
yuv420p (they play in browsers and common players), written by imageio's ffmpeg plugin (imageio +
imageio-ffmpeg, which ships an ffmpeg binary: the optional extra ``video``,
``pip install 'oakemu-rl[video]'``) frame by frame, so an episode of any length holds one frame in
memory, and under a temporary name that is renamed when the episode ends: a video file that exists
is complete. Frames keep the render size (even sizes are kept exactly; H.264 in yuv420p needs even
sides, so an odd side is resized up by one pixel).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oakemu_core.errors import UserError

__all__ = [
    "BEST_VIDEO_NAME",
    "FINAL_VIDEO_NAME",
    "VIDEO_DIR_NAME",
    "EpisodeVideos",
    "VideoPreview",
    "VideoUnavailableError",
    "best_video_path",
    "copy_video",
    "episode_video",
    "evaluation_video_path",
    "final_video_path",
    "preview_summary",
    "require_video_writer",
    "run_video_dir",
    "video_writer_available",
]

VIDEO_DIR_NAME = "videos"
"""The run folder's sub-folder of evaluation videos (``best.mp4``, ``final.mp4``, ``update_<policy
version>.mp4``; :mod:`oakemu_core.run.tester_process` says which evaluation each shows)."""
BEST_VIDEO_NAME = "best.mp4"
"""The first episode of the best evaluation so far (the evaluation ``checkpoints/best.pt`` holds)."""
FINAL_VIDEO_NAME = "final.mp4"
"""The first episode of the run's last evaluation (its final weights)."""
PREVIEW_MAX_FRAMES = 100
"""Frames of a TensorBoard preview at most: a longer episode keeps every 2nd, 4th, ... frame."""
PREVIEW_MAX_WIDTH = 240
"""Width (pixels) of a TensorBoard preview at most; wider frames are scaled down."""
_ENCODER_PARAMS = ("-preset", "ultrafast")
"""libx264's fastest preset: less encoding CPU than its default for a file of the same size order
(measured in docs/benchmarks.md, "Paced evaluation, best and final videos")."""
_INSTALL_HINT = "videos need imageio and imageio-ffmpeg: pip install 'oakemu-rl[video]'"


class VideoUnavailableError(UserError, RuntimeError):
    """The video writer (imageio with its ffmpeg plugin) is not installed (exit 2: install the extra or
    leave videos off)."""


def video_writer_available() -> bool:
    """True when imageio and imageio-ffmpeg can be imported."""
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def require_video_writer() -> None:
    """Raise :class:`VideoUnavailableError` (with the install command) unless the writer is installed."""
    if not video_writer_available():
        raise VideoUnavailableError(_INSTALL_HINT)


def evaluation_video_path(video_dir: Path, policy_version: int) -> Path:
    """``video_dir/update_<policy_version>.mp4``: the tester's video of that version's evaluation."""
    return Path(video_dir) / f"update_{int(policy_version)}.mp4"


def best_video_path(video_dir: Path) -> Path:
    """``video_dir/best.mp4`` (:data:`BEST_VIDEO_NAME`)."""
    return Path(video_dir) / BEST_VIDEO_NAME


def final_video_path(video_dir: Path) -> Path:
    """``video_dir/final.mp4`` (:data:`FINAL_VIDEO_NAME`)."""
    return Path(video_dir) / FINAL_VIDEO_NAME


def copy_video(source: Path, target: Path) -> None:
    """Copy the video ``source`` to ``target`` under a temporary name renamed at the end (a video file
    that exists is complete; an older ``target`` stays until then).

    Raises:
        OSError: ``source`` is unreadable or ``target`` cannot be written (nothing is left behind).
    """
    import shutil

    target = Path(target)
    partial = target.with_name(f"{target.stem}.partial{target.suffix}")
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class VideoPreview:
    """A recorded episode as a small looping GIF (at most :data:`PREVIEW_MAX_FRAMES` frames,
    :data:`PREVIEW_MAX_WIDTH` pixels wide) for TensorBoard: ``gif`` bytes, frame ``height`` and
    ``width`` in pixels."""

    gif: bytes
    height: int
    width: int


def preview_summary(tag: str, preview: VideoPreview) -> Any:
    """A TensorBoard ``Summary`` that shows ``preview`` as an animated image under ``tag`` (what
    ``SummaryWriter.add_video`` writes, without its moviepy dependency)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(
        height=preview.height, width=preview.width, colorspace=3, encoded_image_string=preview.gif
    )
    return Summary(value=[Summary.Value(tag=tag, image=image)])


class EpisodeVideos:
    """Writes the first ``episodes`` episodes offered to it as MP4 files (a
    :class:`~oakemu_core.envs.render.FrameSink`).

    Args:
        path_of: ``path_of(i)`` is the file of the ``i``-th recorded episode (0-based); its folder is
            created when needed.
        episodes: episodes to record (>= 1); later ones are declined.
        preview: also keep a :class:`VideoPreview` of the first recorded episode (:attr:`preview`).

    Attributes:
        paths: the finished videos, in episode order.
        error: why recording stopped early (the env cannot render, or the writer failed), or None.
        preview: the first episode's preview (with ``preview=True``, once it ended), or None.

    Raises:
        VideoUnavailableError: imageio / imageio-ffmpeg are not installed.
        ValueError: ``episodes`` < 1.
    """

    def __init__(
        self, path_of: Callable[[int], Path], *, episodes: int, preview: bool = False
    ) -> None:
        require_video_writer()
        if int(episodes) < 1:
            raise ValueError(f"episodes: expected >= 1, received {episodes}")
        self._path_of, self._episodes, self._want_preview = path_of, int(episodes), bool(preview)
        self.paths: list[Path] = []
        self.error: str | None = None
        self.preview: VideoPreview | None = None
        self._writer: Any = None
        self._path = self._partial = Path()
        self._fps = 0.0
        self._frames = 0
        self._stride = 1
        self._kept: list[np.ndarray] = []

    # -- FrameSink ---------------------------------------------------------------------------
    def begin(self, fps: float) -> bool:
        """Start the next episode's file unless ``episodes`` are recorded or recording failed."""
        self._abort()
        if self.error is not None or len(self.paths) >= self._episodes:
            return False
        self._path = Path(self._path_of(len(self.paths)))
        self._partial = self._path.with_name(f"{self._path.stem}.partial{self._path.suffix}")
        self._fps, self._frames, self._stride, self._kept = float(fps), 0, 1, []
        try:
            import imageio.v2 as imageio

            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = imageio.get_writer(
                self._partial,
                format="FFMPEG",
                mode="I",
                fps=self._fps,
                codec="libx264",
                pixelformat="yuv420p",
                macro_block_size=2,
                ffmpeg_log_level="error",
                output_params=list(_ENCODER_PARAMS),
            )
        except Exception as error:  # noqa: BLE001 - a full disk or a broken ffmpeg: evaluation goes on
            self.fail(f"cannot write {self._path}: {type(error).__name__}: {error}")
            return False
        return True

    def add(self, frame: np.ndarray) -> None:
        """Append one ``(H, W, 3)`` uint8 frame to the episode's video."""
        if self._writer is None:
            return
        try:
            self._writer.append_data(frame)
        except Exception as error:  # noqa: BLE001
            self.fail(f"cannot write {self._path}: {type(error).__name__}: {error}")
            return
        if self._want_preview and self.preview is None:
            self._keep_for_preview(frame)
        self._frames += 1

    def end(self) -> None:
        """Finish the episode's file (renamed to its final name) and, for the first, the preview."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
            os.replace(self._partial, self._path)
        except Exception as error:  # noqa: BLE001
            self._partial.unlink(missing_ok=True)
            self.fail(f"cannot write {self._path}: {type(error).__name__}: {error}")
            return
        self.paths.append(self._path)
        if self._want_preview and self.preview is None and self._kept:
            self.preview = self._encode_preview()

    def fail(self, reason: str) -> None:
        """Stop recording for ``reason`` (kept in :attr:`error`); an unfinished file is removed."""
        if self.error is None:
            self.error = reason
        self._abort()

    def close(self) -> None:
        """Remove the file of an episode that did not end (idempotent); finished videos stay."""
        self._abort()

    # -- internals ----------------------------------------------------------------------------
    def _abort(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except Exception:  # noqa: BLE001, S110 - the file is removed anyway
            pass
        self._partial.unlink(missing_ok=True)

    def _keep_for_preview(self, frame: np.ndarray) -> None:
        """Keep every ``stride``-th frame, scaled down; past the maximum, drop every other one kept
        and double the stride (so the preview spans the whole episode)."""
        if self._frames % self._stride:
            return
        height, width = frame.shape[:2]
        if width > PREVIEW_MAX_WIDTH:
            import cv2

            size = (PREVIEW_MAX_WIDTH, max(2, round(height * PREVIEW_MAX_WIDTH / width)))
            frame = cv2.resize(frame, size, interpolation=cv2.INTER_AREA)
        self._kept.append(np.array(frame, copy=True))
        if len(self._kept) > PREVIEW_MAX_FRAMES:
            self._kept = self._kept[::2]
            self._stride *= 2

    def _encode_preview(self) -> VideoPreview | None:
        import imageio.v3 as iio

        frames = np.stack(self._kept)
        self._kept = []
        try:
            gif = iio.imwrite(
                "<bytes>",
                frames,
                extension=".gif",
                duration=1000.0 * self._stride / self._fps,
                loop=0,
            )
        except Exception:  # noqa: BLE001 - no preview; the MP4 is written
            return None
        return VideoPreview(gif=gif, height=int(frames.shape[1]), width=int(frames.shape[2]))


def episode_video(path: Path, *, preview: bool = True) -> EpisodeVideos:
    """A recorder of one episode to ``path`` (the tester's videos), with its TensorBoard preview unless
    ``preview`` is False.

    Raises:
        VideoUnavailableError: imageio / imageio-ffmpeg are not installed.
    """
    return EpisodeVideos(lambda _: Path(path), episodes=1, preview=preview)


def run_video_dir(run_dir: Path) -> Path | None:
    """``run_dir/videos`` when the video writer is installed; else None, with a warning."""
    if video_writer_available():
        return Path(run_dir) / VIDEO_DIR_NAME
    logging.getLogger(__name__).warning(
        "evaluation videos are off: %s (--no-eval-video silences this)", _INSTALL_HINT
    )
    return None
