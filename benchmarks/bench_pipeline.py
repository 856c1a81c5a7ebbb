"""Pipeline throughput: what the transport and the learner cost relative to stepping the envs alone.

Measured in one run, on the same envs, the same number of actor processes and envs per actor:

1. ``raw``: env steps/s with a random policy, no model, no transport (one process per actor);
2. ``raw+policy``: env steps/s of the actor's own step loop (:class:`PolicyStepper`: CPU inference,
   step buffers, bootstrap values), still no transport;
3. ``pipeline``: env steps/s the learner writes into its rollout buffers, actors streaming over
   ZeroMQ, learner ingesting but not training (full buffers are released at once);
4. ``end-to-end``: the same with PPO training (CPU here; the actors wait while both buffers are busy).

The transport cost is ``1 - pipeline / raw+policy`` (target: at most 5 %).  Every figure is a ratio
against ``raw`` measured in the same run, so the machine's speed cancels out.  With ``--curve`` a fifth
figure, ``pipeline+curve``, streams over CURVE-encrypted, ZAP-authenticated sockets (keys made for the
run); its cost is ``1 - pipeline+curve / pipeline``.

The pipeline figure is measured for each ``--steps-per-message`` value (``1`` and ``auto`` by
default: the learner's rule, :func:`oakemu_core.transport.batching.auto_steps_per_message`), and every figure for
each env of ``--env`` (comma-separated; default Breakout and CartPole).

Usage: ``python benchmarks/bench_pipeline.py [--env ALE/Breakout-v5,CartPole-v1] [--actors 1]
[--envs-per-actor 8] [--seconds 15] [--repeats 3] [--steps-per-message 1,auto] [--curve]
[--actor-only] [--actor-variants] [--per-core]``

``--per-core`` measures what ``emulator_threads`` auto gives an actor per CPU: raw with one process
per CPU and one emulator thread each, and the actor loop in that layout with torch, ONNX Runtime and
bfloat16 forward passes; it reports them against the faster raw figure (one process of 8 envs on
ale-py's default threads may leave part of the cores idle; one process per core keeps them busy).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


ACTOR_VARIANTS = (
    "groups2",
    "threads2",
    "inference_mode",
    "channels_last",
    "onnxruntime",
    "groups2+onnxruntime",
    "bfloat16",
    "groups2+bfloat16",
)
"""Actor-loop variants of ``--actor-variants``: two overlapped env groups
(``env_groups=2``), 2 torch threads, ``torch.inference_mode`` around the loop, a channels-last model,
forward passes by ONNX Runtime (``--actor-inference onnxruntime``), the two together, and a bfloat16
image encoder (``--actor-inference bfloat16``) alone and with two groups."""

PER_CORE_VARIANTS = ("torch", "onnxruntime", "bfloat16")
"""Actor-loop variants of ``--per-core``: one actor process per CPU, one emulator thread each (what
``emulator_threads`` auto gives ``num_actors`` = CPUs), each with these forward passes."""


def _step_loop(
    env_id: str,
    num_envs: int,
    seconds: float,
    with_policy: bool,
    seed: int,
    out: mp.Queue,
    variant: str = "",
) -> None:
    import contextlib

    import torch

    from oakemu_core.actor.stepper import PolicyStepper
    from oakemu_core.envs import make_vector_env
    from oakemu_core.envs.factory import make_env_groups
    from oakemu_core.policy.distributions import distribution_for_env
    from oakemu_core.policy.models import build_model

    parts = set(variant.split("+"))
    torch.set_num_threads(2 if "threads2" in parts else 1)
    threads = (
        {"num_threads": 1} if "per_core" in parts else {}
    )  # else ale-py's default of the adapter
    env = (
        make_env_groups(env_id, num_envs, 2, seed=seed, **threads)
        if "groups2" in parts
        else make_vector_env(env_id, num_envs, seed=seed, **threads)
    )
    spec = env.spec
    mode = torch.inference_mode() if "inference_mode" in parts else contextlib.nullcontext()
    mode.__enter__()
    if with_policy:
        model = build_model(spec.observation_layout, distribution_for_env(spec))
        if "channels_last" in parts:
            model = model.to(memory_format=torch.channels_last)
        if "onnxruntime" in parts:
            from oakemu_core.policy.onnx_inference import OnnxForward

            model.use_inference_backend(OnnxForward(model))
        if "bfloat16" in parts:
            from oakemu_core.policy.bfloat16_inference import BFloat16Forward

            model.use_inference_backend(BFloat16Forward(model))
        stepper = PolicyStepper(env, model)
        step = stepper.step
    else:
        env.reset()
        spec.action_space.seed(seed)

        def step() -> None:  # a uniformly random policy over the action space (masks ignored)
            env.step(np.stack([spec.action_space.sample() for _ in range(num_envs)]))

    for _ in range(20):  # warm-up
        step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        steps += num_envs
    out.put(steps / (time.perf_counter() - start))
    env.close()


def measure_local(
    env_id: str, actors: int, num_envs: int, seconds: float, *, with_policy: bool, variant: str = ""
) -> float:
    """Sum over ``actors`` processes of env steps/s, no transport (``variant``: see ACTOR_VARIANTS)."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_step_loop, args=(env_id, num_envs, seconds, with_policy, 100 + i, out, variant)
        )
        for i in range(actors)
    ]
    for p in procs:
        p.start()
    rates = []
    while len(rates) < len(
        procs
    ):  # a child that died (an error) fails the run at once, not after a timeout
        try:
            rates.append(out.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"an actor-loop process ({variant or 'raw'}) exited with an error"
                ) from None
    total = sum(rates)
    for p in procs:
        p.join()
    return total


