"""Environments: one small vector-env interface over every emulator backend and space.

Actors, the evaluator and the benchmarks only see :class:`VectorEnv`, :class:`VectorStep` and
:class:`EnvSpec`. Start from :func:`make_vector_env` (or :func:`make_eval_env`) and
:func:`env_spec`. The modules, in the order a step passes them:

* :mod:`~oakemu_core.envs.spec`: :class:`EnvSpec`, the env errors, the env-id rules;
* :mod:`~oakemu_core.envs.factory`: the id -> backend choice, :func:`make_vector_env`,
  :func:`env_spec`, env groups and the pre-start check;
* :mod:`~oakemu_core.envs.vector`: :class:`VectorEnv` (action checks, reward clipping, episode
  statistics) over a backend, and :class:`~oakemu_core.envs.vector.EnvGroups`;
* the backends: :mod:`~oakemu_core.envs.atari` (ale-py) and :mod:`~oakemu_core.envs.gymnasium`
  (space conversion, action masks), with :mod:`oakemu_core.envs.emulators` behind the latter.
"""

from oakemu_core.envs.factory import env_spec, make_eval_env, make_vector_env
from oakemu_core.envs.spec import EnvSpec, InvalidActionMaskError, UnsupportedEnvironmentError
from oakemu_core.envs.vector import VectorEnv, VectorStep

__all__ = [
    "EnvSpec",
    "InvalidActionMaskError",
    "UnsupportedEnvironmentError",
    "VectorEnv",
    "VectorStep",
    "env_spec",
    "make_eval_env",
    "make_vector_env",
]
