"""benchmarks/bench_central_inference.py: the options it gives ``oakemu train`` and the server's log line
it reads (no training here)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

from oakemu_services.inference import BatchStats

from oakemu_core.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_central_inference", REPO_ROOT / "benchmarks" / "bench_central_inference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_script()


def test_both_runs_differ_only_in_the_actors_inference(
    tmp_path: Path, no_oakemu_variables: None
) -> None:
    args = argparse.Namespace(
        actors=3,
        envs_per_actor=4,
        cartpole_steps=4096,
        breakout_steps=2048,
        mode="async",
        device="cpu",
    )
    local, central = (
        load_config(bench.train_args("breakout", inference, args, tmp_path))
        for inference in ("local", "central")
    )
    assert (local.actor_inference, central.actor_inference) == ("auto", "central")
    assert (central.num_actors, central.envs_per_actor, central.num_envs) == (3, 4, 12)
    assert (central.env_id, central.total_env_steps, central.inference_device) == (
        "ALE/Breakout-v5",
        2048,
        "cpu",
    )
    same = {"actor_inference", "run_name"}
    assert {k: v for k, v in local.model_dump().items() if k not in same} == {
        k: v for k, v in central.model_dump().items() if k not in same
    }


def test_the_servers_batches_are_read_from_its_log_line() -> None:
    """The regular expression follows the server's own line (:meth:`BatchStats.line`)."""
    stats = BatchStats()
    stats.served(["actor-0", "actor-1"], 16)
    stats.served(["actor-0"], 8)
    log = (
        f"2026-12-07T18:00:00.000+0000 INFO oakemu.inference: inference in all: {stats.line(12.0)}"
    )
    assert bench.server_batches(log) == {
        "batches": 2,
        "requests_per_batch": 1.5,
        "most_requests": 2,
        "rows_per_batch": 12.0,
    }
    assert bench.server_batches("no such line") is None
