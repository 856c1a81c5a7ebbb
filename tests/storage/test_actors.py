"""The actor registry: forget() releases everything the learner holds for an actor incarnation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.actors import ActorRecord, ActorRegistry
from oakemu_core.storage.assembler import RolloutAssembler
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.auth import Connection, PeerBinding
from oakemu_core.transport.frame_stacks import StackHistories
from oakemu_core.transport.liveness import LocalProcesses
from oakemu_core.transport.step_ring import StepRings
from oakemu_core.transport.steps import StepMessage, StepSpec

T, N = 4, 4
SCHEMA = build_schema({"": ((2,), np.float32)}, Categorical(3))
SPEC = StepSpec(num_envs=2, schema=SCHEMA)
PID = 4242


def fake_proc(root: Path) -> Path:
    """A /proc whose PID namespace is the learner's, with one running process :data:`PID`."""
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "ns" / "pid").symlink_to("pid:[4026531836]")
    (root / str(PID)).mkdir()
    (root / str(PID) / "stat").write_text(f"{PID} (actor) S {' '.join(['0'] * 18)} 100 0 0\n")
    return root


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[dict]:
    rings = StepRings()
    buffers = [RolloutBuffer(T, N, schema=SCHEMA)]
    yield {
        "peers": PeerBinding(user_ids=False),
        "rings": rings,
        "stacks": StackHistories(),
        "processes": LocalProcesses(fake_proc(tmp_path / "proc")),
        "buffers": buffers,
    }
    rings.close()
    for buffer in buffers:
        buffer.close()


def registry_with_actor(holders: dict) -> tuple[ActorRegistry, RolloutAssembler, ActorRecord]:
    """A registry over every holder, with actor "a" (incarnation "a-1") held by each of them, and
    one row of its segment written."""
    registry = ActorRegistry(
        peers=holders["peers"],
        rings=holders["rings"],
        stacks=holders["stacks"],
        processes=holders["processes"],
    )
    assembler = RolloutAssembler(holders["buffers"], actor_timeout_s=5.0, registry=registry)
    assert holders["peers"].bind("a", "a-1", Connection(b"rid", "10.0.0.1", ""))
    holders["rings"].offer("a", "a-1", SPEC, T)
    record = assembler.join("a", "a-1", SPEC, hostname="h", now=0.0)
    assert holders["processes"].watch("a", "a-1", PID, "pid:[4026531836]")
    sent = {f.name: np.zeros((2, *f.shape), f.dtype) for f in SCHEMA.sent}
    sent["trainable"] = np.ones(2, dtype=bool)
    assembler.ingest(StepMessage("a", "a-1", 0, 0, sent), now=0.0)
    holders["stacks"].remember("a", "a-1", 0, {"x": np.zeros((2, 4, 3, 3))}, ["x"], block=False)
    assert int(holders["buffers"][0].column_steps.sum()) == 2
    return registry, assembler, record


def test_forget_releases_every_holder_of_the_actor(holders: dict, tmp_path: Path) -> None:
    registry, assembler, record = registry_with_actor(holders)
    registry.forget(record)

    assert registry.actors == {} and registry.get("a", "a-1") is None
    assert int(holders["buffers"][0].column_steps.sum()) == 0, "its unfinished segment is discarded"
    assert assembler.counters.dropped["discarded_segment_rows"] == 2
    assert holders["peers"].peers == {}, "its peer binding is released"
    assert len(holders["rings"]) == 0, "its step ring departs"
    assert holders["rings"].get("a", "a-1") is not None, "kept mapped for its late messages"
    assert holders["stacks"].previous("a", "a-1", 1) is None and len(holders["stacks"]) == 0
    (tmp_path / "proc" / str(PID) / "stat").unlink()  # the process exits after it was forgotten
    assert holders["processes"].gone() == [], "its process is no longer watched"
    assert registry.spec_for("a", "a-1") == SPEC, "remembered as departed"
    assert registry.count_late("a", "a-1") and registry.counters.dropped["late_steps"] == 2


def test_forget_with_free_ring_unmaps_the_ring_at_once(holders: dict) -> None:
    registry, _, record = registry_with_actor(holders)
    registry.forget(record, free_ring=True)
    assert holders["rings"].get("a", "a-1") is None and holders["rings"].used_bytes == 0


def test_a_newer_incarnations_binding_outlives_the_old_record(holders: dict) -> None:
    """The join of incarnation a-2 binds its connection first; forgetting a-1 leaves it bound."""
    registry, assembler, record = registry_with_actor(holders)
    connection = Connection(b"rid-2", "10.0.0.1", "")
    holders["peers"].peers["a"] = ("a-2", connection)
    assembler.join("a", "a-2", SPEC, hostname="h", now=1.0)  # forgets a-1
    assert registry.get("a", "a-2") is not None and registry.get("a", "a-1") is None
    assert holders["peers"].peers == {"a": ("a-2", connection)}


def test_expired_actors_are_forgotten_with_their_rings_freed(holders: dict) -> None:
    registry, assembler, _ = registry_with_actor(holders)
    assert assembler.expire_silent_actors(now=10.0) == ["a"]
    assert registry.actors == {} and holders["rings"].used_bytes == 0
    assert holders["peers"].peers == {} and registry.counters.dropped["timed_out_actors"] == 1


def test_sweep_releases_what_refused_and_failed_joins_left(holders: dict) -> None:
    registry, _, _ = registry_with_actor(holders)
    for actor_id in ("refused", "held"):
        holders["peers"].bind(actor_id, f"{actor_id}-1", Connection(b"x", "10.0.0.2", ""))
    holders["rings"].offer("failed", "failed-1", SPEC, T)  # a join that failed after its offer
    registry.sweep(keep_bindings={"held"})
    assert set(holders["peers"].peers) == {"a", "held"}
    assert len(holders["rings"]) == 1 and holders["rings"].get("a", "a-1") is not None
    assert len(holders["stacks"]) == 1


def test_add_refuses_a_registered_actor_id(holders: dict) -> None:
    registry, _, record = registry_with_actor(holders)
    with pytest.raises(ValueError, match="forget it first"):
        registry.add(record)
