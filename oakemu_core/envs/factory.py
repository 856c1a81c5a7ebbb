"""The public way in: build an env id's :class:`~oakemu_core.envs.vector.VectorEnv`, read its
:class:`~oakemu_core.envs.spec.EnvSpec`, check it before any process starts.

The backend is picked from the env id (:mod:`oakemu_core.envs.spec`): Atari ids go to
:class:`~oakemu_core.envs.atari.AtariBackend`; emulator ids (``gameboy:...``, ``retro:...``) build
one ``gymnasium.Env`` per copy through :func:`oakemu_core.envs.emulators.make_emulator_env`, and
every other id one ``gymnasium.make(env_id)`` per copy, both behind
:class:`~oakemu_core.envs.gymnasium.GymnasiumBackend`. A new backend implements
:class:`~oakemu_core.envs.vector.Backend` and a branch in :func:`make_vector_env` / :func:`env_spec`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from oakemu_core.envs.atari import AtariBackend
from oakemu_core.envs.gymnasium import GymnasiumBackend, gymnasium_spec
from oakemu_core.envs.options import EnvOptions
from oakemu_core.envs.spec import (
    EMULATOR_ID_PREFIXES,
    EnvSpec,
    UnsupportedEnvironmentError,
    is_atari_env,
    is_emulator_env,
)
from oakemu_core.envs.vector import Backend, EnvGroups, VectorEnv

if TYPE_CHECKING:
    from oakemu_core.envs.render import FrameSink

__all__ = ["check_env", "env_spec", "make_env_groups", "make_eval_env", "make_vector_env"]


def _import_env_module(env_id: str) -> None:
    """Import the module of a ``module:EnvId`` id (it registers EnvId), as gymnasium.make would.

    Like ``python -m``, the working directory is searched too (appended to ``sys.path``), so
    ``tests.spaces_envs:...`` or ``my_envs:...`` resolve from the directory a command runs in.
    """
    module = env_id.split(":", 1)[0]
    try:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            top = module.split(".")[0]
            if error.name not in (top, module) or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)
            importlib.import_module(module)
    except Exception as error:  # any failure of a user's module: one clear message
        raise UnsupportedEnvironmentError(
            f"env_id: expected 'module:EnvId' with an importable module that registers EnvId, received "
            f"{env_id!r}: importing {module!r} failed with {type(error).__name__}: {error}"
        ) from error


def _make_emulator_env(
    env_id: str,
    max_episode_steps: int | None,
    settings_file: str | None,
    seed: int | None,
    render_mode: str | None,
) -> Any:
    try:
        emulators = importlib.import_module("oakemu_core.envs.emulators")
    except ImportError as error:
        raise UnsupportedEnvironmentError(
            f"env_id: {env_id!r} needs emulator support, which is not installed ({type(error).__name__}: {error})"
        ) from None
    make_emulator_env = getattr(emulators, "make_emulator_env", None)
    if make_emulator_env is None:
        raise UnsupportedEnvironmentError(
            f"env_id: {env_id!r} needs emulator support, which is not installed "
            "(oakemu_core.envs.emulators has no make_emulator_env)"
        )
    rendering = {} if render_mode is None else {"render_mode": render_mode}
    env = make_emulator_env(
        env_id,
        max_episode_steps=max_episode_steps,
        settings_file=settings_file,
        seed=seed,
        **rendering,
    )
    if env is None:
        raise UnsupportedEnvironmentError(
            f"env_id: expected a known emulator id ({', '.join(p + '...' for p in EMULATOR_ID_PREFIXES)}), "
            f"received {env_id!r}"
        )
    return env


def _make_gymnasium_env(
    env_id: str,
    max_episode_steps: int | None,
    *,
    settings_file: str | None = None,
    seed: int | None = None,
    render_mode: str | None = None,
    make_kwargs: dict[str, Any] | None = None,
) -> Any:
    """One raw env: emulator ids through ``oakemu_core.envs.emulators``, everything else through ``gymnasium.make``
    (with ``make_kwargs``).

    ``settings_file`` and ``seed`` are passed to emulator backends only (Gymnasium envs are seeded
    by their first reset); ``render_mode`` to every env.
    """
    if is_emulator_env(env_id):
        return _make_emulator_env(env_id, max_episode_steps, settings_file, seed, render_mode)
    import gymnasium

    if ":" in env_id:
        _import_env_module(env_id)
    kwargs: dict[str, Any] = {**(make_kwargs or {})}
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    try:
        return gymnasium.make(env_id, **kwargs)
    except (
        TypeError
    ) as error:  # a keyword the env does not take (render_mode: the caller's to handle)
        if render_mode is not None or not make_kwargs:
            raise
        raise UnsupportedEnvironmentError(
            f"env_kwargs: expected keyword arguments that {env_id!r} takes, received {make_kwargs!r} ({error})"
        ) from None
    except (gymnasium.error.Error, ImportError) as error:
        raise UnsupportedEnvironmentError(
            f"env_id: expected a registered Gymnasium id (e.g. 'CartPole-v1', or 'module:EnvId' for a custom env), "
            f"received {env_id!r} ({type(error).__name__}: {error})"
        ) from None


@functools.lru_cache(maxsize=32)
def env_spec(
    env_id: str, *, settings_file: str | None = None, options: EnvOptions | None = None
) -> EnvSpec:
    """Spaces of ``env_id`` as the vector env will report them (builds one env, resets it once, closes it).

    Cached per ``(env_id, settings_file)``; cheap to call early (the CLI does, before any process starts).

    Raises:
        UnsupportedEnvironmentError: unknown id, a module that cannot be imported, unsupported spaces
            (the message names the space), or emulator support not installed.
        InvalidActionMaskError: the env's first action mask is malformed or allows nothing.
    """
    options = options or EnvOptions()
    if is_atari_env(env_id):
        backend = AtariBackend(env_id, 1, max_episode_steps=None, num_threads=1, options=options)
        backend.close()
        return backend.spec
    env = _make_gymnasium_env(
        env_id, None, settings_file=settings_file, make_kwargs=options.make_kwargs
    )
    try:
        return gymnasium_spec(env_id, env)
    finally:
        env.close()


def make_vector_env(
    env_id: str,
    num_envs: int,
    *,
    seed: int | None,
    clip_rewards: bool | None = None,
    max_episode_steps: int | None = None,
    num_threads: int | None = None,
    settings_file: str | None = None,
    options: EnvOptions | None = None,
    frame_sink: FrameSink | None = None,
) -> VectorEnv:
    """Build ``num_envs`` copies of ``env_id`` behind one :class:`VectorEnv`.

    Args:
        env_id: Atari id (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``), emulator id
            (``gameboy:...``, ``retro:...``), any Gymnasium id, or ``module:EnvId`` for a custom env.
        num_envs: envs stepped together (>= 1).
        seed: seed of the first reset; env ``i`` is seeded with ``seed + i``. None: unseeded.
        clip_rewards: clip ``training_rewards`` to [-1, 1]; None means on for Atari ids, off otherwise.
        max_episode_steps: time limit in agent steps (truncation) replacing the id's own; None keeps it.
        num_threads: emulator threads (Atari only; default ``min(num_envs, cpu_count)``).
        settings_file: emulator settings file, passed to ``make_emulator_env`` (emulator ids only).
        options: ``gymnasium.make`` keyword arguments and Atari preprocessing (None: the defaults).
        frame_sink: receives the full-colour frames of env 0's episodes (videos of evaluations,
            :mod:`oakemu_core.envs.render`); needs ``num_envs == 1``. None: nothing renders.

    Raises:
        ValueError: ``num_envs`` < 1, ``max_episode_steps`` < 1, or a ``frame_sink`` with more envs.
        UnsupportedEnvironmentError: unknown id or unsupported spaces.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs: expected >= 1, received {num_envs}")
    if frame_sink is not None and num_envs != 1:
        raise ValueError(f"frame_sink: records one env, received num_envs {num_envs}")
    if max_episode_steps is not None and max_episode_steps < 1:
        raise ValueError(f"max_episode_steps: expected >= 1 or None, received {max_episode_steps}")
    atari = is_atari_env(env_id)
    backend: Backend
    if atari and frame_sink is not None:
        from oakemu_core.envs.render import RecordingAtariBackend

        backend = RecordingAtariBackend(
            env_id, max_episode_steps=max_episode_steps, sink=frame_sink, options=options
        )
    elif atari:
        backend = AtariBackend(
            env_id,
            num_envs,
            max_episode_steps=max_episode_steps,
            num_threads=num_threads,
            options=options,
        )
    else:
        backend = _gymnasium_backend(
            env_id, num_envs, seed, max_episode_steps, settings_file, options, frame_sink
        )
    return VectorEnv(
        backend, seed=seed, clip_rewards=atari if clip_rewards is None else clip_rewards
    )


