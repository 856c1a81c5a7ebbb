"""Many remote actors against one learner: N simulated actors, each with its own ZeroMQ sockets and
actor id, stream through the sockets (``step_transport = "sockets"``, as actors on other machines
do) into ONE learner on this machine.

Each simulated actor is a :class:`benchmarks.synthetic_actors.SyntheticActor` (joins, heartbeats,
picks up weights, waits as a real asynchronous actor does once it acted two segments with one
policy version, re-sends one real vector step) that sleeps to hold ``--actor-sps`` env steps per
second (a real actor core's rate; ``--envs-per-actor`` envs, so a message of K vector steps goes
every ``envs x K / actor-sps`` seconds). N actors cannot each be a process on a small machine:
``--actor-processes`` processes run N / processes actors each, one thread per actor. The learner is
the real :class:`oakemu_services.learner.Learner` in a process of its own, in the asynchronous mode,
with PPO switched off (:class:`benchmarks.synthetic_actors.NewVersionNoUpdateLearner`: full buffers
are released at once, each as a new policy version with the same weights, so the figures are the
learner's ingest, not a training speed, while actors pace themselves and lag as in training). Its
rollout buffers hold every actor's envs (``num_envs = N x envs``; ``--buffer-columns`` for fewer,
so that actors compete for columns): a buffer is then full only when every actor wrote a segment,
and actors that are two segments ahead wait for it, so equal actors get equal shares. CartPole by
default (``--env``), so 256 actors' buffers fit in memory. On a machine of few cores the actors and
the learner share them: the ingest printed is then what the machine feeds, and the CPU line says
which side took the cores.

Printed per N, in this order:

* join storm: every actor sends its join in the same instant (all actor processes started and
  their actors built first): seconds until the learner has accepted all N joins, until every actor
  has had steps written, and joins refused;
* steady state over ``--seconds``: ingest (env steps/s written) against what the actors offer
  (N x actor-sps), each actor's share (min / median / max of its env steps/s written, and Jain's
  fairness index ``(sum x)^2 / (N sum x^2)``: 1 is an even share, 1/N one actor takes all), policy
  lag at arrival (learner version - version that acted, in versions: mean of the per-actor means
  over 1 s windows, and the largest), the learner's CPU per env step (its loop thread and ZeroMQ
  I/O threads) and that of the learner and actor processes, and the learner's resident memory (RSS,
  MiB) idle before the joins, at the start and the end of the window, the highest of each half of
  the window (growth that does not level off shows as a second half above the first), and its peak;
* learner restart: the learner process is killed (SIGKILL, as a crash) and a new one started on
  the same ports; seconds until it is up, until all N actors joined it again and until every one of
  them has had steps written, and how many actors came back.

Usage: ``python benchmarks/bench_many_actors.py [--actors 64 256] [--seconds 20] [--env CartPole-v1]
[--envs-per-actor 4] [--actor-sps 2000] [--actor-processes 4]``
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_ingest import ingest_cpu_s  # noqa: E402
from benchmarks.bench_pipeline import _free_ports  # noqa: E402
from benchmarks.synthetic_actors import SyntheticActor, no_update_learner  # noqa: E402

WAIT_S = 120.0
"""Longest wait for a phase (learner start, actors built, all joined or stepping)."""


# ----------------------------------------------------------------------------------- the learner
def process_cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far (Linux ``/proc``; 0.0 when
    it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (proc(5))


def learner_stats(learner, thread: threading.Thread) -> dict:
    """What the harness reads from the learner process: its clock, counters, per-actor records
    ``{actor_id: (incarnation, env steps written, joined_at, (lag low, mean, high) or None)}``,
    memory (MiB) and the CPU seconds of its ingest threads and of the whole process."""
    counters = learner.assembler.counters
    records = list(learner.assembler.actors.values())  # one C call: safe beside the loop thread
    status = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return {
        "now": time.monotonic(),
        "alive": thread.is_alive(),
        "env_steps": counters.env_steps,
        "version": learner.policy_version,
        "cpu_s": ingest_cpu_s(thread.native_id),
        "process_cpu_s": process_cpu_s(),
        "actors": {
            r.actor_id: (r.incarnation, r.env_steps, r.joined_at, r.lag_stats) for r in records
        },
        "accepted": dict(counters.accepted),
        "rejected": dict(counters.rejected),
        "dropped": dict(counters.dropped),
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
    }


def learner_process(settings: dict, run_dir: str, conn) -> None:
    """The learner (PPO switched off) of ``settings`` (:class:`OakEmuConfig` fields); answers
    ``"stats"`` on ``conn`` with :func:`learner_stats` until ``"stop"`` (then a clean stop)."""
    import torch

    from oakemu_core.config import OakEmuConfig

    torch.set_num_threads(1)
    learner = no_update_learner(OakEmuConfig(**settings), Path(run_dir), new_versions=True)
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
    thread.start()
    try:
        conn.send("ready")
        while conn.recv() == "stats":
            conn.send(learner_stats(learner, thread))
    finally:
        stop.set()
        thread.join(60)
        learner.close()


class LearnerHandle:
    """The learner's process: started, asked for stats, killed (a crash) or stopped. Every pid it
    started is kept in :attr:`pids` (their shared-memory segments are removed by :meth:`cleanup`)."""

    def __init__(self, settings: dict, run_dir: Path) -> None:
        self.settings, self.run_dir = settings, run_dir
        self.process: mp.Process | None = None
        self.conn = None
        self.pids: list[int] = []

    def start(self) -> float:
        """Start a learner process; returns the seconds until it serves."""
        start = time.monotonic()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=learner_process, args=(self.settings, str(self.run_dir), child)
        )
        self.process.start()
        self.pids.append(self.process.pid)
        if not self.conn.poll(WAIT_S) or self.conn.recv() != "ready":
            raise RuntimeError(f"the learner did not start within {WAIT_S:.0f} s")
        return time.monotonic() - start

    def stats(self) -> dict:
        assert self.conn is not None
        self.conn.send("stats")
        if not self.conn.poll(30):
            raise RuntimeError("the learner process did not answer for 30 s")
        stats = self.conn.recv()
        if not stats["alive"]:
            raise RuntimeError("the learner's loop thread has ended")
        return stats

    def kill(self) -> None:
        """SIGKILL the learner process (its sockets close; its shared memory stays until swept)."""
        if self.process is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(30)

    def stop(self) -> None:
        """Stop cleanly (actors get the stop notice); kill after 60 s."""
        if self.process is None or not self.process.is_alive():
            return
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.process.join(60)
        self.kill()

    def cleanup(self) -> None:
        """Kill what still runs and remove the shared-memory segments of every learner pid started."""
        from oakemu_core.shared_memory import parse_segment_owner

        self.kill()
        shm = Path("/dev/shm")
        if shm.is_dir():
            for path in shm.iterdir():
                if parse_segment_owner(path.name) in self.pids:
                    path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ the actors
def drive(
    actor: SyntheticActor,
    actor_sps: float,
    go: threading.Event,
    stop: threading.Event,
    outcomes: dict,
) -> None:
    """One simulated actor: join at ``go``, then a message every ``env steps per message / actor_sps``
    seconds (no debt kept when behind) until ``stop``; ``outcomes[actor id]`` says how it ended."""
    from oakemu_core.actor.client import ActorSetupError, LearnerUnreachable

    outcome = {"error": "", "rejoins": 0}
    go.wait()
    try:
        actor.join()
        interval, due = actor.env_steps_per_message / actor_sps, time.monotonic()
        while not stop.is_set():
            actor.send_next(hold_ahead=True)
            due += interval
            delay = due - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                due = time.monotonic()
    except (ActorSetupError, LearnerUnreachable) as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    except KeyboardInterrupt:  # stopped while joining
        pass
    except Exception as error:  # noqa: BLE001 - reported by the harness, never lost in a thread
        outcome["error"] = repr(error)
    finally:
        outcome["rejoins"] = actor.rejoins
        actor.close()
        outcomes[actor.actor.actor_id] = outcome


def actor_host(
    env_id: str,
    num_envs: int,
    ports: list[int],
    actor_ids: list[str],
    actor_sps: float,
    ready,
    go,
    stop,
    results,
) -> None:
    """A process of simulated actors, one thread each: builds them (no network), says ``ready``,
    lets them join at ``go`` and stream until ``stop``; then puts their outcomes on ``results``."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("oakemu").setLevel(logging.ERROR)  # N actors' rejoin warnings after a restart
    local_go, local_stop, outcomes = threading.Event(), threading.Event(), {}
    actors = [
        SyntheticActor(env_id, num_envs, ports, actor_id, local_stop, "sockets")
        for actor_id in actor_ids
    ]
    threads = [
        threading.Thread(
            target=drive, args=(actor, actor_sps, local_go, local_stop, outcomes), daemon=True
        )
        for actor in actors
    ]
    for thread in threads:
        thread.start()
    ready.put(os.getpid())
    parent = os.getppid()
    while not go.wait(1.0) and os.getppid() == parent:
        pass
    local_go.set()
    while not stop.wait(1.0) and os.getppid() == parent:  # an orphan stops too
        pass
    local_stop.set()
    for thread in threads:
        thread.join(30)
    results.put(outcomes)