def measure_pipeline(
    env_id: str,
    actors: int,
    num_envs: int,
    seconds: float,
    *,
    train: bool,
    curve: bool = False,
    steps_per_message: int | str = "auto",
) -> float:
    """Env steps/s written by a learner (this process) fed by ``actors`` actor processes (over CURVE
    sockets when ``curve``)."""
    from oakemu_services import learner as learner_module

    from oakemu_core.config import OakEmuConfig
    from oakemu_core.transport.auth import generate_keypair

    ports = _free_ports(5)
    with tempfile.TemporaryDirectory() as runs_dir:
        security: dict[str, object] = {}
        actor_security: dict[str, str] = {}
        if curve:
            keys = Path(runs_dir) / "keys"
            generate_keypair(keys, "learner")
            generate_keypair(keys / "authorized", "actor")
            security = {
                "curve": True,
                "curve_secret_key": keys / "learner.key_secret",
                "curve_authorized_keys": keys / "authorized",
            }
            actor_security = {
                "OAKEMU_CURVE": "true",
                "OAKEMU_CURVE_SECRET_KEY": str(keys / "authorized" / "actor.key_secret"),
                "OAKEMU_CURVE_SERVER_KEY": str(keys / "learner.key"),
            }
        config = OakEmuConfig(
            env_id=env_id,
            num_actors=actors,
            envs_per_actor=num_envs,
            total_env_steps=10**9,
            data_port=ports[0],
            control_port=ports[1],
            weights_port=ports[2],
            telemetry_port=ports[3],
            metrics_port=ports[4],
            runs_dir=Path(runs_dir),
            run_name="bench",
            checkpoint_every_updates=0,
            log_level="WARNING",
            steps_per_message=steps_per_message,
            **security,
        )
        from oakemu_core.algo import learner as library_learner

        original_step = library_learner.PPOLearner.update
        if not train:  # full buffers are released at once: no PPO update, same weights
            library_learner.PPOLearner.update = lambda self, *args, **kwargs: None
        learner = learner_module.Learner(config, Path(runs_dir) / "bench")
        stop = threading.Event()
        thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
        thread.start()
        env = {**os.environ, "OAKEMU_LOG_LEVEL": "WARNING", **actor_security}
        flags = [
            f"--envs-per-actor={num_envs}",
            f"--data-port={ports[0]}",
            f"--control-port={ports[1]}",
            f"--weights-port={ports[2]}",
            "--torch-threads=1",
        ]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "oakemu_services.cli",
                    "actor",
                    f"--actor-id=bench-{i}",
                    *flags,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(actors)
        ]
        try:
            counters = learner.assembler.counters
            deadline = time.monotonic() + 120
            while counters.env_steps < 2 * actors * num_envs * 20 and time.monotonic() < deadline:
                time.sleep(0.1)  # warm-up: actors joined and streaming
            start_steps, start = counters.env_steps, time.perf_counter()
            time.sleep(seconds)
            rate = (counters.env_steps - start_steps) / (time.perf_counter() - start)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            stop.set()
            thread.join(120)
            learner.close()
            library_learner.PPOLearner.update = original_step
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--env", default="ALE/Breakout-v5,CartPole-v1", help="comma-separated env ids"
    )
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--envs-per-actor", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; medians are reported"
    )
    parser.add_argument(
        "--curve", action="store_true", help="also measure the pipeline over CURVE sockets"
    )
    parser.add_argument(
        "--steps-per-message",
        default="1,auto",
        help="comma-separated steps_per_message values for the pipeline figure (ints or auto)",
    )
    parser.add_argument(
        "--no-end-to-end", action="store_true", help="skip the end-to-end (PPO) figure"
    )
    parser.add_argument(
        "--actor-variants",
        action="store_true",
        help="also measure actor-loop variants: " + ", ".join(ACTOR_VARIANTS),
    )
    parser.add_argument(
        "--actor-only", action="store_true", help="only raw and actor-loop figures (no learner)"
    )
    parser.add_argument(
        "--per-core",
        action="store_true",
        help="also measure one process per CPU with one emulator thread each: raw, and the actor "
        "loop with " + ", ".join(PER_CORE_VARIANTS),
    )
    args = parser.parse_args()
    for env_id in args.env.split(","):
        bench_env(args, env_id.strip())


