"""Device check of the learner path: a few PPO updates on real Breakout rollouts on ``--device``.

For a lent GPU machine (``python benchmarks/gpu_check.py --device cuda``); it also runs on the CPU.
Per update it prints: observation uploads to the device during the update (expected: 1, the cached
upload reused by every epoch), the first-minibatch PPO ratio deviation from 1 (actor on the CPU vs
learner on the device; expected < 1e-5 on the first update, whose rows the learner's own weights
produced), and the seconds per epoch.

Usage: ``python benchmarks/gpu_check.py [--device cuda] [--updates 3] [--envs 16] [--steps 128]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oakemu_core.policy.distributions import distribution_for_env  # noqa: E402
from oakemu_core.envs import make_vector_env  # noqa: E402
from oakemu_core.policy.models import build_model, load_weight_arrays, weights_to_arrays  # noqa: E402
from oakemu_core.algo.ppo import PPOUpdater  # noqa: E402
from oakemu_core.storage.rollout_buffer import RolloutBuffer  # noqa: E402
from oakemu_core.actor.stepper import PolicyStepper  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--env", default="ALE/Breakout-v5")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(1)
    env = make_vector_env(args.env, args.envs, seed=1)
    spec = env.spec
    actor_model = build_model(spec.observation_layout, distribution_for_env(spec))
    learner_model = build_model(spec.observation_layout, distribution_for_env(spec))
    load_weight_arrays(learner_model, weights_to_arrays(actor_model))
    learner = PPOUpdater(
        learner_model, torch.optim.Adam(learner_model.parameters(), lr=2.5e-4, eps=1e-5), device=args.device,
        ppo_epochs=4, num_minibatches=4, clip_coef=0.1, clip_value_range=0.1, ent_coef=0.01, vf_coef=0.5,
        max_grad_norm=0.5,
    )
    stepper = PolicyStepper(env, actor_model, policy_version=0)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), {args.env}, rollout {args.steps} x {args.envs}")
    print(f"{'update':>6} {'uploads':>8} {'ratio dev':>11} {'s/epoch':>8} {'policy loss':>12} {'approx kl':>10}")
    with RolloutBuffer(args.steps, args.envs, schema=stepper.schema, seed=1) as buffer:
        for update in range(args.updates):
            buffer.reset()
            for _ in range(args.steps):
                row = stepper.step()
                row.buffers.add_to_rollout_buffer(buffer, policy_version=row.policy_version)
            buffer.compute_gae(row.next_values, buffer.dones[-1].copy(), 0.99, 0.95)
            uploads_before = buffer.observation_uploads
            start = time.perf_counter()
            stats = learner.step(buffer, current_policy_version=stepper.policy_version)
            elapsed = time.perf_counter() - start
            uploads = buffer.observation_uploads - uploads_before
            # The actors get the new weights (as the learner publishes them) for the next rollout.
            load_weight_arrays(actor_model, weights_to_arrays(learner_model))
            stepper.policy_version += 1
            per_epoch = elapsed / max(1, stats.epochs_completed)
            print(f"{update + 1:>6} {uploads:>8} {stats.first_minibatch_ratio_max_abs_dev:>11.2e} {per_epoch:>8.3f} "
                  f"{stats.policy_loss:>12.4f} {stats.approx_kl:>10.5f}")
    env.close()
    if args.device.startswith("cuda"):
        print(f"peak device memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
