"""The learner's ingest ceiling: how many env steps per second one learner can take in, fed by
synthetic actors that send Atari-sized step messages as fast as the learner takes them.

A synthetic actor (:class:`benchmarks.synthetic_actors.SyntheticActor`) joins like a real one (same
join, spec, sockets, back-pressure and weights polling: :class:`oakemu_services.actor.Actor`), takes
ONE real vector step for valid field values, and then re-sends those fields with increasing ``seq``
and no env, no inference. The learner runs in this process (:class:`oakemu_services.learner.Learner`)
with PPO switched off (its injected trainer's update does nothing:
:class:`benchmarks.synthetic_actors.NoUpdateLearner`), so full buffers are released at once: what is
measured is receive + decode/validate + write into shared memory.

Printed, all measured in the same run:

* ``memcpy``: single-thread copy of message-sized chunks into a buffer larger than the caches
  (numpy ``copyto``), MB/s: the ceiling's yardstick (target: ingest >= 25 % of it);
* ``ingest``: env steps/s (rows/s) and MB/s (message array bytes) the learner writes, and its ratio
  to ``memcpy``, with the step arrays in shared-memory step rings (``step_transport = "auto"``, what
  actors on the learner's machine use: :mod:`oakemu_core.transport.step_ring`) and, for comparison, inline
  in the socket messages (``"sockets"``: actors on other machines or in other containers);
* ``in-process decode + write``: the same decode and write on encoded frames in one thread, with no
  sockets and no other process: what the learner's own code costs, apart from the transport;
* ``ingest CPU per env step`` and ``estimated ingest ceiling per ingest core``: CPU time of the
  threads that ingest (the learner's loop thread and its ZeroMQ I/O threads, from ``/proc``) per
  row written, and its inverse: the rate those threads would reach on a core of their own, an
  estimate (not measured: on this machine the synthetic actors take the other core; it leaves out
  the trainer thread's per-rollout work and any wait for the GIL while a real update runs);
* ``actor rate``: env steps/s of one real actor process (step loop with CPU inference, no transport),
  and how many such actor cores the ingest ceiling could feed;
* ``ingest + training load``: the same ingest while a Nature-CNN forward/backward loop (torch, one
  thread) runs as a thread of the learner process (sharing its GIL) and, for comparison, as a
  separate process (same CPU load, no shared GIL). ``GIL cost = 1 - thread / process``: above about
  10 % the trainer should move into a process of its own, attached to the shared-memory buffers.

On a 2-core machine the synthetic actors, the learner and the training load share two cores, so the
ceiling printed is a floor for a bigger learner machine; the ratios are what to compare.

The figures from ``ingest`` down (CPU per step, actor cores, training load) use step rings; the line
``ingest through the sockets only`` and its ratio to memcpy are the same measurement with
``step_transport = "sockets"`` (and the K the learner gives such actors: 4 for Breakout, as with a ring). A run
where a synthetic actor did not get its ring stops with an error instead of printing socket figures
as ring figures.

``--sockets-only --feeder replay``: the synthetic actors encode 64 messages once and re-send them with
fresh headers (:meth:`~benchmarks.synthetic_actors.SyntheticActor.start_replay`); the learner's work per
message is the same, and the cores are left to it, as they are when the actors run on other machines.

Usage: ``python benchmarks/bench_ingest.py [--env ALE/Breakout-v5] [--actors 1] [--envs-per-actor 8]
[--steps-per-message auto] [--seconds 10] [--repeats 3] [--no-training-load] [--buffer-columns 64]
[--sockets-only [--feeder encode|replay]]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_pipeline import _free_ports, measure_local  # noqa: E402
from benchmarks.synthetic_actors import NoUpdateLearner, SyntheticActor, learner_with, stack_shifter  # noqa: E402
from oakemu_core.algo.learner import PPOLearner  # noqa: E402


def synthetic_actor(
    env_id: str,
    num_envs: int,
    ports: list[int],
    actor_id: str,
    stop: mp.Event,
    transport: str = "auto",
    replay: bool = False,
) -> None:
    """A :class:`SyntheticActor` that joins the learner and re-sends its one real vector step as fast
    as the learner takes it, through the step ring the learner offers (``transport`` "auto") or inline
    ("sockets"), until ``stop``; ``replay``: inline messages encoded once and re-sent
    (:meth:`SyntheticActor.start_replay`)."""
    import torch

    torch.set_num_threads(1)
    actor = SyntheticActor(env_id, num_envs, ports, actor_id, threading.Event(), transport)
    try:
        actor.join()
        if replay:
            actor.start_replay()
        while not stop.is_set():
            actor.send_next()
    finally:
        actor.close()


def training_load(env_id: str, stop: mp.Event, batch: int = 64) -> None:
    """The env's model (Nature CNN for Atari): forward + backward + Adam on random observations of
    ``batch`` rows, one torch thread, until ``stop``."""
    import torch

    from oakemu_core.envs import env_spec
    from oakemu_core.policy.distributions import distribution_for_env
    from oakemu_core.policy.models import build_model

    torch.set_num_threads(1)
    spec = env_spec(env_id)
    model = build_model(spec.observation_layout, distribution_for_env(spec))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    observations: object = {
        key: torch.from_numpy(np.zeros((batch, *shape), dtype))
        for key, (shape, dtype) in spec.observation_layout.items()
    }
    if set(spec.observation_layout) == {""}:  # a plain observation space: the tensor itself
        observations = observations[""]
    while not stop.is_set():
        policy, values = model.policy_and_values(observations)
        loss = values.pow(2).mean() - policy.entropy().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def memcpy_mb_per_s(
    chunk_bytes: int, seconds: float = 2.0, total_bytes: int = 256 * 2**20
) -> float:
    """Single-thread copy of ``chunk_bytes`` chunks into successive slots of a ``total_bytes`` array."""
    source = np.random.default_rng(0).integers(0, 255, chunk_bytes, dtype=np.uint8)
    slots = max(2, total_bytes // chunk_bytes)
    target = np.ones(
        (slots, chunk_bytes), np.uint8
    )  # written once (np.zeros would not touch the pages): no page faults timed
    copied, i, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.copyto(target[i], source)
        i = (i + 1) % slots
        copied += chunk_bytes
    return copied / (time.perf_counter() - start) / 1e6


def measure_ingest(
    env_id: str,
    actors: int,
    num_envs: int,
    seconds: float,
    load: str = "",
    steps_per_message: int | str = "auto",
    transport: str = "auto",
    columns: int = 64,
    learner_type: type[PPOLearner] = NoUpdateLearner,
    replay: bool = False,
    **settings: object,
) -> tuple[float, float, dict]:
    """Env steps/s the learner writes from ``actors`` synthetic actors; ``load``: "" (none), "thread"
    (training loop in this process) or "process"; ``transport``: the ``step_transport`` of learner
    and actors ("auto": step rings here; "sockets"). Returns ``(rate, CPU seconds of the ingest
    threads per row written, dropped counters)``. ``columns``: the learner's rollout buffer columns;
    ``learner_type``: the trainer's learner (default: one whose update does nothing: full buffers are
    released at once); ``settings``: further :class:`~oakemu_core.config.OakEmuConfig` fields (e.g.
    the PPO settings of a learner that trains); ``replay``: the actors re-send messages encoded once
    (``transport`` "sockets" only: :meth:`SyntheticActor.start_replay`)."""
    from oakemu_core.config import OakEmuConfig

    ports = _free_ports(5)
    ctx = mp.get_context("spawn")
    stop_actors, stop_load = ctx.Event(), ctx.Event()
    with tempfile.TemporaryDirectory() as runs_dir:
        config = OakEmuConfig(
            **{
                "env_id": env_id,
                "num_actors": actors,
                "envs_per_actor": num_envs,
                "total_env_steps": 10**12,
                "num_envs": columns,
                "mode": "async",
                "data_port": ports[0],
                "control_port": ports[1],
                "weights_port": ports[2],
                "telemetry_port": ports[3],
                "metrics_port": ports[4],
                "runs_dir": Path(runs_dir),
                "run_name": "bench",
                "checkpoint_every_updates": 0,
                "steps_per_message": steps_per_message,
                "step_transport": transport,
                "eval_every_updates": 0,
                "log_level": "WARNING",
                **settings,
            }
        )
        learner = learner_with(config, Path(runs_dir) / "bench", learner_type)
        stop = threading.Event()
        thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
        thread.start()
        procs = [
            ctx.Process(
                target=synthetic_actor,
                args=(env_id, num_envs, ports, f"synthetic-{i}", stop_actors, transport, replay),
            )
            for i in range(actors)
        ]
        loader: threading.Thread | mp.Process | None = None
        if load == "thread":
            loader = threading.Thread(target=training_load, args=(env_id, stop_load), daemon=True)
        elif load == "process":
            loader = ctx.Process(target=training_load, args=(env_id, stop_load))
        try:
            for p in procs:
                p.start()
            counters = learner.assembler.counters
            deadline = time.monotonic() + 120
            while counters.env_steps < actors * num_envs * 200 and time.monotonic() < deadline:
                time.sleep(0.1)  # warm-up: actors joined and streaming
            if (
                transport == "auto" and len(learner.rings) != actors
            ):  # each took its ring, none fell back
                raise RuntimeError(
                    f"{len(learner.rings)} of {actors} synthetic actors use a step ring"
                )
            if loader is not None:
                loader.start()
                time.sleep(2.0)  # the load has built its model and is running
            start_steps, start, start_cpu = (
                counters.env_steps,
                time.perf_counter(),
                ingest_cpu_s(thread.native_id),
            )
            time.sleep(seconds)
            rows = counters.env_steps - start_steps
            rate = rows / (time.perf_counter() - start)
            cpu_per_row = (ingest_cpu_s(thread.native_id) - start_cpu) / max(rows, 1)
            dropped = dict(counters.dropped)
        finally:
            stop_actors.set()
            stop_load.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
                    p.join(10)
            if isinstance(loader, mp.Process):
                loader.join(30)
            elif isinstance(loader, threading.Thread):
                loader.join(30)
            stop.set()
            thread.join(120)
            learner.close()
    return rate, cpu_per_row, dropped


def _valid_fields(schema, lead: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Arrays of every sent field of ``schema`` with leading dimensions ``lead`` that pass the wire's
    value checks: zeros raised to the field's lower bound, masks allowing everything, trainable rows."""
    fields = {}
    for item in schema.sent:
        array = np.zeros((*lead, *item.shape), item.dtype)
        if item.mask_segments is not None or item.name == "trainable":
            array[...] = True
        elif item.low is not None:
            array[...] = np.maximum(array, item.low)
        fields[item.name] = array
    return fields


