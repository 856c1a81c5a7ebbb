"""What the network options cost, each against its baseline measured in the same run (interleaved repeats):

* ``cnn``: one PPO minibatch step (forward, backward, fused Adam; channels-last as the CPU learner trains)
  of the IMPALA ResNet (``--cnn impala``, channels 16-32-32) against the Nature CNN, on Breakout-shaped
  rows (4 x 84 x 84 uint8), and one actor forward pass of 8 rows of each;
* ``actor``: one actor step's inference (``model.act`` on 8 envs) of a recurrent policy against the
  feed-forward one on the same observations: CartPole-shaped vectors (the MLP with the actors' default
  numpy backend, and with torch; LSTM 64 and 128 after it, torch) and Breakout frames (Nature CNN, and
  Nature CNN + LSTM 128 as CleanRL's ``ppo_atari_lstm.py``);
* ``step``: an actor's whole vector step (``PolicyStepper.step``: inference, env step, recording) of a
  recurrent policy against the feed-forward one, CartPole (MLP against LSTM 64, numpy) and Breakout
  (Nature against Nature + LSTM 128, torch), 8 envs;
* ``update``: a whole PPO update (``PPOUpdater.step``: 4 epochs x 4 minibatches) of a recurrent policy on
  sequences (whole columns, and sequences of 32 rows) against the feed-forward policy at the same rows
  (T x N = 128 x 8 rows): CartPole-shaped (MLP against LSTM 64) and Breakout-shaped (Nature against
  Nature + LSTM 128, channels-last as the CPU learner);
* ``memory``: bytes per stored row of the rollout buffer, feed-forward and with an LSTM's state.

Prints medians (milliseconds or microseconds) and the ratios; ``--json PATH`` also writes them.

Usage: ``python benchmarks/bench_networks.py [--parts cnn,actor,step,update,memory] [--repeats 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oakemu_core.policy.distributions import Categorical  # noqa: E402
from oakemu_core.policy.models import ActorCritic, build_model  # noqa: E402
from oakemu_core.policy.network import NetworkSpec  # noqa: E402

FRAMES = {"": ((4, 84, 84), np.uint8)}
VECTOR = {"": ((4,), np.float32)}


def _median_seconds(call: Callable[[], Any], calls: int) -> float:
    """Median wall seconds of ``call`` over ``calls`` calls, after 3 warm-up calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _model(layout: dict, network: NetworkSpec, actions: int = 4) -> ActorCritic:
    torch.manual_seed(0)
    return build_model(layout, Categorical(actions), network=network)


def _sgd_step(model: ActorCritic, frames: torch.Tensor, steps: int) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5, fused=True)

    def step() -> None:
        policy, values = model.policy_and_values(frames)
        loss = values.square().mean() - policy.entropy().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return _median_seconds(step, steps)


def part_cnn(repeats: int, batch: int) -> dict[str, float]:
    """IMPALA against Nature: milliseconds per minibatch step and per 8-row actor forward pass."""
    rng = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, generator=rng)
    actor_frames = np.random.default_rng(0).integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
    runs: dict[str, list[float]] = {
        f"{cnn} {what}": [] for cnn in ("nature", "impala") for what in ("step", "act")
    }
    for _ in range(repeats):
        for cnn in ("nature", "impala"):
            model = _model(FRAMES, NetworkSpec(cnn=cnn)).use_channels_last()
            runs[f"{cnn} step"].append(_sgd_step(model, frames, 5) * 1e3)
            actor = _model(FRAMES, NetworkSpec(cnn=cnn)).eval()
            runs[f"{cnn} act"].append(
                _median_seconds(lambda a=actor: a.act(actor_frames), 20) * 1e3
            )
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(
        f"CNN encoders, Breakout rows, minibatch {batch}, CPU, torch threads {torch.get_num_threads()} (ms):"
    )
    for name, value in medians.items():
        print(f"  {name:>12}: {value:8.2f}   runs: {', '.join(f'{v:.2f}' for v in runs[name])}")
    ratios = {
        "impala/nature step": medians["impala step"] / medians["nature step"],
        "impala/nature act": medians["impala act"] / medians["nature act"],
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f} x")
    return {**medians, **ratios}


