"""Videos of evaluation episodes (oakemu_core/envs/render.py, oakemu_core/run/video.py): the game's
full-colour screen at its render size, one MP4 per recorded episode, the same returns as without
video; the tester's video and TensorBoard preview; ``oakemu evaluate --video`` and ``--json``.

Decoding uses imageio's ffmpeg plugin, the writer's own reader (the ``video`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip(
    "imageio_ffmpeg", reason="videos need the video extra: pip install 'oakemu-rl[video]'"
)
import imageio.v3 as iio  # noqa: E402
from oakemu_services import cli  # noqa: E402

from oakemu_core.envs import env_spec  # noqa: E402
from oakemu_core.policy.models import weights_to_arrays  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env  # noqa: E402
from oakemu_core.run.checkpoint import save_checkpoint  # noqa: E402
from oakemu_core.run.evaluation import build_evaluation, play_episodes  # noqa: E402
from oakemu_core.run.metrics import MetricsLogger  # noqa: E402
from oakemu_core.run.video import EpisodeVideos, VideoPreview  # noqa: E402

CARTPOLE = "CartPole-v1"


def decode(path: Path) -> np.ndarray:
    """All frames of an MP4, ``(n, H, W, 3)`` uint8."""
    return iio.imread(path, plugin="FFMPEG", index=None)


def play(
    env_id: str, *, seed: int, episodes: int, videos: EpisodeVideos | None, **options
) -> tuple[list, list]:
    """Returns and lengths of ``episodes`` sampled episodes of a fixed random policy."""
    schema = schema_for_env(env_spec(env_id, settings_file=options.get("settings_file"))).to_dict()
    torch.manual_seed(0)
    model, env = build_evaluation(env_id, schema, seed=seed, frame_sink=videos, **options)
    try:
        result = play_episodes(model, env, episodes=episodes, greedy=False)
    finally:
        env.close()
        if videos is not None:
            videos.close()
    return result.returns, result.lengths


def recorded(
    env_id: str, tmp_path: Path, *, episodes: int = 1, record: int = 1, **options
) -> tuple[list, list, list]:
    """Play with and without video; the returns and lengths must agree. Returns (returns, lengths, videos)."""
    videos = EpisodeVideos(lambda i: tmp_path / f"episode_{i}.mp4", episodes=record)
    with_video = play(env_id, seed=5, episodes=episodes, videos=videos, **options)
    assert videos.error is None, videos.error
    assert with_video == play(env_id, seed=5, episodes=episodes, videos=None, **options), (
        "recording changed the episodes"
    )
    return *with_video, videos.paths


def test_gymnasium_video_has_the_render_size_one_frame_per_step(tmp_path: Path) -> None:
    returns, lengths, paths = recorded(CARTPOLE, tmp_path, episodes=3, record=2)
    assert [p.name for p in paths] == [
        "episode_0.mp4",
        "episode_1.mp4",
    ]  # only the first 2 of 3 episodes
    for path, length in zip(paths, lengths):
        frames = decode(path)
        assert frames.shape == (length + 1, 400, 600, 3)  # the reset's frame, then one per step
    assert not list(tmp_path.glob("*.partial.mp4"))


def test_ale_video_is_colour_at_the_emulator_resolution(tmp_path: Path) -> None:
    returns, lengths, paths = recorded("ALE/Breakout-v5", tmp_path, max_episode_steps=40)
    frames = decode(paths[0]).astype(np.int16)
    assert frames.shape == (lengths[0] + 1, 210, 160, 3)  # not the 84x84 grey observation
    # Breakout's bricks are red, orange, yellow, green, blue: the channels differ (grey would not).
    assert np.abs(frames[..., 0] - frames[..., 2]).mean() > 5


def test_gameboy_video_shows_the_screen(tmp_path: Path) -> None:
    pytest.importorskip("pyboy", reason="the Game Boy backend needs the emulators extra")
    from tests.emulator_envs import EPISODE_STEPS, test_files

    rom, settings = test_files()
    returns, lengths, paths = recorded(f"gameboy:{rom}", tmp_path, settings_file=str(settings))
    frames = decode(paths[0])
    assert frames.shape == (EPISODE_STEPS + 1, 144, 160, 3)  # the whole Game Boy screen in colour
    assert len({frame.tobytes() for frame in frames}) > 1, (
        "every frame is the same: the screen is not shown"
    )


def test_a_sink_declines_after_its_episodes_and_a_failure_removes_the_partial_file(
    tmp_path: Path,
) -> None:
    videos = EpisodeVideos(lambda i: tmp_path / f"v{i}.mp4", episodes=1, preview=True)
    frame = np.zeros((9, 11, 3), np.uint8)  # odd sides: resized up to even ones for yuv420p
    assert videos.begin(10.0)
    for value in range(0, 250, 10):
        videos.add(frame + np.uint8(value))
    videos.end()
    assert not videos.begin(10.0)  # one episode asked for
    assert decode(tmp_path / "v0.mp4").shape[0] == 25
    assert isinstance(videos.preview, VideoPreview) and videos.preview.gif.startswith(b"GIF8")

    failing = EpisodeVideos(lambda i: tmp_path / "broken.mp4", episodes=2)
    assert failing.begin(10.0)
    failing.add(frame)
    failing.fail("cannot render")
    assert failing.error == "cannot render" and not failing.begin(10.0)
    assert not list(tmp_path.glob("broken*"))


def test_an_env_that_cannot_render_is_evaluated_without_video(tmp_path: Path) -> None:
    videos = EpisodeVideos(lambda i: tmp_path / f"{i}.mp4", episodes=1)
    returns, _ = play("tests.spaces_envs:MultiBinaryTarget-v0", seed=1, episodes=1, videos=videos)
    assert returns and videos.paths == [] and "cannot be recorded" in (videos.error or "")


def test_the_preview_is_an_animated_image_in_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    videos = EpisodeVideos(lambda i: tmp_path / "v.mp4", episodes=1, preview=True)
    play(CARTPOLE, seed=5, episodes=1, videos=videos)
    assert videos.preview is not None and videos.preview.width == 240  # 600 px scaled down
    with MetricsLogger(tmp_path / "run") as metrics:
        metrics.log_video(123, "eval/video", videos.paths[0], videos.preview)
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0})
    events.Reload()
    [image] = events.Images("eval/video")
    assert image.step == 123 and image.encoded_image_string == videos.preview.gif
    assert (image.height, image.width) == (160, 240)


@pytest.fixture
def cartpole_checkpoint(tmp_path: Path) -> Path:
    schema = schema_for_env(env_spec(CARTPOLE)).to_dict()
    torch.manual_seed(3)
    model, env = build_evaluation(CARTPOLE, schema, seed=None)
    env.close()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "env": {"env_id": CARTPOLE, "schema": schema},
            "config": {"normalize_observations": False},
        },
    )
    assert weights_to_arrays(model)
    return path


def test_evaluate_records_every_episode_and_prints_json(
    cartpole_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    video_dir = tmp_path / "videos"
    assert (
        cli.main(
            [
                "evaluate",
                str(cartpole_checkpoint),
                "--episodes",
                "3",
                "--sampled",
                "--video",
                str(video_dir),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert (
        result["episodes"] == 3 and result["policy"] == "sampled" and result["env_id"] == CARTPOLE
    )
    assert (
        result["mean"] == pytest.approx(np.mean(result["returns"]))
        and result["video_error"] is None
    )
    assert sorted(p.name for p in video_dir.iterdir()) == [
        "episode_1.mp4",
        "episode_2.mp4",
        "episode_3.mp4",
    ]
    assert result["videos"] == [str(video_dir / f"episode_{n}.mp4") for n in (1, 2, 3)]
    for path, length in zip(result["videos"], result["lengths"]):
        assert decode(Path(path)).shape == (length + 1, 400, 600, 3)
    # Without --video the same seed plays the same episodes.
    assert (
        cli.main(["evaluate", str(cartpole_checkpoint), "--episodes", "3", "--sampled", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["returns"] == result["returns"]


def test_an_env_whose_render_gives_no_frame_is_evaluated_without_video(tmp_path: Path) -> None:
    import gymnasium
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    class NoFrames(CartPoleEnv):
        def render(self) -> None:
            return None

    if "OakEmuNoFrames-v0" not in gymnasium.registry:
        gymnasium.register("OakEmuNoFrames-v0", entry_point=NoFrames, max_episode_steps=50)
    videos = EpisodeVideos(lambda i: tmp_path / f"{i}.mp4", episodes=1)
    returns, _ = play("OakEmuNoFrames-v0", seed=1, episodes=2, videos=videos)
    assert len(returns) == 2 and videos.paths == [] and not list(tmp_path.iterdir())
    assert "render() returned NoneType" in (videos.error or "")


def test_the_tester_records_the_first_episode_of_each_evaluation(tmp_path: Path) -> None:
    from oakemu_core.run.tester import Tester

    schema = schema_for_env(env_spec(CARTPOLE)).to_dict()
    torch.manual_seed(4)
    model, env = build_evaluation(CARTPOLE, schema, seed=None)
    env.close()
    weights = weights_to_arrays(model)
    tester = Tester(
        CARTPOLE, episodes=2, greedy=True, seed=7, schema_dict=schema, video_dir=tmp_path / "videos"
    )
    try:
        tester.start()
        assert tester.submit(4, weights, 100)
        reports = tester.drain(120.0)
    finally:
        tester.close()
    assert len(reports) == 1, tester.last_error
    [report] = reports
    assert (
        report.video_path == str(tmp_path / "videos" / "update_4.mp4")
        and report.video_error is None
    )
    assert decode(Path(report.video_path)).shape == (report.lengths[0] + 1, 400, 600, 3)
    assert isinstance(report.video_preview, VideoPreview)
    model.eval()
    _, env = build_evaluation(CARTPOLE, schema, seed=7)
    try:  # the same episodes as an evaluation without video
        assert list(report.returns) == play_episodes(model, env, episodes=2, greedy=True).returns
    finally:
        env.close()


def test_stable_retro_video_is_the_consoles_screen(tmp_path: Path) -> None:
    pytest.importorskip("stable_retro", reason="the stable-retro backend needs the emulators extra")
    returns, lengths, paths = recorded(
        "retro:Airstriker-Genesis-v0", tmp_path, max_episode_steps=30
    )
    frames = decode(paths[0])
    assert frames.shape == (
        lengths[0] + 1,
        224,
        320,
        3,
    )  # the Genesis screen, not the 84x84 observation
    assert len({frame.tobytes() for frame in frames}) > 1
