"""A trained policy as a plain folder: no pickle, readable without this package's checkpoints.

Written by ``oakemu export CHECKPOINT DIR`` (:func:`write_policy_folder`), read by
:func:`load_policy_folder` (behind ``oakemu_core.load_policy`` and ``oakemu evaluate``). The layout follows the
Hugging Face Hub's model repositories:

=============================  ==================================================================
file                           contents
=============================  ==================================================================
``model.safetensors``          every tensor of the actor-critic's ``state_dict`` (weights and the
                               observation normaliser's running ``mean``/``var``/``count``)
``config.json``                format name and version, env id, the run's configuration
                               (``OakEmuConfig`` fields), policy version and env steps trained
``spaces.json``                observation layout (key -> shape, dtype; key ``""`` for a plain
                               observation), the step schema (``StepSchema.to_dict``: the action
                               distribution and its space)
``obs_normalization.json``     with ``normalize_observations``: per observation key the running
                               ``mean``, ``var`` (lists shaped like the observation) and ``count``;
                               the policy divides ``(x - mean)`` by ``sqrt(var + 1e-8)``, clipped
                               to [-10, 10] (:class:`oakemu_core.policy.models.RunningNormalizer`)
``README.md``                  the model card (YAML front matter: library, tags, the Hub's
                               ``model-index`` with the evaluation's ``mean_reward``; its Python
                               code is :func:`usage_code`)
``replay.mp4``                 one evaluation episode (when a video was given)
=============================  ==================================================================

Reading uses ``safetensors`` (optional extra ``export``) and JSON only: ``torch.load`` and pickle
are never called.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oakemu_core.errors import ConfigError, UserError
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PolicyFolderError",
    "check_export_target",
    "is_policy_folder",
    "load_policy_folder",
    "model_card",
    "read_policy_info",
    "usage_code",
    "write_policy_folder",
]

FORMAT = "oakemu-policy"
FORMAT_VERSION = 1
WEIGHTS_FILE, CONFIG_FILE, SPACES_FILE, NORMALIZATION_FILE = (
    "model.safetensors",
    "config.json",
    "spaces.json",
    "obs_normalization.json",
)
CARD_FILE, VIDEO_FILE = "README.md", "replay.mp4"


class PolicyFolderError(UserError, ValueError):
    """A folder that is not a readable exported policy, or an export target that is not empty (the message
    names the file and the problem)."""


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError(
            "exported policies need safetensors: pip install 'oakemu-rl[export]'"
        ) from None
    return safetensors.torch


def _layout_json(layout: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, Any]:
    return {
        key: {"shape": [int(n) for n in shape], "dtype": np.dtype(dtype).name}
        for key, (shape, dtype) in layout.items()
    }


def check_export_target(directory: Path) -> None:
    """Raise :class:`PolicyFolderError` unless ``directory`` is absent or empty (where a policy folder may go)."""
    if directory.exists() and any(directory.iterdir()):
        raise PolicyFolderError(f"{directory}: exists and is not empty")


def write_policy_folder(
    directory: Path,
    state_dict: Mapping[str, torch.Tensor],
    *,
    env_id: str,
    observation_layout: Mapping[str, tuple[tuple[int, ...], Any]],
    schema: Mapping[str, Any],
    config: Mapping[str, Any],
    trained: Mapping[str, int],
    evaluation: Mapping[str, Any] | None = None,
    video: Path | None = None,
) -> Path:
    """Write the policy folder (module docstring) into ``directory`` (created; must be empty or absent).

    Args:
        directory: the folder to write.
        state_dict: the actor-critic's ``state_dict`` (a checkpoint's ``state["model"]``).
        env_id, observation_layout, schema: the env, its observation layout and the run's step
            schema (``StepSchema.to_dict()``).
        config: the run's configuration (``OakEmuConfig.model_dump(mode="json")``).
        trained: ``{"policy_version": ..., "global_step": ...}`` of the weights.
        evaluation: the model card's result: ``episodes``, ``mean``, ``std``, ``greedy``, ``seed``.
        video: an MP4 of an evaluation episode, copied as ``replay.mp4``.

    Raises:
        PolicyFolderError: ``directory`` exists and is not empty.
        ConfigError: safetensors is not installed.
    """
    serialize = _safetensors().save
    directory = Path(directory)
    check_export_target(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state_dict.items()
    }
    # Bytes written by open(): the file gets the umask's mode like the others (safetensors' save_file makes it 0600).
    (directory / WEIGHTS_FILE).write_bytes(
        serialize(tensors, metadata={"format": FORMAT, "env_id": env_id})
    )
    normalize = bool(config.get("normalize_observations"))
    info = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "env_id": env_id,
        "normalize_observations": normalize,
        "network": NetworkSpec.from_config(config).to_dict(),
        **{k: int(v) for k, v in trained.items()},
        "evaluation": dict(evaluation) if evaluation else None,
        "config": dict(config),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(info, indent=2) + "\n")
    spaces = {"observation_layout": _layout_json(observation_layout), "schema": dict(schema)}
    (directory / SPACES_FILE).write_text(json.dumps(spaces, indent=2) + "\n")
    if normalize:
        stats = {}
        for key in observation_layout:  # float keys have a normaliser; images do not
            prefix = f"normalizers.{ActorCritic._module_key(key)}."
            found = {
                name[len(prefix) :]: tensor.double().tolist()
                for name, tensor in tensors.items()
                if name.startswith(prefix)
            }
            if found:
                stats[key] = found
        (directory / NORMALIZATION_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    if video is not None:
        shutil.copyfile(video, directory / VIDEO_FILE)
    (directory / CARD_FILE).write_text(
        model_card(info, spaces, has_video=video is not None, folder=directory.name)
    )
    return directory


def is_policy_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder holding an exported policy's ``spaces.json`` (read nothing else)."""
    return (Path(path) / SPACES_FILE).is_file()


