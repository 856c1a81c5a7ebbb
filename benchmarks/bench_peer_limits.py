"""The learner's per-message cost of the run's limits on peers (``PeerLimits.check_step``) next to
the wire decoder's (``decode_step``) for the same step message, in microseconds per message.

    python benchmarks/bench_peer_limits.py [--repeat 2000]

Reward clipping on (a reward bound, so rewards and the three value fields are checked: the most work
``check_step`` does on a message without episodes); zero-filled fields of the Breakout and CartPole
schemas, inline arrays.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oakemu_core.config import OakEmuConfig  # noqa: E402
from oakemu_core.envs import env_spec  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env  # noqa: E402
from oakemu_core.transport.peer_limits import PeerLimits  # noqa: E402
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step  # noqa: E402


def per_message_us(call, repeat: int) -> float:
    """Best of 5 timings of ``repeat`` calls, in microseconds per call."""
    return min(timeit.repeat(call, number=repeat, repeat=5)) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timing (default 2000)")
    args = parser.parse_args()
    print("env              envs K  check_step us  decode_step us  ratio")
    for env_id in ("ALE/Breakout-v5", "CartPole-v1"):
        schema = schema_for_env(env_spec(env_id))
        limits = PeerLimits.from_config(OakEmuConfig(env_id=env_id, clip_rewards=True))
        for num_envs, k in ((8, 1), (8, 4), (64, 4)):
            spec = StepSpec(num_envs=num_envs, schema=schema, steps_per_message=k)
            fields = {
                name: np.zeros(shape, dtype) for name, (dtype, shape) in spec.array_layout().items()
            }
            fields["trainable"][...] = True
            message = StepMessage("a", "i", 0, 0, fields)
            frames = [bytes(frame) for frame in encode_step(message, spec)]
            check = per_message_us(lambda: limits.check_step(message), args.repeat)
            decode = per_message_us(
                lambda: decode_step(frames, lambda a, i: spec, max_bytes=2**28), args.repeat
            )
            print(
                f"{env_id:16s} {num_envs:4d} {k}  {check:13.1f}  {decode:14.1f}  {check / decode:5.1%}"
            )


if __name__ == "__main__":
    main()
