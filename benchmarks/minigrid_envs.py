"""MiniGrid envs as their users bring them to a PPO library: through ``minigrid.wrappers.ImgObsWrapper``.

Importing this module registers one id per MiniGrid task below, ``<MiniGrid id>-Img`` before the
version (``MiniGrid-Empty-5x5-Img-v0``), each ``ImgObsWrapper(gymnasium.make(<MiniGrid id>))``: the
observation is the agent's 7 x 7 view as ``Box(0, 255, (7, 7, 3), uint8)`` whose three planes are
symbolic indices (object type 0..10, colour 0..5, state 0..2), not pixels; actions ``Discrete(7)``.
Every command takes them in Gymnasium's ``module:EnvId`` form from the repository root::

    oakemu train --env benchmarks.minigrid_envs:MiniGrid-Empty-5x5-Img-v0 --mode sync

Needs the ``minigrid`` package (extra ``minigrid``).
"""

from __future__ import annotations

from typing import Any

import gymnasium

__all__ = ["IMG_IDS"]

TASKS = ("MiniGrid-Empty-5x5-v0", "MiniGrid-DoorKey-5x5-v0")


def img_id(task: str) -> str:
    """``MiniGrid-Empty-5x5-v0`` -> ``MiniGrid-Empty-5x5-Img-v0``."""
    name, version = task.rsplit("-v", 1)
    return f"{name}-Img-v{version}"


def make_img_env(task: str, **kwargs: Any) -> gymnasium.Env:
    """``ImgObsWrapper(gymnasium.make(task, **kwargs))``."""
    import minigrid  # noqa: F401  (registers the MiniGrid ids)
    from minigrid.wrappers import ImgObsWrapper

    return ImgObsWrapper(gymnasium.make(task, **kwargs))


IMG_IDS = tuple(img_id(task) for task in TASKS)
for _task, _id in zip(TASKS, IMG_IDS, strict=True):
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=make_img_env, kwargs={"task": _task})
