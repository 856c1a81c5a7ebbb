"""Benchmark RolloutBuffer.add and compute_gae against plain memory copies of the same bytes.

Atari-sized by default: 128 steps x 64 envs, observations 4x84x84 uint8. Prints, for this run:

- ``add`` per step (one row for all envs, validation included) as a ratio to one ``np.copyto`` of
  the same number of bytes (what ``add`` writes per step), and to per-field ``np.copyto`` into
  plain numpy arrays of the same layout (the bare work ``add`` has to do);
- ``compute_gae`` (the buffer method and the bare :func:`oakemu_core.storage.gae.compute_gae`) as a ratio
  to copying the arrays it reads (rewards, values, dones, bootstrap_values, last_values) and
  writes (advantages, returns).

Each figure is the median over ``--repeats`` measurements after a warm-up rollout.

Run: ``python benchmarks/bench_rollout_buffer.py [--rollout-length 128 --num-envs 64 --repeats 7]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing

from oakemu_core.storage import gae  # noqa: E402
from oakemu_core.storage.rollout_buffer import RolloutBuffer  # noqa: E402

OBSERVATION_SHAPE = (4, 84, 84)


def median_seconds(function: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``function()`` over ``repeats`` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_steps(
    rng: np.random.Generator, num_steps: int, num_envs: int
) -> list[dict[str, np.ndarray]]:
    """Random step arrays (as an actor would send), a few episode ends and truncations."""
    steps = []
    for _ in range(num_steps):
        terminated = rng.random(num_envs) < 0.01
        truncated = (rng.random(num_envs) < 0.005) & ~terminated
        steps.append(
            {
                "observations": rng.integers(
                    0, 256, (num_envs, *OBSERVATION_SHAPE), dtype=np.uint8
                ),
                "actions": rng.integers(0, 18, num_envs, dtype=np.int64),
                "log_probs": rng.normal(size=num_envs).astype(np.float32),
                "values": rng.normal(size=num_envs).astype(np.float32),
                "rewards": rng.normal(size=num_envs).astype(np.float32),
                "dones": terminated | truncated,
                "trainable": rng.random(num_envs) < 0.95,
                "bootstrap_values": np.where(truncated, rng.normal(size=num_envs), 0).astype(
                    np.float32
                ),
            }
        )
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-length", type=int, default=128)
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    num_steps, num_envs, repeats = args.rollout_length, args.num_envs, args.repeats
    rng = np.random.default_rng(0)
    steps = make_steps(rng, num_steps, num_envs)
    bytes_per_step = (
        sum(array.nbytes for array in steps[0].values()) + 16 * num_envs
    )  # + versions, revisions

    with RolloutBuffer(num_steps, num_envs, OBSERVATION_SHAPE, np.uint8) as buffer:

        def fill_buffer() -> None:
            buffer.reset()
            for step in steps:
                buffer.add(**step, policy_version=3)

        fill_buffer()  # warm-up: touches every page once
        add_per_step = median_seconds(fill_buffer, repeats) / num_steps

        # Baseline 1: one np.copyto of the bytes add writes per step, into a warm destination.
        source = rng.integers(0, 256, bytes_per_step, dtype=np.uint8)
        destination = np.zeros((num_steps, bytes_per_step), np.uint8)

        def copy_rollout() -> None:
            for t in range(num_steps):
                np.copyto(destination[t], source)

        copy_rollout()
        copy_per_step = median_seconds(copy_rollout, repeats) / num_steps

        # Baseline 2: per-field np.copyto into plain (T, N, ...) arrays (the bare work of add).
        plain = {
            name: np.zeros((num_steps, *array.shape), array.dtype)
            for name, array in steps[0].items()
        }
        plain_versions = np.zeros((num_steps, num_envs), np.int64)
        plain_revisions = np.zeros((num_steps, num_envs), np.int64)

        def copy_fields() -> None:
            for t, step in enumerate(steps):
                for name, array in step.items():
                    np.copyto(plain[name][t], array)
                plain_versions[t] = 3
                plain_revisions[t] = 0

        copy_fields()
        fields_per_step = median_seconds(copy_fields, repeats) / num_steps

        # GAE.
        last_values = rng.normal(size=num_envs).astype(np.float32)
        last_dones = buffer.dones[-1].copy()
        gae_method = median_seconds(
            lambda: buffer.compute_gae(last_values, last_dones, 0.99, 0.95), repeats
        )
        reads = [buffer.rewards, buffer.values, buffer.dones, buffer.bootstrap_values]
        gae_function = median_seconds(
            lambda: gae.compute_gae(*reads, last_values, 0.99, 0.95), repeats
        )
        copied = [*reads, last_values, buffer.advantages, buffer.returns]
        targets = [np.empty_like(array) for array in copied]

        def copy_gae_arrays() -> None:
            for target, array in zip(targets, copied, strict=True):
                np.copyto(target, array)

        copy_gae_arrays()
        gae_copy = median_seconds(copy_gae_arrays, repeats)
        memory_gib = buffer.memory_gb

    print(
        f"RolloutBuffer benchmark: {num_steps} steps x {num_envs} envs, observations "
        f"{'x'.join(map(str, OBSERVATION_SHAPE))} uint8, buffer {memory_gib * 1024:.1f} MiB, median of {repeats}"
    )
    print(
        f"add per step:                  {add_per_step * 1e6:9.1f} us ({bytes_per_step / 1e6:.2f} MB written)"
    )
    print(
        f"  np.copyto same bytes:        {copy_per_step * 1e6:9.1f} us   ratio add / copyto        = {add_per_step / copy_per_step:6.2f}"
    )
    print(
        f"  per-field np.copyto:         {fields_per_step * 1e6:9.1f} us   ratio add / field copies  = {add_per_step / fields_per_step:6.2f}"
    )
    print(f"compute_gae (buffer method):   {gae_method * 1e6:9.1f} us")
    print(f"compute_gae (gae function):    {gae_function * 1e6:9.1f} us")
    print(
        f"  copy of arrays read+written: {gae_copy * 1e6:9.1f} us   ratio compute_gae / copy  = {gae_method / gae_copy:6.2f}"
        f" (function alone {gae_function / gae_copy:.2f})"
    )


if __name__ == "__main__":
    main()
