"""benchmarks/bench_many_actors.py on a small scale: 8 simulated remote actors in 2 processes against
one learner process, through the sockets: a join storm, a short steady window and a learner crash
and restart (the figures themselves are not checked: speed lives in the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import bench_many_actors
from oakemu_core.shared_memory import pid_is_alive
from tests.e2e_helpers import segments_of

ACTORS = 8


@pytest.mark.slow
def test_many_actors_all_join_share_the_ingest_and_come_back_after_a_learner_restart() -> None:
    result = bench_many_actors.run_many(
        ACTORS, envs_per_actor=2, actor_sps=400.0, processes=2, seconds=3.0, warmup_s=1.0
    )
    started = result["learner_pids"] + result["actor_pids"]
    assert not [pid for pid in started if pid_is_alive(pid)], "a process of the harness outlived it"
    assert segments_of(set(result["learner_pids"])) == [], (
        "a learner's shared memory was left behind"
    )
    errors = {actor_id: o["error"] for actor_id, o in result["outcomes"].items() if o["error"]}
    assert len(result["outcomes"]) == ACTORS and not errors, result["outcomes"]

    storm = result["storm"]
    assert (storm["joined"], storm["stepping"], storm["refused"]) == (ACTORS, ACTORS, 0), storm
    assert storm["joins"] == ACTORS, storm  # one granted join each: no join had to be asked again

    steady = result["steady"]
    assert steady["zero"] == 0 and steady["min"] > 0, steady  # every actor had steps written
    assert steady["ingest"] > 0 and 0 < steady["jain"] <= 1.0, steady
    assert steady["versions_per_s"] > 0, steady  # buffers filled and were released as new versions

    again = result["restart"]
    assert (again["joined"], again["stepping"]) == (ACTORS, ACTORS), (
        again
    )  # every actor back and stepping
    assert all(o["rejoins"] >= 1 for o in result["outcomes"].values()), result["outcomes"]