def bench_env(args: argparse.Namespace, env_id: str) -> None:
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env

    ks = [k if k == "auto" else int(k) for k in args.steps_per_message.split(",")]
    env_step_bytes = schema_for_env(env_spec(env_id)).sent_bytes_per_env()
    resolved = {
        k: OakEmuConfig(env_id=env_id).resolved_steps_per_message(  # actors here get a step ring
            env_step_bytes, args.envs_per_actor, step_ring=True
        )
        if k == "auto"
        else k
        for k in ks
    }
    args.env = env_id
    print(
        f"{args.env}: {args.actors} actor process(es) x {args.envs_per_actor} envs, {args.seconds:.0f} s per "
        f"figure, median of {args.repeats} interleaved repeats, {os.cpu_count()} CPUs"
    )
    pipeline_keys = [f"pipeline K={k}" + (f" ({resolved[k]})" if k == "auto" else "") for k in ks]
    variants = list(ACTOR_VARIANTS) if args.actor_variants else []
    if args.actor_only:
        pipeline_keys, ks, args.no_end_to_end = [], [], True
    from oakemu_core.config import available_cpus
    from oakemu_core.policy.bfloat16_inference import check_supported

    try:
        check_supported(env_spec(env_id).observation_layout)
        images = True
    except ValueError:  # the bfloat16 forward serves uint8 images only
        images = False
    variants = [v for v in variants if images or "bfloat16" not in v]
    cores = available_cpus()
    per_core = (
        [f"per_core+{v}" for v in PER_CORE_VARIANTS if images or v != "bfloat16"]
        if args.per_core
        else []
    )
    figures: dict[str, list[float]] = {
        "raw": [],
        "policy": [],
        **{v: [] for v in variants},
        "per_core": [],
        **{v: [] for v in per_core},
        **{key: [] for key in pipeline_keys},
        "end_to_end": [],
        "curve": [],
    }
    common = (args.env, args.actors, args.envs_per_actor, args.seconds)
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every figure
        figures["raw"].append(measure_local(*common, with_policy=False))
        figures["policy"].append(measure_local(*common, with_policy=True))
        for variant in variants:
            figures[variant].append(measure_local(*common, with_policy=True, variant=variant))
        if per_core:
            per_core_common = (args.env, cores, args.envs_per_actor, args.seconds)
            figures["per_core"].append(
                measure_local(*per_core_common, with_policy=False, variant="per_core")
            )
            for variant in per_core:
                figures[variant].append(
                    measure_local(*per_core_common, with_policy=True, variant=variant)
                )
        for k, key in zip(ks, pipeline_keys):
            figures[key].append(measure_pipeline(*common, train=False, steps_per_message=k))
        if args.curve:
            figures["curve"].append(measure_pipeline(*common, train=False, curve=True))
    if not args.no_end_to_end:
        figures["end_to_end"].append(measure_pipeline(*common, train=True))
    raw, policy = (float(np.median(figures[k])) for k in ("raw", "policy"))
    pipeline = float(np.median(figures[pipeline_keys[0]])) if pipeline_keys else float("nan")
    print(f"{'measurement':<52}{'env steps/s':>12}{'vs raw':>9}   all runs")
    for name, key in [
        ("raw env, random actions, no transport", "raw"),
        ("raw+policy: actor step loop, no transport", "policy"),
        *[(f"raw+policy, {v}", v) for v in variants],
        *([(f"raw, {cores} processes x 1 emulator thread", "per_core")] if per_core else []),
        *[(f"actor loop, {cores} actors x 1 thread, {v.split('+')[1]}", v) for v in per_core],
        *[(f"{key}: ZeroMQ -> ingest, no PPO", key) for key in pipeline_keys],
        *(
            [("end-to-end: with PPO training (K auto)", "end_to_end")]
            if not args.no_end_to_end
            else []
        ),
        *([("pipeline+curve: CURVE sockets, no PPO", "curve")] if args.curve else []),
    ]:
        value = float(np.median(figures[key]))
        print(
            f"{name:<52}{value:>12.0f}{value / raw:>9.3f}   {', '.join(f'{v:.0f}' for v in figures[key])}"
        )
    print(f"actor loop / raw env (medians): {policy / raw:.3f}")
    for v in variants:
        print(
            f"actor loop {v} / raw env (medians): {float(np.median(figures[v])) / raw:.3f} "
            f"(x{float(np.median(figures[v])) / policy:.2f} of the default loop)"
        )
    if per_core:  # against the faster of the two raw figures: the machine's own env rate
        best_raw = max(raw, float(np.median(figures["per_core"])))
        for v in per_core:
            print(
                f"actor loop, {cores} actors x 1 thread, {v.split('+')[1]} / best raw env (medians): "
                f"{float(np.median(figures[v])) / best_raw:.3f} (/ raw: {float(np.median(figures[v])) / raw:.3f})"
            )
    for key in pipeline_keys:
        value = float(np.median(figures[key]))
        print(
            f"transport cost, {key} (1 - pipeline / raw+policy, medians): {100 * (1 - value / policy):.1f} %"
        )
    if args.curve:
        with_curve = float(np.median(figures["curve"]))
        print(
            f"CURVE cost (1 - pipeline+curve / pipeline, medians): {100 * (1 - with_curve / pipeline):.1f} %"
        )


if __name__ == "__main__":
    main()