def part_actor(repeats: int) -> dict[str, float]:
    """A recurrent actor step against the feed-forward one (microseconds per ``act`` of 8 envs)."""
    from oakemu_core.policy.numpy_inference import NumpyForward

    vectors = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    frames = np.random.default_rng(0).integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
    variants: dict[str, tuple[ActorCritic, Any, np.ndarray | None]] = {}
    mlp_numpy = _model(VECTOR, NetworkSpec(), actions=2).eval()
    mlp_numpy.use_inference_backend(NumpyForward(mlp_numpy))
    variants["mlp numpy"] = (mlp_numpy, vectors, None)
    variants["mlp torch"] = (_model(VECTOR, NetworkSpec(), actions=2).eval(), vectors, None)
    for hidden in (64, 128):
        model = _model(
            VECTOR, NetworkSpec(recurrent="lstm", recurrent_hidden=hidden), actions=2
        ).eval()
        variants[f"mlp lstm{hidden} torch"] = (model, vectors, model.initial_state(8))
        model = _model(
            VECTOR, NetworkSpec(recurrent="lstm", recurrent_hidden=hidden), actions=2
        ).eval()
        model.use_inference_backend(NumpyForward(model))
        variants[f"mlp lstm{hidden} numpy"] = (model, vectors, model.initial_state(8))
    variants["nature"] = (_model(FRAMES, NetworkSpec()).eval(), frames, None)
    model = _model(FRAMES, NetworkSpec(recurrent="lstm", recurrent_hidden=128)).eval()
    variants["nature lstm128"] = (model, frames, model.initial_state(8))
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (model, observations, state) in variants.items():
            calls = 50 if "nature" in name else 500
            if state is None:
                seconds = _median_seconds(lambda m=model, o=observations: m.act(o), calls)
            else:
                seconds = _median_seconds(
                    lambda m=model, o=observations, s=state: m.act(o, state=s), calls
                )
            runs[name].append(seconds * 1e6)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print("actor inference, model.act on 8 envs, CPU, torch threads 1 (us):")
    for name, value in medians.items():
        print(f"  {name:>18}: {value:9.1f}")
    ratios = {
        "lstm64/mlp, numpy (auto)": medians["mlp lstm64 numpy"] / medians["mlp numpy"],
        "lstm128/mlp, numpy (auto)": medians["mlp lstm128 numpy"] / medians["mlp numpy"],
        "lstm64/mlp, torch": medians["mlp lstm64 torch"] / medians["mlp torch"],
        "nature lstm128/nature": medians["nature lstm128"] / medians["nature"],
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f} x")
    return {**medians, **ratios}


def part_step(repeats: int) -> dict[str, float]:
    """A recurrent actor's whole vector step (``PolicyStepper.step``: inference, env step, recording)
    against the feed-forward one on the same env (microseconds per step of 8 envs)."""
    from oakemu_core.actor.join_setup import make_inference_backend
    from oakemu_core.actor.stepper import PolicyStepper
    from oakemu_core.envs.factory import make_vector_env
    from oakemu_core.policy.distributions import distribution_for_env

    cases = {
        "cartpole mlp": ("CartPole-v1", NetworkSpec()),
        "cartpole lstm64": ("CartPole-v1", NetworkSpec(recurrent="lstm", recurrent_hidden=64)),
        "breakout nature": ("ALE/Breakout-v5", NetworkSpec()),
        "breakout nature lstm128": (
            "ALE/Breakout-v5",
            NetworkSpec(recurrent="lstm", recurrent_hidden=128),
        ),
    }
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (env_id, network) in cases.items():
            env = make_vector_env(env_id, 8, seed=0, num_threads=1)
            try:
                torch.manual_seed(0)
                model = build_model(
                    env.spec.observation_layout, distribution_for_env(env.spec), network=network
                ).eval()
                model.use_inference_backend(make_inference_backend("auto", model, threads=1))
                stepper = PolicyStepper(env, model)
                calls = 300 if "cartpole" in name else 40
                runs[name].append(_median_seconds(stepper.step, calls) * 1e6)
            finally:
                env.close()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print("actor vector step (inference, env step, recording), 8 envs, actor_inference auto (us):")
    for name, value in medians.items():
        print(f"  {name:>24}: {value:9.1f}   runs: {', '.join(f'{v:.1f}' for v in runs[name])}")
    ratios = {
        "cartpole lstm64/mlp step": medians["cartpole lstm64"] / medians["cartpole mlp"],
        "breakout lstm128/nature step": medians["breakout nature lstm128"]
        / medians["breakout nature"],
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f} x")
    return {**medians, **ratios}


UPDATE_CASES = {
    "cartpole feed-forward": (VECTOR, NetworkSpec(), None),
    "cartpole lstm64": (VECTOR, NetworkSpec(recurrent="lstm", recurrent_hidden=64), None),
    "cartpole lstm64 seq32": (VECTOR, NetworkSpec(recurrent="lstm", recurrent_hidden=64), 32),
    "breakout nature": (FRAMES, NetworkSpec(), None),
    "breakout nature lstm128": (FRAMES, NetworkSpec(recurrent="lstm", recurrent_hidden=128), None),
}
"""name -> (observation layout, network, sequence_length) of the ``update`` part."""