def _gymnasium_backend(
    env_id: str,
    num_envs: int,
    seed: int | None,
    max_episode_steps: int | None,
    settings_file: str | None,
    options: EnvOptions | None,
    frame_sink: FrameSink | None,
) -> GymnasiumBackend:
    """``num_envs`` copies of a Gymnasium or emulator id (env ``i`` seeded ``seed + i``), env 0's
    episodes rendered into ``frame_sink`` when one is given (:func:`_make_recorded_env`)."""
    spec = env_spec(env_id, settings_file=settings_file, options=options)
    make_kwargs = (options or EnvOptions()).make_kwargs

    def make_env(index: int) -> Any:
        env_seed = None if seed is None else seed + index
        if frame_sink is not None:
            return _make_recorded_env(
                env_id, max_episode_steps, settings_file, env_seed, make_kwargs, frame_sink
            )
        return _make_gymnasium_env(
            env_id,
            max_episode_steps,
            settings_file=settings_file,
            seed=env_seed,
            make_kwargs=make_kwargs,
        )

    return GymnasiumBackend(spec, make_env, num_envs)


def _make_recorded_env(
    env_id: str,
    max_episode_steps: int | None,
    settings_file: str | None,
    seed: int | None,
    make_kwargs: dict[str, Any],
    frame_sink: FrameSink,
) -> Any:
    """One env whose episodes' ``rgb_array`` frames go to ``frame_sink``
    (:func:`oakemu_core.envs.render.rendered_episodes`); an env class that takes no ``render_mode``
    is returned unrecorded, after telling the sink why (``frame_sink.fail``)."""
    from oakemu_core.envs.render import rendered_episodes

    try:
        env = _make_gymnasium_env(
            env_id,
            max_episode_steps,
            settings_file=settings_file,
            seed=seed,
            render_mode="rgb_array",
            make_kwargs=make_kwargs,
        )
    except TypeError as error:  # an env class that takes no render_mode: evaluated unrecorded
        frame_sink.fail(f"{env_id!r} cannot be recorded: it takes no render_mode ({error})")
        return _make_gymnasium_env(
            env_id,
            max_episode_steps,
            settings_file=settings_file,
            seed=seed,
            make_kwargs=make_kwargs,
        )
    return rendered_episodes(env, frame_sink, env_id)


