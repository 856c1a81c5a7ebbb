"""What recording a video costs the learner's tester: seconds per evaluation with and without.

Two :class:`oakemu_core.run.tester.Tester` processes (niced, one torch thread, as in a run), one
writing ``update_<n>.mp4`` of the first episode of every evaluation (``video_dir``), one not, are
given the same weights in turn ``--repeats`` times; the figure is the tester's own wall time per
evaluation (``EvaluationReport.wall_seconds``: build, play, write), median over the repeats. The
same seed plays the same episodes in both (checked).

Rows: CartPole-v1 (400 x 600 frames drawn by pygame) and ALE/Breakout-v5 (the colour twin
emulator and 210 x 160 frames), each with a freshly initialised policy, sampled. The cost per
recorded frame (the first episode's reset frame and one per step) scales the figure to longer
episodes: a trained CartPole policy's 500-step episode, a Breakout game of thousands of steps.

Run: ``python benchmarks/bench_eval_video.py [--repeats 5 --episodes 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing
warnings.filterwarnings("ignore")

from oakemu_core.envs import env_spec  # noqa: E402
from oakemu_core.policy.models import weights_to_arrays  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env  # noqa: E402
from oakemu_core.run.evaluation import build_evaluation  # noqa: E402
from oakemu_core.run.tester import Tester  # noqa: E402


def random_weights(env_id: str, schema: dict) -> dict:
    torch.manual_seed(0)
    model, env = build_evaluation(env_id, schema, seed=None)
    env.close()
    return weights_to_arrays(model)


def measure(
    env_id: str, weights: dict, schema: dict, *, repeats: int, episodes: int, greedy: bool
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        testers = {
            name: Tester(
                env_id,
                episodes=episodes,
                greedy=greedy,
                seed=10_001,
                schema_dict=schema,
                video_dir=Path(folder) if name == "video" else None,
            )
            for name in ("no video", "video")
        }
        seconds: dict[str, list[float]] = {name: [] for name in testers}
        returns: dict[str, tuple] = {}
        frames = 0
        try:
            for tester in testers.values():
                tester.start()
            for version in range(repeats):
                for (
                    name,
                    tester,
                ) in testers.items():  # one at a time: they never compete for the CPU
                    tester.submit(version, weights, 0)
                    [report] = tester.drain(600.0) or [None]
                    if report is None:
                        raise SystemExit(f"{env_id} {name}: {tester.last_error}")
                    seconds[name].append(report.wall_seconds)
                    returns[name] = report.returns
                    frames = (
                        report.lengths[0] + 1
                    )  # the recorded first episode: reset + one per step
        finally:
            for tester in testers.values():
                tester.close()
    assert returns["video"] == returns["no video"], "recording changed the episodes"
    without, with_video = (statistics.median(seconds[name]) for name in ("no video", "video"))
    print(
        f"| {env_id} | {episodes} | {without:.3f} | {with_video:.3f} | +{with_video - without:.3f} s "
        f"({with_video / without:.2f} x) | {frames} | {1000 * (with_video - without) / frames:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=5)
    args = parser.parse_args()
    print(
        "| env | episodes | s / evaluation, no video | with video | cost | frames recorded | ms / frame |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for env_id, greedy in (("CartPole-v1", False), ("ALE/Breakout-v5", False)):
        schema = schema_for_env(env_spec(env_id)).to_dict()
        measure(
            env_id,
            random_weights(env_id, schema),
            schema,
            repeats=args.repeats,
            episodes=args.episodes,
            greedy=greedy,
        )


if __name__ == "__main__":
    main()
