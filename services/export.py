"""``oakemu export CHECKPOINT DIR``: a trained policy as a pickle-free folder
(:mod:`oakemu_core.policy.export`: safetensors weights, config and spaces as JSON, observation
normalisation statistics, a model card with an evaluation and its video), optionally uploaded to a
Hugging Face Hub model repository (``--push-to-hub OWNER/NAME``)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from oakemu_services.evaluate import evaluate_checkpoint

from oakemu_core.envs import env_spec
from oakemu_core.errors import ConfigError
from oakemu_core.policy.export import check_export_target, read_policy_info, write_policy_folder
from oakemu_core.run.checkpoint import load_checkpoint, resolve_checkpoint
from oakemu_core.run.video import VideoUnavailableError


def export(
    checkpoint: Path, directory: Path, *, episodes: int, greedy: bool, seed: int, video: bool = True
) -> Path:
    """Evaluate the checkpoint's policy (``episodes`` episodes, the first recorded unless ``video`` is
    False) and write the policy folder ``directory``; returns it.

    Raises:
        CheckpointError: no checkpoint, or not a readable one. PolicyFolderError: ``directory`` is not empty.
        oakemu_core.run.video.VideoUnavailableError: ``video`` without the ``video`` extra (a UserError).
        ConfigError: safetensors is not installed.
    """
    path = resolve_checkpoint(checkpoint)
    directory = Path(directory)
    check_export_target(directory)  # before the evaluation, not after it
    state = load_checkpoint(path)
    env_id, config = state["env"]["env_id"], state["config"]
    with tempfile.TemporaryDirectory(prefix="oakemu-export-") as scratch:
        result = evaluate_checkpoint(
            path,
            episodes=episodes,
            greedy=greedy,
            seed=seed,
            video_dir=Path(scratch) if video else None,
            videos=1,
        )
        layout = env_spec(env_id, settings_file=config.get("emulator_settings")).observation_layout
        evaluation = {
            "episodes": len(result.returns),
            "mean": float(np.mean(result.returns)),
            "std": float(np.std(result.returns)),
            "greedy": greedy,
            "seed": seed,
        }
        trained = {
            "policy_version": int((state.get("ppo") or {}).get("policy_version", 0)),
            "global_step": int(state.get("global_step", 0)),
        }
        return write_policy_folder(
            directory,
            state["model"],
            env_id=env_id,
            observation_layout=layout,
            schema=state["env"]["schema"],
            config=config,
            trained=trained,
            evaluation=evaluation,
            video=result.videos[0] if result.videos else None,
        )


def export_lines(checkpoint: Path, folder: Path) -> list[str]:
    """What ``oakemu export`` prints once the folder is written: ``CHECKPOINT: exported to FOLDER``, the
    evaluation it measured (``config.json``'s, the model card's: mean +/- population std of the raw return, the
    episodes, greedy or sampled actions, the env seed) and the files written, by name."""
    info, _ = read_policy_info(folder)
    evaluation = info.get("evaluation")
    lines = [f"{checkpoint}: exported to {folder}"]
    if evaluation:
        lines.append(
            f"evaluation return: {evaluation['mean']:.2f} +/- {evaluation['std']:.2f} over "
            f"{evaluation['episodes']} episodes ({'greedy' if evaluation['greedy'] else 'sampled'} actions, "
            f"env seed {evaluation['seed']})"
        )
    lines.append("files: " + ", ".join(sorted(path.name for path in Path(folder).iterdir())))
    return lines


class HubUnavailable(RuntimeError):
    """The Hugging Face Hub could not be reached, or refused the upload (the message says which, and why)."""


def _hub_api() -> Any:
    """huggingface_hub's ``HfApi`` class.

    Raises:
        ConfigError: huggingface_hub is not installed.
    """
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError(
            "--push-to-hub needs huggingface_hub: pip install 'oakemu-rl[export]'"
        ) from None
    return HfApi


def check_hub_repository(repo_id: str) -> None:
    """Check, before anything is evaluated or written, that ``repo_id`` can be pushed to: huggingface_hub
    is installed and ``repo_id`` is a well-formed ``OWNER/NAME``.

    Raises:
        ConfigError: huggingface_hub is not installed, or ``repo_id`` is malformed.
    """
    _hub_api()
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") != 1:
        raise ConfigError(f"--push-to-hub: expected OWNER/NAME, received {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except ValueError as error:
        raise ConfigError(f"--push-to-hub: {error}") from None


def push_to_hub(directory: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload the policy folder to the Hugging Face Hub model repository ``repo_id`` (created when
    missing); returns the repository's URL. The token comes from ``HF_TOKEN`` or ``hf auth login``.

    Raises:
        ConfigError: huggingface_hub is not installed.
        HubUnavailable: the Hub could not be reached (no network, ``HF_HUB_OFFLINE``) or answered with an
            HTTP error (no or a wrong token, no write access).
    """
    api = _hub_api()()
    from huggingface_hub import errors

    # The Hub's own errors are OSErrors; its HTTP client's (a refused connection, a timeout) derive from
    # the HTTPError that huggingface_hub.errors re-exports.
    network_errors = (OSError, getattr(errors, "HTTPError", OSError))
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            folder_path=str(directory),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"oakemu export of {Path(directory).name}",
        )
    except errors.HfHubHTTPError as error:
        raise HubUnavailable(
            f"the Hugging Face Hub refused the upload to {repo_id}: {_first_line(error)}"
        ) from None
    except network_errors as error:
        raise HubUnavailable(
            f"could not reach the Hugging Face Hub: {_first_line(error)}"
        ) from None
    return str(url)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def main(
    checkpoint: Path,
    directory: Path,
    *,
    episodes: int,
    greedy: bool,
    seed: int,
    video: bool = True,
    push_to_hub_repo: str | None = None,
) -> int:
    """Entry point: export, print the folder, its evaluation and files (:func:`export_lines`) and the Hub URL;
    0 on success, 2 on a user mistake (raised as a :class:`~oakemu_core.errors.UserError` for the CLI to
    report), 1 when the Hub could not be reached or refused the upload (one line on stderr; the exported
    folder stays on disk)."""
    if push_to_hub_repo is not None:
        check_hub_repository(push_to_hub_repo)
    try:
        folder = export(
            checkpoint, directory, episodes=episodes, greedy=greedy, seed=seed, video=video
        )
    except VideoUnavailableError as error:
        raise VideoUnavailableError(f"{error} (or --no-video)") from None
    for line in export_lines(checkpoint, folder):
        print(line, flush=True)
    if push_to_hub_repo is not None:
        try:
            url = push_to_hub(folder, push_to_hub_repo)
        except HubUnavailable as error:
            print(
                f"oakemu export: error: {error}; the exported policy stays in {folder}",
                file=sys.stderr,
            )
            return 1
        print(f"pushed to {url}")
    return 0