def read_policy_info(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config.json, spaces.json)`` of an exported policy folder.

    Raises:
        PolicyFolderError: a file is missing, not JSON, or of another format or version.
    """
    directory = Path(directory)
    loaded = []
    for name in (CONFIG_FILE, SPACES_FILE):
        try:
            loaded.append(json.loads((directory / name).read_text()))
        except (OSError, ValueError) as error:
            raise PolicyFolderError(
                f"{directory / name}: expected the JSON file of an exported policy "
                f"({type(error).__name__}: {error})"
            ) from None
    info, spaces = loaded
    if info.get("format") != FORMAT or info.get("format_version") != FORMAT_VERSION:
        raise PolicyFolderError(
            f"{directory / CONFIG_FILE}: expected format {FORMAT!r} version {FORMAT_VERSION}, "
            f"received {info.get('format')!r} version {info.get('format_version')!r}"
        )
    return info, spaces


def load_policy_folder(directory: Path) -> ActorCritic:
    """The exported policy in ``directory`` as a CPU :class:`ActorCritic` in eval mode (act with
    ``model.act(observations, action_mask=..., greedy=True)``), read from safetensors and JSON only.

    Raises:
        PolicyFolderError: not an exported policy folder, or weights that do not fit its spaces.
        ConfigError: safetensors is not installed.
    """
    from oakemu_core.policy.schemas import schema_from_dict

    load_file = _safetensors().load_file
    directory = Path(directory)
    info, spaces = read_policy_info(directory)
    try:
        layout = {
            key: (tuple(entry["shape"]), np.dtype(entry["dtype"]))
            for key, entry in spaces["observation_layout"].items()
        }
        schema = schema_from_dict(spaces["schema"])
        network = NetworkSpec.from_dict(info.get("network") or {})
        model = build_model(
            layout,
            schema.distribution,
            normalize_observations=bool(info["normalize_observations"]),
            network=network,
        )
        model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
    except (KeyError, TypeError, ValueError, RuntimeError, OSError) as error:
        raise PolicyFolderError(
            f"{directory}: cannot build the policy ({type(error).__name__}: {error})"
        ) from None
    return model.eval()


def usage_code(
    folder: str, observation_layout: Mapping[str, Mapping[str, Any]], *, recurrent: bool = False
) -> str:
    """The model card's Python code: :func:`oakemu_core.load_policy` on the folder (by its name, which a comment
    says stands for the folder's path) and ``Policy.act`` on an all-zeros observation of the policy's own layout
    (``spaces.json``), lines ending in a newline; a ``recurrent`` policy's code starts the episode with
    ``policy.reset()``."""
    zeros = {
        key: f"np.zeros({tuple(entry['shape'])}, np.{np.dtype(entry['dtype']).name})"
        for key, entry in observation_layout.items()
    }
    observation = (
        zeros[""]
        if set(zeros) == {""}
        else "{" + ", ".join(f"{json.dumps(key)}: {value}" for key, value in zeros.items()) + "}"
    )
    return (
        f"import numpy as np\n"
        f"import oakemu_core  # pip install 'oakemu-rl[export]'\n\n"
        f"policy = oakemu_core.load_policy({json.dumps(folder)})  # the path of this folder; no pickle\n"
        f"observation = {observation}  # as oakemu's env adapter gives it\n"
        + (
            "policy.reset()  # recurrent: before each episode; act() carries its state between calls\n"
            if recurrent
            else ""
        )
        + "action = policy.act(observation)  # greedy; one observation or a batch\n"
    )


def _is_recurrent(info: Mapping[str, Any]) -> bool:
    """Whether ``config.json``'s network (``info["network"]``) has a recurrent core."""
    try:
        return NetworkSpec.from_dict(info.get("network") or {}).is_recurrent
    except ValueError:  # a card is still written; loading the folder reports the bad network
        return False


