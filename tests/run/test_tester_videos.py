"""The tester's videos (oakemu_core/run/tester_process.py): ``best.mp4`` follows the best evaluation,
``final.mp4`` shows the last one, ``update_<N>.mp4`` only every ``video_every``-th, so a user can watch
a run without the tester recording every evaluation.

A video is the first episode of its evaluation: CartPole renders one 400 x 600 frame at the reset and
one per step, so a video of ``length + 1`` frames is that episode's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "imageio_ffmpeg", reason="videos need the video extra: pip install 'oakemu-rl[video]'"
)
import imageio.v3 as iio  # noqa: E402

from oakemu_core.run.tester import EvaluationReport, Tester  # noqa: E402
from tests.run.test_tester import (  # noqa: E402,F401 - testers is the fixture
    CARTPOLE,
    READY_TIMEOUT_S,
    in_process_returns,
    random_weights,
    testers,
    wait_until,
)

SEED = 7
EPISODES = 2


def frames(path: Path) -> int:
    return len(iio.imread(path, plugin="FFMPEG", index=None))


def weights_by_return(count: int) -> list[tuple[float, int, dict[str, np.ndarray]]]:
    """``count`` random CartPole policies with distinct greedy mean returns (and first-episode lengths)
    under the tester's seed, lowest first: ``(mean return, first episode's length, weights)``."""
    found: dict[float, tuple[float, int, dict[str, np.ndarray]]] = {}
    lengths: set[int] = set()
    for torch_seed in range(200):
        weights = random_weights(CARTPOLE, torch_seed)
        returns = in_process_returns(CARTPOLE, weights, seed=SEED, episodes=EPISODES)
        mean, first = float(np.mean(returns)), int(returns[0])  # CartPole: return = length
        if mean not in found and first not in lengths:
            found[mean] = (mean, first, weights)
            lengths.add(first)
        if len(found) == count:
            return sorted(found.values(), key=lambda entry: entry[0])
    raise AssertionError("no random policies with distinct returns")


def periodic(tester: Tester, version: int, weights: dict[str, np.ndarray]) -> EvaluationReport:
    """One periodic evaluation, to its report (not drain(): that is the end of a run)."""
    done = tester.completed + tester.failed
    assert tester.submit(version, weights, 100 * version)
    wait_until(
        lambda: tester.completed + tester.failed > done, READY_TIMEOUT_S, f"evaluation {version}"
    )
    reports = tester.poll()
    assert [r.policy_version for r in reports] == [version], tester.last_error
    return reports[0]


def test_best_and_final_videos_follow_the_evaluations_and_update_videos_are_every_kth(
    testers, tmp_path: Path
) -> None:
    low, middle, high = weights_by_return(3)
    videos = tmp_path / "videos"
    tester: Tester = testers(episodes=EPISODES, seed=SEED, video_dir=videos, video_every=2)

    periodic(tester, 1, middle[2])  # the 1st evaluation: update_1.mp4, and the best so far
    assert frames(videos / "update_1.mp4") == middle[1] + 1
    assert frames(videos / "best.mp4") == middle[1] + 1
    periodic(tester, 2, low[2])  # the 2nd: no video of its own; not better
    assert not (videos / "update_2.mp4").exists()
    assert frames(videos / "best.mp4") == middle[1] + 1
    periodic(tester, 3, high[2])  # the 3rd: update_3.mp4, and a new best
    assert frames(videos / "update_3.mp4") == high[1] + 1
    assert frames(videos / "best.mp4") == high[1] + 1
    assert not (videos / "final.mp4").exists()  # only the end of a run (drain) makes it
    assert tester.submit(4, low[2], 400)
    [report] = tester.drain(READY_TIMEOUT_S)
    assert report.policy_version == 4 and report.return_mean == low[0]
    assert tester.final_video == str(videos / "final.mp4")
    assert (
        frames(videos / "final.mp4") == low[1] + 1
    )  # the last evaluation's episode, not the best one
    assert frames(videos / "best.mp4") == high[1] + 1
    assert sorted(path.name for path in videos.iterdir()) == [
        "best.mp4",
        "final.mp4",
        "update_1.mp4",
        "update_3.mp4",
    ]


def test_without_update_videos_best_and_final_are_replayed_episodes(
    testers, tmp_path: Path
) -> None:
    # The evaluation records nothing itself (video_every=0); a new best and the end replay its first
    # episode with the same seed: the same episode as the evaluation played.
    low, high = weights_by_return(2)
    videos = tmp_path / "videos"
    tester: Tester = testers(episodes=EPISODES, seed=SEED, video_dir=videos, video_every=0)
    assert tester.submit(1, high[2], 100)
    wait_until(lambda: tester.completed == 1, READY_TIMEOUT_S, "evaluation 1")
    [first] = tester.poll()
    assert first.video_path == str(videos / "best.mp4") and first.video_error is None
    assert first.videos == (str(videos / "best.mp4"),)
    assert frames(videos / "best.mp4") == first.lengths[0] + 1 == high[1] + 1
    assert tester.drain(READY_TIMEOUT_S) == []  # the end of a run right after its last evaluation
    assert frames(videos / "final.mp4") == high[1] + 1  # a copy: the last evaluation was the best
    second = periodic(tester, 2, low[2])
    assert second.video_path is None and second.videos == ()  # not better: no video of its own
    assert tester.drain(READY_TIMEOUT_S) == []
    assert frames(videos / "final.mp4") == low[1] + 1  # replayed for the end
    assert frames(videos / "best.mp4") == high[1] + 1
    assert not list(videos.glob("update_*")) and not list(videos.glob("*.partial.mp4"))


def test_a_resumed_run_keeps_best_mp4_until_a_better_evaluation(testers, tmp_path: Path) -> None:
    low, high = weights_by_return(2)
    videos = tmp_path / "videos"
    tester: Tester = testers(
        episodes=EPISODES,
        seed=SEED,
        video_dir=videos,
        video_every=0,
        best_return=(low[0] + high[0]) / 2,
    )
    periodic(tester, 1, low[2])
    assert not (videos / "best.mp4").exists()  # below the best.pt of the run before
    periodic(tester, 2, high[2])
    assert frames(videos / "best.mp4") == high[1] + 1
