"""How many actor processes a run starts when the user does not say: the rollout's envs split over the
CPUs the learner leaves (:func:`fit_actors`)."""

from __future__ import annotations

import os

__all__ = [
    "DEFAULT_NUM_ENVS",
    "available_cpus",
    "MIN_FITTED_ENVS_PER_ACTOR",
    "fit_actor_count",
    "fit_actors",
]

DEFAULT_NUM_ENVS = 16
"""Rollout columns when neither ``num_envs`` nor ``num_actors`` / ``envs_per_actor`` are given."""
MIN_FITTED_ENVS_PER_ACTOR = 4
"""Fewest envs :func:`fit_actor_count` gives one actor (below it, per-message costs dominate small envs)."""


def fit_actor_count(num_envs: int, cpus: int) -> int:
    """Actor processes for ``num_envs`` envs on ``cpus`` CPUs: the largest divisor of ``num_envs`` that
    leaves one CPU to the learner (``<= cpus - 1``) and gives each actor at least
    :data:`MIN_FITTED_ENVS_PER_ACTOR` envs; 1 when none does. 16 envs: 1 actor on 2 CPUs, 2 on 4, 4 on 8+.

    Args:
        num_envs: the rollout's columns (>= 1).
        cpus: CPUs available to the run (>= 1).
    """
    fitting = [
        a
        for a in range(1, max(1, cpus - 1) + 1)
        if num_envs % a == 0 and num_envs // a >= MIN_FITTED_ENVS_PER_ACTOR
    ]
    return max(fitting, default=1)


def fit_actors(
    num_actors: int | None,
    envs_per_actor: int,
    num_envs: int | None,
    *,
    envs_per_actor_given: bool,
    cpus: int,
    one_env_per_actor: bool = False,
) -> tuple[int, int]:
    """``(num_actors, envs_per_actor)`` with what was not given filled in; given values are kept.

    * neither count given, an env that runs one emulator per process (``one_env_per_actor``: stable-retro):
      one env per actor, ``num_envs`` actors, or one per CPU the learner leaves when ``num_envs`` is not given;
    * neither count given: ``num_envs`` (default :data:`DEFAULT_NUM_ENVS`) split over
      :func:`fit_actor_count` actors;
    * only ``envs_per_actor`` given: ``ceil(num_envs / envs_per_actor)`` actors;
    * ``num_actors`` and ``num_envs`` given: ``ceil(num_envs / num_actors)`` envs each;
    * only ``num_actors`` given: ``envs_per_actor`` as it is (its default).
    """
    if one_env_per_actor and num_actors is None and not envs_per_actor_given:
        return num_envs or max(1, cpus - 1), 1
    total = num_envs or DEFAULT_NUM_ENVS
    if num_actors is None and envs_per_actor_given:
        return -(-total // envs_per_actor), envs_per_actor
    if num_actors is None:
        actors = fit_actor_count(total, cpus)
        return actors, total // actors
    if not envs_per_actor_given and num_envs is not None:
        return num_actors, -(-num_envs // num_actors)
    return num_actors, envs_per_actor


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