class ActorHosts:
    """``processes`` actor processes sharing the ids ``actor-0 .. actor-{n-1}`` round robin."""

    def __init__(
        self, env_id: str, num_envs: int, ports: list[int], n: int, processes: int, actor_sps: float
    ) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.results, self.go, self.stop = (
            ctx.Queue(),
            ctx.Queue(),
            ctx.Event(),
            ctx.Event(),
        )
        ids = [f"actor-{i}" for i in range(n)]
        self.processes = [
            ctx.Process(
                target=actor_host,
                daemon=True,
                args=(
                    env_id,
                    num_envs,
                    ports,
                    ids[p::processes],
                    actor_sps,
                    self.ready,
                    self.go,
                    self.stop,
                    self.results,
                ),
            )
            for p in range(min(processes, n))
        ]

    def start(self) -> None:
        """Start the processes and wait until each has built its actors."""
        for process in self.processes:
            process.start()
        for _ in self.processes:
            self.ready.get(timeout=WAIT_S)

    def cpu_s(self) -> float:
        """CPU seconds the actor processes used so far."""
        return sum(
            process_cpu_s(process.pid) for process in self.processes if process.pid is not None
        )

    def close(self) -> dict:
        """Stop the actors (they leave) and the processes; returns every actor's outcome."""
        self.stop.set()
        outcomes: dict = {}
        for process in self.processes:
            if process.pid is None:
                continue
            try:
                outcomes.update(self.results.get(timeout=60))
            except Exception:  # noqa: BLE001 - a process that died: its actors have no outcome
                pass
        for process in self.processes:
            if process.pid is not None:
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join(10)
        return outcomes