def make_env_groups(
    env_id: str, num_envs: int, groups: int, *, seed: int | None, **kwargs: Any
) -> EnvGroups:
    """``num_envs`` envs in ``groups`` vector envs (sizes differ by at most one); keyword arguments
    as :func:`make_vector_env`.

    Raises:
        ValueError: ``groups`` < 1 or more groups than envs.
    """
    if groups < 1 or groups > num_envs:
        raise ValueError(
            f"env_groups: expected 1 <= groups <= num_envs {num_envs}, received {groups}"
        )
    sizes = [num_envs // groups + (1 if g < num_envs % groups else 0) for g in range(groups)]
    made, first = [], 0
    for size in sizes:
        made.append(
            make_vector_env(env_id, size, seed=None if seed is None else seed + first, **kwargs)
        )
        first += size
    return EnvGroups(made)


def make_eval_env(
    env_id: str,
    *,
    seed: int | None,
    max_episode_steps: int | None = None,
    settings_file: str | None = None,
    options: EnvOptions | None = None,
    frame_sink: FrameSink | None = None,
) -> VectorEnv:
    """One env of ``env_id`` without reward clipping, for evaluation (same preprocessing as training);
    with ``frame_sink``, its episodes' full-colour frames go there (:mod:`oakemu_core.envs.render`)."""
    return make_vector_env(
        env_id,
        1,
        seed=seed,
        clip_rewards=False,
        max_episode_steps=max_episode_steps,
        num_threads=1,
        settings_file=settings_file,
        options=options,
        frame_sink=frame_sink,
    )


def check_env(
    env_id: str,
    *,
    settings_file: str | None = None,
    envs_per_process: int | None = None,
    options: EnvOptions | None = None,
) -> EnvSpec:
    """Everything that can be checked about an env before any process starts; returns its spec.

    Emulator ids (``gameboy:`` / ``retro:``) are validated by their backend first (ROM, settings
    file, reward spec, emulators per process), then the spec is built (spaces supported?).

    Raises:
        UnsupportedEnvironmentError: unknown id or unsupported spaces.
        oakemu_core.envs.emulators.EmulatorConfigError: a bad emulator setting (a ``ValueError``).
    """
    if is_emulator_env(env_id):
        from oakemu_core.envs.emulators import validate_emulator_env

        validate_emulator_env(env_id, settings_file, envs_per_process=envs_per_process)
    return env_spec(env_id, settings_file=settings_file, options=options)