def _filled_buffer(layout: dict, model: ActorCritic, steps: int, envs: int) -> Any:
    """A rollout buffer of ``steps x envs`` random rows acted by ``model`` (episodes end with
    probability 0.02 a step), GAE computed."""
    from oakemu_core.step_schema import build_schema
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

    rng = np.random.default_rng(0)
    shape, dtype = layout[""]
    buffer = RolloutBuffer(
        steps,
        envs,
        schema=build_schema(layout, Categorical(4), state_size=model.state_size),
        seed=0,
    )
    state = model.initial_state(envs) if model.recurrent else None
    for _ in range(steps):
        if dtype == np.uint8:
            observations = rng.integers(0, 256, (envs, *shape), dtype=np.uint8)
        else:
            observations = rng.normal(size=(envs, *shape)).astype(np.float32)
        bundle = model.act(observations, state=state)
        dones = rng.random(envs) < 0.02
        extra = {"policy_state": bundle.policy_state} if state is not None else {}
        rewards = rng.normal(size=envs).astype(np.float32)
        buffer.add(
            observations, bundle.actions, bundle.log_probs, bundle.values, rewards, dones, **extra
        )
        if bundle.next_state is not None:
            state = bundle.next_state.copy()
            state[dones] = 0.0
    buffer.compute_gae(model.predict_values(observations, state=state), dones, 0.99, 0.95)
    return buffer


def part_update(repeats: int) -> dict[str, float]:
    """A PPO update on sequences against the feed-forward update at the same rows (seconds)."""
    from oakemu_core.algo.ppo import PPOUpdater

    steps, envs = 128, 8
    runs: dict[str, list[float]] = {name: [] for name in UPDATE_CASES}
    for _ in range(repeats):
        for name, (layout, network, length) in UPDATE_CASES.items():
            model = _model(layout, network)
            if model.has_convolutions:
                model.use_channels_last()
            with _filled_buffer(layout, model, steps, envs) as buffer:
                optimizer = torch.optim.Adam(model.parameters(), lr=3e-4, eps=1e-5, fused=True)
                updater = PPOUpdater(
                    model,
                    optimizer,
                    device="cpu",
                    ppo_epochs=4,
                    num_minibatches=4,
                    sequence_length=length,
                )
                start = time.perf_counter()
                updater.step(buffer, current_policy_version=0)
                runs[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(
        f"PPO update, {steps} x {envs} rows, 4 epochs x 4 minibatches, CPU (s; seq32: sequences of 32 rows):"
    )
    for name, value in medians.items():
        print(f"  {name:>24}: {value:8.3f}   runs: {', '.join(f'{v:.3f}' for v in runs[name])}")
    ratios = {
        "cartpole lstm64/feed-forward update": medians["cartpole lstm64"]
        / medians["cartpole feed-forward"],
        "cartpole lstm64 seq32/feed-forward update": medians["cartpole lstm64 seq32"]
        / medians["cartpole feed-forward"],
        "breakout lstm128/nature update": medians["breakout nature lstm128"]
        / medians["breakout nature"],
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f} x")
    return {**medians, **ratios}


def part_memory() -> dict[str, float]:
    """Bytes per stored row (one env, one step) with and without a recurrent state."""
    from oakemu_core.step_schema import build_schema

    figures = {}
    for name, layout in (("cartpole", VECTOR), ("breakout", FRAMES)):
        for core, hidden in (("none", 0), ("lstm", 128)):
            state = NetworkSpec(recurrent=core, recurrent_hidden=hidden or 128).state_size
            figures[f"{name} {core}"] = build_schema(
                layout, Categorical(4), state_size=state
            ).stored_bytes_per_row()
    print("rollout buffer bytes per stored row:")
    for name, value in figures.items():
        print(f"  {name:>15}: {value:8d}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="cnn,actor,step,update,memory")
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved repeats; medians reported"
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="CNN minibatch rows (Breakout: 1,024 / 4)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    parts = args.parts.split(",")
    if "cnn" in parts:
        results["cnn"] = part_cnn(args.repeats, args.batch)
    if "actor" in parts:
        results["actor"] = part_actor(args.repeats)
    if "step" in parts:
        results["step"] = part_step(args.repeats)
    if "update" in parts:
        results["update"] = part_update(args.repeats)
    if "memory" in parts:
        results["memory"] = part_memory()
    results["load_after"] = os.getloadavg()[0]
    print(
        f"1-minute load average before / after: {results['load_before']:.2f} / {results['load_after']:.2f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