def model_card(
    info: Mapping[str, Any], spaces: Mapping[str, Any], *, has_video: bool, folder: str = "policy"
) -> str:
    """The folder's README.md: YAML front matter in the Hub's layout for RL models, then how to load it
    (:func:`usage_code`, loading the folder by the name ``folder``)."""
    env_id, evaluation = info["env_id"], info.get("evaluation")
    config = info.get("config") or {}
    metric = ""
    quoted = json.dumps(env_id)  # a JSON string is a YAML string: ids hold '/' and ':'
    normalization = (
        "running statistics in `obs_normalization.json` (also in the weights)"
        if info.get("normalize_observations")
        else "none"
    )
    video = ", `replay.mp4`" if has_video else ""
    if evaluation:
        metric = f"""model-index:
- name: {json.dumps("PPO-" + env_id)}
  results:
  - task:
      type: reinforcement-learning
      name: reinforcement-learning
    dataset:
      name: {quoted}
      type: {quoted}
    metrics:
    - type: mean_reward
      value: {evaluation["mean"]:.2f} +/- {evaluation["std"]:.2f}
      name: mean_reward
      verified: false
"""
    result = (
        "not evaluated"
        if not evaluation
        else f"mean raw episodic return **{evaluation['mean']:.2f} +/- {evaluation['std']:.2f}** over "
        f"{evaluation['episodes']} episodes ({'greedy' if evaluation['greedy'] else 'sampled'} actions, "
        f"env seed {evaluation['seed']}, `oakemu evaluate` on the exported checkpoint)"
    )
    layout = ", ".join(
        f"`{key or 'observation'}` {tuple(v['shape'])} {v['dtype']}"
        for key, v in spaces["observation_layout"].items()
    )
    return f"""---
library_name: oakemu-rl
tags:
- reinforcement-learning
- ppo
- oakemu-rl
- {quoted}
{metric}---

# PPO agent for `{env_id}`

Trained with OakEmu-RL (actor/learner PPO) for {info.get("global_step", 0):,} env steps (policy version
{info.get("policy_version", 0)}). Evaluation: {result}.
{chr(10) + "![replay](replay.mp4)" + chr(10) if has_video else ""}
## Use

```python
{usage_code(folder, spaces["observation_layout"], recurrent=_is_recurrent(info))}```

Observations: {layout} (as the env id's preprocessing gives them). Observation normalisation:
{normalization}.

## Files

`model.safetensors` (weights), `config.json` (the run's configuration: learning rate
{config.get("learning_rate")}, {config.get("num_actors")} actors x {config.get("envs_per_actor")} envs, rollout length
{config.get("rollout_length")}, ...), `spaces.json` (observation layout and action
distribution){video}.
"""
