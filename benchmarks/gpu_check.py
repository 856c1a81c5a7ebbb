"""Device check of the learner: PPO updates of the Nature CNN at the Breakout settings on ``--device``,
their overhead over a bare torch loop of the same SGD steps, and an end-to-end run in which synthetic
actors feed the training learner at its ingest ceiling.

Run it on a machine with a GPU as ``python benchmarks/gpu_check.py --device cuda`` (a few minutes;
well under 10); without ``--device`` it takes CUDA when torch sees a GPU, else the CPU.
``--quick`` is the CPU fallback at tiny sizes (seconds; what the tests run). The settings are the
``atari`` preset's (``oakemu_core/presets/atari.toml``: 8 envs x 128 steps, 4 epochs of 4 minibatches
of 256 rows); ``--preset`` takes another preset's (``cartpole``: the MLP update whose time decides
synchronous CartPole's throughput on a CPU), ``--envs``, ``--steps`` and ``--actors`` change the sizes.

Printed, all measured in the same run:

1. Per update, on real Breakout rollouts (the env stepped in this process by a CPU actor whose weights
   follow the learner's): observation uploads to the device during the update (expected: 1, the cached
   upload reused by every epoch), the first-minibatch PPO ratio deviation from 1 (actor on the CPU vs
   learner on the device; expected < 1e-5, CUDA's TF32 being off), seconds per epoch, and the
   update's seconds through the production path (``PPOLearner.update`` of the learner's ``Trainer``:
   its model, fused Adam, ``PPOUpdater``) next to a bare torch loop of the same SGD steps on the same
   rows (a copy of the model; the rollout uploaded once, then per minibatch of the same shape:
   forward, a policy-gradient + value + entropy loss, backward, Adam step; no ratio, clipping,
   gradient-norm clip, statistics or locks).
2. ``update``: the medians over the updates after the first (the first warms the kernels up) of both
   times, and ``production / bare``, the overhead of the production path (expected near 1; what is
   above it is the PPO bookkeeping, whose many small kernels weigh more on a GPU than on a CPU). On
   a loaded machine each figure varies by tens of percent between updates.
3. ``end to end``: synthetic actors (``benchmarks/bench_ingest.py``'s ``measure_ingest``: real joins,
   step rings, Atari-sized step messages sent as fast as the learner takes them) feed the in-process
   learner (``oakemu_services.learner.Learner``) whose trainer really trains: the env steps/s
   trained (rows of the updates after the first, over the time between their ends), the env steps/s
   ingested, the update time within the run, the training ceiling (rows per update / update time)
   and the share of the time the trainer is busy (near 100 %: training is the limit; well below:
   ingest is).

On a GPU the trained rate should approach the lower of the ingest ceiling and the training ceiling;
on the CPU training is the limit by far.

``--compile-update MODE`` runs the production update with that ``compile_update`` (``default`` or
``reduce-overhead``: :mod:`oakemu_core.algo.compiled_update`); the bare loop stays eager, so
``production / bare`` below 1 is what compiling won over plain eager SGD steps. The first update
then includes the compile (printed as ``first update``; the second compiles the decoupled objective's
signature), and a line says how many signatures were compiled and whether the update fell back to
eager (``compile`` in the JSON). ``--seconds 0`` leaves out the end-to-end
part; ``--json FILE`` also writes every figure to FILE (one object: part 1's when it ends, then
all of them).

Usage: ``python benchmarks/gpu_check.py [--device cuda] [--updates 5] [--envs 8] [--steps 128]
[--actors 1] [--seconds 30] [--torch-threads N] [--compile-update MODE] [--json FILE] [--quick]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_ingest import measure_ingest  # noqa: E402
from oakemu_core.actor.stepper import PolicyStepper  # noqa: E402
from oakemu_core.algo.learner import PPOLearner  # noqa: E402
from oakemu_core.algo.trainer import Trainer  # noqa: E402
from oakemu_core.config import OakEmuConfig, resolved_device  # noqa: E402
from oakemu_core.envs import make_vector_env  # noqa: E402
from oakemu_core.errors import ConfigError  # noqa: E402
from oakemu_core.policy.models import load_weight_arrays  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env  # noqa: E402
from oakemu_core.presets import load_preset, preset_names  # noqa: E402
from oakemu_core.storage.buffer_ring import FullRollout  # noqa: E402
from oakemu_core.storage.rollout_buffer import RolloutBuffer  # noqa: E402

QUICK = {"updates": 2, "envs": 2, "steps": 16, "actors": 1, "seconds": 4.0, "torch_threads": 1}
"""``--quick``: the CPU fallback's sizes (a rollout of 32 rows, minibatches of 8) on one torch thread
(steadier times on a loaded machine)."""


@dataclass(frozen=True)
class UpdateRow:
    """One update of part 1: uploads, ratio deviation, seconds per epoch, seconds of the production
    update and of the bare loop, policy loss and approximate KL."""

    uploads: int
    ratio_deviation: float
    seconds_per_epoch: float
    production_s: float
    bare_s: float
    policy_loss: float
    approx_kl: float


def preset_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--preset``'s settings with this check's device and sizes, no evaluation, checkpoint or
    rollback (nothing but the updates runs)."""
    return {
        **load_preset(args.preset).settings,
        "device": args.device,
        "num_envs": args.envs,
        "rollout_length": args.steps,
        "eval_every_updates": 0,
        "checkpoint_every_updates": 0,
        "rollback": False,
        "log_level": "WARNING",
        "compile_update": args.compile_update,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_update_seconds(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    buffer: RolloutBuffer,
    config: OakEmuConfig,
    rng: np.random.Generator,
) -> float:
    """Wall seconds of ``ppo_epochs`` x ``num_minibatches`` plain SGD steps on ``buffer``'s rows: the
    rows uploaded to the model's device once, then per shuffled minibatch forward, loss
    ``-mean(log pi(a|s) A) + vf_coef mean((V - R)^2) - ent_coef mean(entropy)``, backward, optimizer
    step (the work any PPO update does, without its bookkeeping)."""
    device = next(model.parameters()).device
    schema, rows = buffer.schema, buffer.total_size
    start = time.perf_counter()
    fields = {
        name: torch.from_numpy(buffer.field(name).reshape(rows, *schema[name].shape).copy()).to(
            device
        )
        for name in (*schema.observation_names, "actions")
    }
    advantages = torch.from_numpy(buffer.advantages.reshape(rows).copy()).to(device)
    returns = torch.from_numpy(buffer.returns.reshape(rows).copy()).to(device)
    size = rows // config.num_minibatches
    model.train()
    for _ in range(config.ppo_epochs):
        order = torch.from_numpy(rng.permutation(rows)).to(device)
        for first in range(0, size * config.num_minibatches, size):
            index = order[first : first + size]
            policy, values = model.policy_and_values(
                schema.join_observations(
                    {name: fields[name][index] for name in schema.observation_names}
                )
            )
            loss = (
                -(policy.log_prob(fields["actions"][index]) * advantages[index]).mean()
                + config.vf_coef * (values - returns[index]).square().mean()
                - config.ent_coef * policy.entropy().mean()
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    _synchronize(device)
    return time.perf_counter() - start


def update_rows(
    args: argparse.Namespace, config: OakEmuConfig, device: str
) -> tuple[list[UpdateRow], dict[str, Any]]:
    """Part 1: ``args.updates`` rollouts of real Breakout steps, each trained by the production path
    (timed) and then by the bare loop on a copy of the model (timed); each row printed as it comes
    (:func:`print_update_row`). Returns the rows and what the compiled update did
    (:func:`compile_state`)."""
    # One emulator thread: idle emulator threads would compete with torch's for the cores while the
    # updates are timed.
    env = make_vector_env(config.env_id, config.num_envs, seed=1, num_threads=1)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(
                config, env.spec, schema_for_env(env.spec), Path(run_dir), device=device
            )
            try:
                learner = trainer.ppo
                bare_model = copy.deepcopy(learner.model)
                bare_optimizer = torch.optim.Adam(
                    bare_model.parameters(),
                    lr=config.learning_rate,
                    eps=1e-5,
                    fused=learner.device.type in ("cpu", "cuda"),
                )
                stepper = PolicyStepper(
                    env,
                    copy.deepcopy(learner.model).to("cpu"),
                    policy_version=learner.policy_version,
                )
                rng = np.random.default_rng(1)
                with RolloutBuffer(
                    config.rollout_length, config.num_envs, schema=stepper.schema, seed=1
                ) as buffer:
                    rows: list[UpdateRow] = []
                    for _ in range(args.updates):
                        rows.append(
                            _one_update(trainer, stepper, buffer, bare_model, bare_optimizer, rng)
                        )
                        print_update_row(len(rows), rows[-1])
                    return rows, compile_state(learner.updater.minibatch_loss)
            finally:
                trainer.close()
    finally:
        env.close()


def _one_update(
    trainer: Trainer,
    stepper: PolicyStepper,
    buffer: RolloutBuffer,
    bare_model: torch.nn.Module,
    bare_optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
) -> UpdateRow:
    """Collect one rollout with the actor's weights equal to the learner's, train it through the
    production path, then through the bare loop; the actor takes the new weights."""
    learner = trainer.ppo
    buffer.reset()
    for _ in range(buffer.rollout_length):
        row = stepper.step()
        row.buffers.add_to_rollout_buffer(buffer, policy_version=row.policy_version)
    prepared = learner.prepare(FullRollout(0, buffer, row.next_values, buffer.dones[-1].copy()))
    uploads_before = buffer.observation_uploads
    _synchronize(learner.device)
    start = time.perf_counter()
    stats = learner.update(prepared)
    production = time.perf_counter() - start
    assert stats is not None, "a rollout of the current policy has trainable rows"
    uploads = buffer.observation_uploads - uploads_before
    bare = bare_update_seconds(bare_model, bare_optimizer, buffer, trainer.config, rng)
    load_weight_arrays(stepper.model, trainer.weights())  # as the learner publishes them
    stepper.policy_version = learner.policy_version
    return UpdateRow(
        uploads,
        stats.first_minibatch_ratio_max_abs_dev,
        production / max(1, stats.epochs_completed),
        production,
        bare,
        stats.policy_loss,
        stats.approx_kl,
    )


def compile_state(loss: Any) -> dict[str, Any]:
    """What a :class:`~oakemu_core.algo.compiled_update.MinibatchLoss` did: its mode, whether it
    still runs compiled (False after a failed compile, and for ``none``), the signatures compiled
    and the minibatches run eagerly for want of room. Printed in one line."""
    state = {
        "mode": loss.mode,
        "still_compiled": loss.compiled,
        "signatures": sorted(loss.signatures),
        "eager_minibatches": loss.eager_signatures,
    }
    if loss.mode != "none":
        print(
            f"compile_update {loss.mode}: {len(loss.signatures)} signature(s) compiled, "
            f"{'still compiled' if loss.compiled else 'FELL BACK TO EAGER (see the log)'}, "
            f"{loss.eager_signatures} minibatch(es) eager for want of room"
        )
    return state


def timed_learner(records: list[tuple[float, float, int]]) -> type[PPOLearner]:
    """A :class:`PPOLearner` that appends ``(end time, update seconds, rows trained)`` to ``records``
    after each update (``time.perf_counter`` seconds)."""

    class TimedLearner(PPOLearner):
        def update(self, rollout: Any) -> Any:
            _synchronize(self.device)
            start = time.perf_counter()
            stats = super().update(rollout)
            end = time.perf_counter()
            records.append((end, end - start, 0 if stats is None else stats.trainable_rows))
            return stats

    return TimedLearner


def end_to_end(
    args: argparse.Namespace, settings: dict[str, Any]
) -> tuple[float, list[tuple[float, float, int]]]:
    """Part 3: ingested env steps/s and the update records of a learner that trains what the
    synthetic actors send."""
    records: list[tuple[float, float, int]] = []
    overrides = {
        name: value
        for name, value in settings.items()
        if name not in ("env_id", "num_envs", "log_level")
    }
    ingested, _, _ = measure_ingest(
        settings["env_id"],
        args.actors,
        args.envs // args.actors,
        args.seconds,
        columns=args.envs,
        learner_type=timed_learner(records),
        **overrides,
    )
    return ingested, records


def _median(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)  # the first update warms up


def print_update_row(number: int, row: UpdateRow) -> None:
    """One row of part 1's table (the header before the first), flushed: a run cut short keeps it."""
    if number == 1:
        print(
            f"{'update':>6} {'uploads':>8} {'ratio dev':>11} {'s/epoch':>8} {'production s':>13} {'bare s':>9} "
            f"{'policy loss':>12} {'approx kl':>10}"
        )
    print(
        f"{number:>6} {row.uploads:>8} {row.ratio_deviation:>11.2e} {row.seconds_per_epoch:>8.3f} "
        f"{row.production_s:>13.4f} {row.bare_s:>9.4f} {row.policy_loss:>12.4f} {row.approx_kl:>10.5f}",
        flush=True,
    )


def report_updates(rows: list[UpdateRow]) -> dict[str, Any]:
    """Print the medians of part 1; returns its figures (:func:`main`'s ``--json``)."""
    production = _median([row.production_s for row in rows])
    bare = _median([row.bare_s for row in rows])
    print(
        f"update (median after the first): production {1e3 * production:.2f} ms, bare loop {1e3 * bare:.2f} ms, "
        f"production / bare {production / bare:.3f}; first update {rows[0].production_s:.2f} s"
    )
    return {
        "updates": [vars(row) for row in rows],
        "production_ms": 1e3 * production,
        "bare_ms": 1e3 * bare,
        "production_over_bare": production / bare,
        "first_update_s": rows[0].production_s,
        "ratio_deviation_max": max(row.ratio_deviation for row in rows),
    }


def report_end_to_end(
    ingested: float, records: list[tuple[float, float, int]], rows_per_update: int
) -> dict[str, float]:
    """Print the end-to-end line; returns its figures."""
    if len(records) < 2:
        raise SystemExit(
            f"end to end: {len(records)} update(s) in the run; a rate needs 2 (raise --seconds)"
        )
    trained = sum(rows for _, _, rows in records[1:]) / (records[-1][0] - records[0][0])
    update = _median([seconds for _, seconds, _ in records])
    ceiling = rows_per_update / update
    print(
        f"end to end: {trained:,.0f} env steps/s trained over {len(records) - 1} updates, {ingested:,.0f} env "
        f"steps/s ingested; update {1e3 * update:.2f} ms (median) = training ceiling {ceiling:,.0f} env steps/s; "
        f"trainer busy {100 * trained / ceiling:.1f} %"
    )
    return {
        "trained_env_steps_per_s": trained,
        "ingested_env_steps_per_s": ingested,
        "updates": len(records) - 1,
        "update_ms": 1e3 * update,
        "training_ceiling_env_steps_per_s": ceiling,
        "trainer_busy_percent": 100 * trained / ceiling,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="the learner's torch device (default: cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--preset",
        default="atari",
        choices=preset_names(),
        help="the preset whose settings and env the check uses (default: atari, Breakout)",
    )
    parser.add_argument(
        "--updates", type=int, default=5, help="updates of part 1; the first is a warm-up"
    )
    parser.add_argument(
        "--envs", type=int, default=None, help="envs per rollout (default: the preset's)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per rollout (default: the preset's)"
    )
    parser.add_argument(
        "--actors", type=int, default=1, help="synthetic actor processes end to end; divides --envs"
    )
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="length of the end-to-end run (0: none)"
    )
    parser.add_argument(
        "--compile-update",
        default="none",
        choices=("none", "default", "reduce-overhead"),
        help="the production update's compile_update (the bare loop stays eager)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every figure to this JSON file"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads of this process (default: torch's, one per core)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes for the CPU fallback (those not given): "
        + ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in QUICK.items()),
    )
    args = parser.parse_args(argv)
    preset = load_preset(args.preset).settings
    if args.quick:  # the sizes not given on the command line
        given = {arg.split("=")[0][2:].replace("-", "_") for arg in (argv or sys.argv[1:])}
        vars(args).update({name: value for name, value in QUICK.items() if name not in given})
    args.envs = args.envs or preset["num_envs"]
    args.steps = args.steps or preset["rollout_length"]
    if (
        min(args.updates, args.envs, args.steps, args.actors, args.torch_threads or 1) < 1
        or args.envs % args.actors
        or args.seconds < 0
    ):
        parser.error(
            "expected --updates, --envs, --steps, --actors, --torch-threads >= 1, --seconds >= 0 "
            "and --actors dividing --envs"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = preset_settings(args)
    try:
        config = OakEmuConfig(**settings)
        device = resolved_device(config)
    except (ConfigError, ValueError) as error:
        print(f"gpu_check: {error}".splitlines()[0], file=sys.stderr)
        return 2
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    print(
        f"device {device} ({name}), {config.env_id}, rollout {config.rollout_length} x {config.num_envs}, "
        f"{config.ppo_epochs} epochs x {config.num_minibatches} minibatches of "
        f"{config.batch_size // config.num_minibatches} rows, torch threads {torch.get_num_threads()}"
    )
    figures: dict[str, Any] = {
        "device": device,
        "device_name": name,
        "preset": args.preset,
        "env_id": config.env_id,
        "rollout": [config.rollout_length, config.num_envs],
        "epochs": config.ppo_epochs,
        "minibatches": config.num_minibatches,
        "compile_update": args.compile_update,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    torch.manual_seed(1)
    rows, figures["compile"] = update_rows(args, config, device)
    figures["update"] = report_updates(rows)
    _write_json(args.json, figures)  # part 1 kept, should part 3 not end
    if args.seconds > 0:
        ingested, records = end_to_end(args, settings)
        figures["end_to_end"] = report_end_to_end(ingested, records, config.batch_size)
    if device.startswith("cuda"):
        figures["peak_device_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        print(f"peak device memory {figures['peak_device_memory_mib']:.0f} MiB")
    _write_json(args.json, figures)
    return 0


def _write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """``figures`` as one JSON object in ``path`` (None: nothing), replaced whole."""
    if path is not None:
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
        temporary.replace(path)


if __name__ == "__main__":
    sys.exit(main())
