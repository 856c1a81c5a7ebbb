"""What channels-last convolutions buy the learner: one PPO-sized minibatch step of the Nature CNN
(forward, backward, fused Adam) with the model as built against ``ActorCritic.use_channels_last()``,
timed in turn in the same run.

The learner turns channels-last on when it trains on the CPU (``services/learner.py``, ``Trainer``).
Prints the median milliseconds per step of each layout over interleaved repeats and their ratio.

Usage: ``python benchmarks/bench_learner_layout.py [--batch 256] [--steps 12] [--repeats 3] [--device cpu]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oakemu_core.models import ActorCritic, build_model  # noqa: E402

FRAME_SHAPE = (4, 84, 84)  # ALE's preprocessed, stacked frames


def milliseconds_per_step(model: ActorCritic, frames: torch.Tensor, steps: int) -> float:
    """Median wall milliseconds of one forward + backward + fused Adam step (after 2 warm-up steps)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5, fused=frames.device.type in ("cpu", "cuda"))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        policy, values = model.policy_and_values(frames)
        loss = values.square().mean() - policy.entropy().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if frames.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="minibatch rows (default 256: Breakout's 1,024 / 4)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per figure")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    frames = torch.randint(0, 256, (args.batch, *FRAME_SHAPE), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0)).to(args.device)
    runs: dict[str, list[float]] = {"as built": [], "channels-last": []}
    for _ in range(args.repeats):
        for layout in runs:
            torch.manual_seed(0)
            model = build_model(FRAME_SHAPE, np.uint8, 4).to(args.device)
            if layout == "channels-last":
                model.use_channels_last()
            runs[layout].append(milliseconds_per_step(model, frames, args.steps))
    print(f"Nature CNN minibatch step (forward, backward, fused Adam), batch {args.batch}, {args.device}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats")
    for layout, values in runs.items():
        print(f"{layout:>14}: {statistics.median(values):8.1f} ms   runs: {', '.join(f'{v:.1f}' for v in values)}")
    ratio = statistics.median(runs["as built"]) / statistics.median(runs["channels-last"])
    print(f"channels-last speed-up: {ratio:.2f} x")


if __name__ == "__main__":
    main()