# ------------------------------------------------------------------------------------ the phases
def wait_all_stepping(learner: LearnerHandle, n: int, since: float) -> dict:
    """Poll the learner until all ``n`` actors joined and had steps written (or :data:`WAIT_S`);
    seconds from ``since`` (monotonic) to the last join and to the poll that saw all stepping."""
    deadline, joined_s, stepping_s = time.monotonic() + WAIT_S, None, None
    while time.monotonic() < deadline:
        stats = learner.stats()
        actors = stats["actors"]
        if len(actors) >= n and joined_s is None:
            joined_s = max(joined_at for _, _, joined_at, _ in actors.values()) - since
        stepping = sum(1 for _, steps, _, _ in actors.values() if steps > 0)
        if stepping >= n:
            stepping_s = stats["now"] - since
            break
        time.sleep(0.2)
    refused = stats["accepted"].get("join_refused", 0) + stats["rejected"].get("impersonation", 0)
    return {
        "joined_s": joined_s,
        "stepping_s": stepping_s,
        "joined": len(actors),
        "stepping": stepping,
        "refused": refused,
        "joins": stats["accepted"].get("join", 0),
    }


def steady_window(learner: LearnerHandle, hosts: ActorHosts, n: int, seconds: float) -> dict:
    """Ingest, each actor's share, policy lag, CPU use and learner memory over ``seconds``."""
    first, actors_cpu = learner.stats(), hosts.cpu_s()
    lag_means, lag_highs, rss = [], [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        last = learner.stats()
        rss.append(last["rss_mib"])
        for _, _, _, lag in last["actors"].values():
            if lag is not None:
                lag_means.append(lag[1])
                lag_highs.append(lag[2])
    elapsed = last["now"] - first["now"]
    actors_cpu = hosts.cpu_s() - actors_cpu
    rates = []
    for actor_id in (f"actor-{i}" for i in range(n)):
        incarnation, steps, _, _ = last["actors"].get(actor_id, ("", 0, 0.0, None))
        before = first["actors"].get(actor_id)
        rates.append((steps - (before[1] if before and before[0] == incarnation else 0)) / elapsed)
    rates_array = np.array(rates)
    rows = last["env_steps"] - first["env_steps"]
    lost = {
        k: v - first["dropped"].get(k, 0)
        for k, v in last["dropped"].items()
        if v - first["dropped"].get(k, 0)
    }
    return {
        "ingest": rows / elapsed,
        "min": float(rates_array.min()),
        "median": float(np.median(rates_array)),
        "max": float(rates_array.max()),
        "zero": int((rates_array == 0).sum()),
        "jain": float(rates_array.sum() ** 2 / (n * (rates_array**2).sum()))
        if rates_array.any()
        else 0.0,
        "lag_mean": float(np.mean(lag_means)) if lag_means else float("nan"),
        "lag_max": float(max(lag_highs)) if lag_highs else float("nan"),
        "versions_per_s": (last["version"] - first["version"]) / elapsed,
        "cpu_us": 1e6 * (last["cpu_s"] - first["cpu_s"]) / max(rows, 1),
        "cpu_share": (last["cpu_s"] - first["cpu_s"]) / elapsed,
        "process_share": (last["process_cpu_s"] - first["process_cpu_s"]) / elapsed,
        "actors_share": actors_cpu / elapsed,
        "rss_halves_mib": (max(rss[: len(rss) // 2] or rss), max(rss[len(rss) // 2 :])),
        "rss_start_mib": first["rss_mib"],
        "rss_mib": last["rss_mib"],
        "peak_mib": last["peak_mib"],
        "dropped": lost,
    }


def restart(learner: LearnerHandle, n: int) -> dict:
    """Kill the learner, start a new one on the same ports; how long until all ``n`` actors step again."""
    killed = time.monotonic()
    learner.kill()
    up_s = time.monotonic() - killed
    up_s += learner.start()
    result = wait_all_stepping(learner, n, killed)
    result["up_s"] = up_s
    result["rss_mib"] = learner.stats()["rss_mib"]
    return result


def run_many(
    n: int,
    *,
    env_id: str = "CartPole-v1",
    envs_per_actor: int = 4,
    actor_sps: float = 2000.0,
    processes: int = 4,
    seconds: float = 20.0,
    warmup_s: float = 3.0,
    columns: int | None = None,
) -> dict:
    """One learner (``columns`` buffer columns, None: ``n x envs_per_actor``) and ``n`` simulated
    remote actors: join storm, steady window, restart. Returns
    ``{"storm", "steady", "restart", "idle_rss_mib", "outcomes", "learner_pids", "actor_pids"}`` (see
    the module docstring; ``outcomes``: ``{actor_id: {"error", "rejoins"}}``);
    every process started is stopped and the learners' shared memory removed, also on errors."""
    ports = _free_ports(5)
    with tempfile.TemporaryDirectory() as runs_dir:
        settings = dict(
            env_id=env_id,
            num_actors=n,
            envs_per_actor=envs_per_actor,
            num_envs=columns,
            total_env_steps=10**12,
            mode="async",
            data_port=ports[0],
            control_port=ports[1],
            weights_port=ports[2],
            telemetry_port=ports[3],
            metrics_port=0,
            runs_dir=runs_dir,
            run_name="bench",
            checkpoint_every_updates=0,
            step_transport="sockets",
            eval_every_updates=0,
            rollback=False,
            log_level="WARNING",
        )
        learner = LearnerHandle(settings, Path(runs_dir) / "bench")
        hosts = ActorHosts(env_id, envs_per_actor, ports, n, processes, actor_sps)
        result: dict = {}
        try:
            learner.start()
            result["idle_rss_mib"] = learner.stats()["rss_mib"]
            hosts.start()
            go = time.monotonic()
            hosts.go.set()
            result["storm"] = wait_all_stepping(learner, n, go)
            time.sleep(warmup_s)
            result["steady"] = steady_window(learner, hosts, n, seconds)
            result["restart"] = restart(learner, n)
        finally:
            result["outcomes"] = hosts.close()
            learner.stop()
            learner.cleanup()
            result["learner_pids"] = list(learner.pids)
            result["actor_pids"] = [p.pid for p in hosts.processes if p.pid is not None]
    return result


# -------------------------------------------------------------------------------------- printing
def _s(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def report(n: int, result: dict, args: argparse.Namespace) -> str:
    """The lines of one N, and returns its table row."""
    storm, steady, again = result["storm"], result["steady"], result["restart"]
    errors = {actor_id: o["error"] for actor_id, o in result["outcomes"].items() if o["error"]}
    print(
        f"\n{n} actors x {args.envs_per_actor} envs, {args.actor_sps:,.0f} env steps/s each "
        f"(offered {n * args.actor_sps:,.0f}):"
    )
    print(
        f"  join storm: all {storm['joined']} joined after {_s(storm['joined_s'])} s, {storm['stepping']} stepping "
        f"after {_s(storm['stepping_s'])} s; joins granted {storm['joins']}, refused {storm['refused']}"
    )
    print(
        f"  ingest {steady['ingest']:,.0f} env steps/s ({100 * steady['ingest'] / (n * args.actor_sps):.0f} % of "
        f"offered); per actor min {steady['min']:,.0f} / median {steady['median']:,.0f} / max {steady['max']:,.0f}"
        f" ({steady['zero']} with none), Jain {steady['jain']:.3f}"
    )
    print(
        f"  policy lag at arrival: mean {steady['lag_mean']:.2f}, max {steady['lag_max']:.0f} versions "
        f"({steady['versions_per_s']:.2f} versions/s); dropped {steady['dropped'] or 'nothing'}"
    )
    print(
        f"  CPU: learner ingest {steady['cpu_us']:.1f} us per env step, ingest threads {100 * steady['cpu_share']:.0f} "
        f"% of a core, learner process {100 * steady['process_share']:.0f} %, actor processes "
        f"{100 * steady['actors_share']:.0f} % ({os.cpu_count()} cores)"
    )
    print(
        f"  learner RSS: {result['idle_rss_mib']:.0f} MiB idle, {steady['rss_start_mib']:.0f} -> {steady['rss_mib']:.0f} "
        f"MiB over the steady window (highest in its first / second half: {steady['rss_halves_mib'][0]:.0f} / "
        f"{steady['rss_halves_mib'][1]:.0f}), peak "
        f"{steady['peak_mib']:.0f} MiB; after the restart {again['rss_mib']:.0f} MiB"
    )
    print(
        f"  restart: learner up after {again['up_s']:.1f} s, {again['joined']} joined after {_s(again['joined_s'])} s,"
        f" {again['stepping']} stepping after {_s(again['stepping_s'])} s"
    )
    print(
        f"  actors ended with an error: {len(errors)}{'' if not errors else ' e.g. ' + next(iter(errors.values()))}"
    )
    return (
        f"| {n} | {steady['ingest']:,.0f} | {steady['min']:,.0f} / {steady['median']:,.0f} / {steady['max']:,.0f} "
        f"| {steady['jain']:.3f} | {steady['lag_mean']:.2f} / {steady['lag_max']:.0f} | {result['idle_rss_mib']:.0f} "
        f"/ {steady['rss_mib']:.0f} / {steady['peak_mib']:.0f} | {_s(storm['joined_s'])} / {_s(storm['stepping_s'])}"
        f" / {storm['refused']} | {again['up_s']:.1f} / {_s(again['stepping_s'])} / {again['stepping']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--actors",
        type=int,
        nargs="+",
        default=[64, 256],
        help="numbers of simulated actors, one run each",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the steady window")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--envs-per-actor", type=int, default=4)
    parser.add_argument(
        "--actor-sps", type=float, default=2000.0, help="env steps/s each simulated actor holds"
    )
    parser.add_argument(
        "--actor-processes", type=int, default=4, help="processes the simulated actors share"
    )
    parser.add_argument(
        "--buffer-columns",
        type=int,
        help="the learner's rollout buffer columns (default: actors x envs)",
    )
    args = parser.parse_args(argv)
    if (
        min(args.actors) < 1
        or args.seconds <= 0
        or args.actor_sps <= 0
        or args.actor_processes < 1
        or (args.buffer_columns is not None and args.buffer_columns < args.envs_per_actor)
    ):
        parser.exit(
            2,
            "bench_many_actors: --actors, --seconds, --actor-sps and --actor-processes must be positive, "
            "--buffer-columns at least --envs-per-actor\n",
        )
    columns = (
        f"{args.buffer_columns} buffer columns"
        if args.buffer_columns
        else "buffer columns = actors x envs"
    )
    print(
        f"{args.env}: one learner (PPO off, async, sockets only, {columns}), simulated remote actors of {args.envs_per_actor} "
        f"envs at {args.actor_sps:,.0f} env steps/s each in {args.actor_processes} processes; {args.seconds:.0f} s "
        f"steady window; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    rows = []
    for n in args.actors:
        result = run_many(
            n,
            env_id=args.env,
            envs_per_actor=args.envs_per_actor,
            actor_sps=args.actor_sps,
            processes=args.actor_processes,
            seconds=args.seconds,
            columns=args.buffer_columns,
        )
        rows.append(report(n, result, args))
    print(
        "\n| actors | ingest env steps/s | per actor min / median / max | Jain | lag mean / max | learner RSS MiB "
        "idle / streaming / peak | storm: all joined s / all stepping s / refused | restart: up s / all stepping s "
        "/ back |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