def in_process_rows_per_s(
    env_id: str, num_envs: int, steps_per_message: int, seconds: float
) -> float:
    """Env steps/s that decode (:func:`oakemu_core.transport.steps.decode_step`) and write
    (:class:`oakemu_core.storage.assembler.RolloutAssembler`) reach in this thread on encoded step frames, with
    no sockets: the learner's own share of the ingest cost. One actor of ``num_envs`` envs fills a
    buffer of as many columns; each full buffer is released, and the actor joins again to restart
    its ``seq`` at 0 (so one rollout's frames, encoded once, are replayed)."""
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.storage.assembler import RolloutAssembler
    from oakemu_core.storage.rollout_buffer import RolloutBuffer
    from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step

    schema = schema_for_env(env_spec(env_id))
    rollout_length, k = OakEmuConfig(env_id=env_id).rollout_length, steps_per_message
    spec = StepSpec(num_envs, schema, steps_per_message=k)
    fields = _valid_fields(schema, (num_envs,) if k == 1 else (k, num_envs))
    frames = [
        [
            bytes(frame)
            for frame in encode_step(StepMessage("in-process", "0", seq, 0, fields), spec)
        ]
        for seq in range(rollout_length // k)
    ]
    max_bytes = 2 * sum(map(len, frames[0]))
    buffers = [RolloutBuffer(rollout_length, num_envs, schema=schema) for _ in range(2)]
    try:
        assembler = RolloutAssembler(buffers, actor_timeout_s=1e9)
        rows, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            assembler.join("in-process", "0", spec, hostname="bench", now=0.0)
            for frame in frames:
                message = decode_step(frame, assembler.spec_for, max_bytes=max_bytes)
                assembler.ingest(message, current_policy_version=0, now=0.0)
            rollout = assembler.take_full_rollout()
            assert rollout is not None, "a replayed rollout must fill the buffer"
            assembler.release(rollout.slot)
            rows += rollout_length * num_envs
        return rows / (time.perf_counter() - start)
    finally:
        for buffer in buffers:
            buffer.close()


def ingest_cpu_s(ingest_thread_id: int) -> float:
    """CPU seconds of the threads that ingest: the learner's loop thread (receive, decode, validate,
    write, and per full buffer its release and the weights' encoding and publishing) and this
    process's ZeroMQ I/O threads (the socket reads). Not the trainer thread: with PPO switched off it
    only prepares each rollout (GAE, lag statistics) and snapshots the weights, many times a second.
    Linux ``/proc``; elsewhere the whole process (an over-estimate)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    ticks = 0
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if int(task.name) == ingest_thread_id or name.startswith("ZMQbg/IO"):
            fields = stat.rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime + stime (proc(5))
    return ticks / os.sysconf("SC_CLK_TCK")


def wire_bytes_per_env_step(env_id: str, num_envs: int, k: int, messages: int = 256) -> float:
    """Mean bytes (all frames) of a step message per env step, for a stream of stacks that move one
    frame per step (:func:`stack_shifter`) encoded as an actor's socket channel does
    (:class:`oakemu_core.transport.steps.StepEncoder`: newest frames only, key frames included)."""
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.transport.steps import StepEncoder, StepMessage, StepSpec

    schema = schema_for_env(env_spec(env_id))
    spec = StepSpec(num_envs, schema, steps_per_message=k)
    fields = _valid_fields(schema, spec.lead)
    shift, encoder, total = stack_shifter(fields, schema, k), StepEncoder(spec), 0
    for seq in range(messages):
        shift()
        total += sum(
            memoryview(frame).nbytes
            for frame in encoder.encode(StepMessage("a", "0", seq, 0, fields))
        )
    return total / (messages * k * num_envs)


def sockets_only(args: argparse.Namespace, k: int, bytes_per_row: int) -> None:
    """``--sockets-only``: memcpy, ingest through the sockets, wire bytes per env step."""
    memcpy_all, rates, cpu_all, dropped_all = [], [], [], []
    for _ in range(args.repeats):
        memcpy_all.append(memcpy_mb_per_s(bytes_per_row * args.envs_per_actor * k))
        rate, cpu_per_row, dropped = measure_ingest(
            args.env,
            args.actors,
            args.envs_per_actor,
            args.seconds,
            "",
            k,
            transport="sockets",
            columns=args.buffer_columns,
            replay=args.feeder == "replay",
        )
        rates.append(rate)
        cpu_all.append(cpu_per_row)
        dropped_all.append(dropped)
    memcpy, rate = float(np.median(memcpy_all)), float(np.median(rates))
    print(
        f"{'memcpy, message-sized chunks (MB/s)':<58}{memcpy:>14,.0f}   {', '.join(f'{v:,.0f}' for v in memcpy_all)}"
    )
    print(
        f"{'ingest through the sockets (env steps/s)':<58}{rate:>14,.0f}   {', '.join(f'{v:,.0f}' for v in rates)}"
    )
    print(
        f"ingest through the sockets / memcpy bandwidth: {100 * rate * bytes_per_row / 1e6 / memcpy:.1f} % "
        f"({rate * bytes_per_row / 1e6:,.0f} MB/s of rows written; target >= 25 %)"
    )
    cpu = float(np.median(cpu_all))
    print(
        f"ingest CPU per env step: {1e6 * cpu:.2f} us (learner loop thread + ZeroMQ I/O threads; runs: "
        f"{', '.join(f'{1e6 * v:.2f}' for v in cpu_all)}); ceiling per ingest core {1 / max(cpu, 1e-9):,.0f} "
        f"env steps/s, {100 * bytes_per_row / max(cpu, 1e-9) / 1e6 / memcpy:.1f} % of memcpy"
    )
    wire = wire_bytes_per_env_step(args.env, args.envs_per_actor, k)
    print(
        f"bytes on the wire per env step: {wire:,.0f} (rows of {bytes_per_row:,} bytes; stacked frames deduplicated)"
    )
    print(f"dropped over all ingest runs: {dropped_all}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="ALE/Breakout-v5")
    parser.add_argument("--actors", type=int, default=1, help="synthetic actor processes")
    parser.add_argument("--envs-per-actor", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; medians are reported"
    )
    parser.add_argument(
        "--steps-per-message",
        default="auto",
        help="vector steps per message: 'auto' (the learner's default for the env) or a divisor of 128",
    )
    parser.add_argument("--no-training-load", action="store_true", help="skip the GIL measurement")
    parser.add_argument(
        "--sockets-only",
        action="store_true",
        help="measure only the socket path (remote actors): memcpy, ingest through the sockets and "
        "bytes on the wire per env step",
    )
    parser.add_argument(
        "--feeder",
        choices=("encode", "replay"),
        default="encode",
        help="with --sockets-only, how the synthetic actors make each message: encode (stacks moved "
        "on, deduplicated and encoded on these same cores, as a local actor) or replay (64 "
        "messages encoded once and re-sent with fresh headers: the cores left to the learner, as "
        "with actors on other machines)",
    )
    parser.add_argument(
        "--buffer-columns",
        type=int,
        default=64,
        help="the learner's rollout buffer columns (64: a rollout is 8,192 Breakout rows, as eight "
        "actors of 8 envs fill; the stubbed update's per-rollout work then stays small)",
    )
    args = parser.parse_args()
    if args.feeder == "replay" and not args.sockets_only:
        parser.error(
            "--feeder replay: with --sockets-only (ring messages carry no arrays to replay)"
        )
    steps_per_message = (
        args.steps_per_message if args.steps_per_message == "auto" else int(args.steps_per_message)
    )

    from oakemu_core.config import OakEmuConfig
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.transport.frame_stacks import wire_bytes_per_env

    schema = schema_for_env(env_spec(args.env))
    bytes_per_row = schema.sent_bytes_per_env()
    step_bytes = bytes_per_row * args.envs_per_actor
    config = OakEmuConfig(env_id=args.env)
    wire_bytes = wire_bytes_per_env(schema)
    k, k_sockets = (
        (
            config.resolved_steps_per_message(wire_bytes, args.envs_per_actor, step_ring=ring)
            for ring in (True, False)
        )  # what the learner gives actors with and without a ring
        if steps_per_message == "auto"
        else (steps_per_message, steps_per_message)
    )
    chunk = step_bytes * k
    print(
        f"{args.env}: {args.actors} synthetic actor(s) x {args.envs_per_actor} envs, {bytes_per_row:,} bytes per "
        f"env step, {k} vector step(s) per message ({chunk / 1024:.0f} KiB) with a step ring, {k_sockets} through the "
        f"sockets only; buffers of {args.buffer_columns} columns; {args.seconds:.0f} s per figure, median of "
        f"{args.repeats} interleaved repeats, {os.cpu_count()} CPUs"
    )
    if args.sockets_only:
        print(
            f"socket messages: {'replayed (encoded once)' if args.feeder == 'replay' else 'encoded by each actor'}"
        )
        sockets_only(args, k_sockets, bytes_per_row)
        return
    loads = [""] if args.no_training_load else ["", "thread", "process"]
    figures: dict[str, list[float]] = {
        "memcpy": [],
        "in-process": [],
        "ingest-sockets": [],
        **{f"ingest{load}": [] for load in loads},
    }
    dropped_all: list[dict] = []
    cpu_per_row_all: list[float] = []
    for _ in range(args.repeats):
        figures["memcpy"].append(memcpy_mb_per_s(chunk))
        figures["in-process"].append(
            in_process_rows_per_s(args.env, args.envs_per_actor, k, args.seconds)
        )
        for load in loads:
            rate, cpu_per_row, dropped = measure_ingest(
                args.env,
                args.actors,
                args.envs_per_actor,
                args.seconds,
                load,
                steps_per_message,
                columns=args.buffer_columns,
            )
            figures[f"ingest{load}"].append(rate)
            if not load:  # with a training thread the process's CPU time is not the ingest's alone
                cpu_per_row_all.append(cpu_per_row)
            dropped_all.append(dropped)
        rate, _, dropped = measure_ingest(
            args.env,
            args.actors,
            args.envs_per_actor,
            args.seconds,
            "",
            steps_per_message,
            transport="sockets",
            columns=args.buffer_columns,
        )
        figures["ingest-sockets"].append(rate)
        dropped_all.append(dropped)
    actor_rate = measure_local(args.env, 1, args.envs_per_actor, args.seconds, with_policy=True)
    memcpy = float(np.median(figures["memcpy"]))
    ingest = float(np.median(figures["ingest"]))
    ingest_mb = ingest * bytes_per_row / 1e6
    print(f"{'measurement':<58}{'median':>14}   all runs")
    print(
        f"{'memcpy, message-sized chunks (MB/s)':<58}{memcpy:>14,.0f}   "
        f"{', '.join(f'{v:,.0f}' for v in figures['memcpy'])}"
    )
    for load, label in (
        ("", "ingest"),
        ("-sockets", "ingest through the sockets only"),
        ("thread", "ingest + training thread (shared GIL)"),
        ("process", "ingest + training process (no shared GIL)"),
    ):
        if f"ingest{load}" in figures:
            values = figures[f"ingest{load}"]
            print(
                f"{label + ' (env steps/s)':<58}{float(np.median(values)):>14,.0f}   "
                f"{', '.join(f'{v:,.0f}' for v in values)}"
            )
    sockets_mb = float(np.median(figures["ingest-sockets"])) * bytes_per_row / 1e6
    print(f"{'ingest (MB/s of message arrays)':<58}{ingest_mb:>14,.0f}")
    print(
        f"ingest / memcpy bandwidth: {100 * ingest_mb / memcpy:.1f} % (target >= 25 %; arrays through step rings, "
        f"the default for actors on the learner's machine)"
    )
    print(
        f"ingest through the sockets only / memcpy bandwidth: {100 * sockets_mb / memcpy:.1f} % ({sockets_mb:,.0f} "
        f"MB/s: actors on other machines or in other containers)"
    )
    in_process = float(np.median(figures["in-process"]))
    in_process_mb = in_process * bytes_per_row / 1e6
    print(
        f"{'in-process decode + write, no sockets (env steps/s)':<58}{in_process:>14,.0f}   "
        f"{', '.join(f'{v:,.0f}' for v in figures['in-process'])}"
    )
    print(
        f"in-process / memcpy bandwidth: {100 * in_process_mb / memcpy:.1f} % ({in_process_mb:,.0f} MB/s, "
        f"{1e6 / in_process:.2f} us per env step: the learner's own share of the ingest cost)"
    )
    cpu_per_row = float(np.median(cpu_per_row_all))
    per_core = 1 / max(cpu_per_row, 1e-9)  # no CPU tick counted: a run that wrote nothing
    per_core_mb = per_core * bytes_per_row / 1e6
    print(
        f"ingest CPU per env step: {1e6 * cpu_per_row:.2f} us (learner loop thread + ZeroMQ I/O threads; "
        f"runs: {', '.join(f'{1e6 * v:.2f}' for v in cpu_per_row_all)})"
    )
    print(
        f"estimated ingest ceiling per ingest core (1 / CPU per step): {per_core:,.0f} env steps/s, "
        f"{per_core_mb:,.0f} MB/s, {100 * per_core_mb / memcpy:.1f} % of memcpy (the synthetic actors above "
        f"share this machine's cores)"
    )
    print(
        f"one actor process (step loop, CPU inference): {actor_rate:,.0f} env steps/s; "
        f"the ingest ceiling feeds {ingest / actor_rate:.1f} such actor cores"
    )
    if not args.no_training_load:
        thread, process = (
            float(np.median(figures[f"ingest{load}"])) for load in ("thread", "process")
        )
        print(
            f"GIL cost of training in the learner process (1 - thread / process): {100 * (1 - thread / process):.1f} %"
        )
    dropped_total: dict[str, int] = {}
    for dropped in dropped_all:
        for kind, count in dropped.items():
            dropped_total[kind] = dropped_total.get(kind, 0) + int(count)
    print(f"dropped over all ingest runs: {dropped_total or 'nothing'}")


if __name__ == "__main__":
    main()
