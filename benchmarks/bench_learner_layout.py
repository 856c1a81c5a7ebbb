"""What the CPU learner's layout and precision buy: one PPO-sized minibatch step of the Nature CNN
(forward, backward, fused Adam) with the model as built, with ``ActorCritic.use_channels_last()``,
and channels-last with bfloat16 mixed precision (``learner_precision = "bfloat16"``: the forward
under ``torch.autocast``, as ``PPOUpdater`` runs it), timed in turn in the same run.

The learner turns channels-last on when it trains on the CPU (its ``Trainer``);
bfloat16 is a setting (off by default): it pays on CPUs with AVX512-BF16 or AMX and on GPUs, and is
emulated, slower, elsewhere. Prints the median milliseconds per step of each variant over
interleaved repeats and the speed-ups of channels-last over as built, and of bfloat16 over
channels-last.

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

from oakemu_core.policy.models import ActorCritic, build_model  # noqa: E402

FRAME_SHAPE = (4, 84, 84)  # ALE's preprocessed, stacked frames


def milliseconds_per_step(
    model: ActorCritic, frames: torch.Tensor, steps: int, *, bfloat16: bool = False
) -> float:
    """Median wall milliseconds of one forward + backward + fused Adam step (after 2 warm-up steps);
    ``bfloat16``: the forward under bfloat16 autocast (the learner's mixed precision)."""
    optimizer = torch.optim.Adam(
        model.parameters(), lr=2.5e-4, eps=1e-5, fused=frames.device.type in ("cpu", "cuda")
    )
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        with torch.autocast(frames.device.type, dtype=torch.bfloat16, enabled=bfloat16):
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
    parser.add_argument(
        "--batch", type=int, default=256, help="minibatch rows (default 256: Breakout's 1,024 / 4)"
    )
    parser.add_argument("--steps", type=int, default=12, help="timed steps per figure")
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; medians are reported"
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    frames = torch.randint(
        0,
        256,
        (args.batch, *FRAME_SHAPE),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(0),
    ).to(args.device)
    runs: dict[str, list[float]] = {"as built": [], "channels-last": [], "bfloat16": []}
    for _ in range(args.repeats):
        for variant in runs:
            torch.manual_seed(0)
            model = build_model(FRAME_SHAPE, np.uint8, 4).to(args.device)
            if variant != "as built":
                model.use_channels_last()
            runs[variant].append(
                milliseconds_per_step(model, frames, args.steps, bfloat16=variant == "bfloat16")
            )
    print(
        f"Nature CNN minibatch step (forward, backward, fused Adam), batch {args.batch}, {args.device}, "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats "
        f"(bfloat16: channels-last with bfloat16 autocast)"
    )
    for variant, values in runs.items():
        print(
            f"{variant:>14}: {statistics.median(values):8.1f} ms   runs: {', '.join(f'{v:.1f}' for v in values)}"
        )
    medians = {variant: statistics.median(values) for variant, values in runs.items()}
    print(f"channels-last speed-up: {medians['as built'] / medians['channels-last']:.2f} x")
    print(
        f"bfloat16 speed-up over channels-last: {medians['channels-last'] / medians['bfloat16']:.2f} x"
    )


if __name__ == "__main__":
    main()
