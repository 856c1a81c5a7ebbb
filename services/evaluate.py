"""``oakemu evaluate CHECKPOINT``: play episodes with a trained policy and report the episodic return."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oakemu_core.envs.options import EnvOptions
from oakemu_core.run.checkpoint import load_run_checkpoint
from oakemu_core.run.evaluation import build_evaluation, play_episodes

DEFAULT_MAX_EPISODE_STEPS = 27_000
"""Time limit when the run had none: 108k frames at frame skip 4, the usual Atari evaluation cap."""


def evaluate(checkpoint: Path, *, episodes: int, greedy: bool, seed: int) -> list[float]:
    """Play ``episodes`` episodes with the checkpoint's policy (CPU); returns their raw returns.

    Raises:
        oakemu_core.errors.CheckpointError: no checkpoint at ``checkpoint`` (a run folder is searched for its
            latest), or a file that is not a checkpoint of ``oakemu train``.
    """
    _, state = load_run_checkpoint(checkpoint)
    env_info, config = state["env"], state["config"]
    # The same builder as the learner's tester (oakemu_core.run.tester): one evaluation code path.
    model, env = build_evaluation(env_info["env_id"], env_info["schema"], seed=seed,
                                  max_episode_steps=config.get("max_episode_steps"),
                                  settings_file=config.get("emulator_settings"),
                                  normalize_observations=bool(config.get("normalize_observations")),
                                  env_options=EnvOptions.from_settings(config))
    try:
        model.load_state_dict(state["model"])
        model.eval()
        return play_episodes(model, env, episodes=episodes, greedy=greedy).returns
    finally:
        env.close()


def main(checkpoint: Path, *, episodes: int, greedy: bool, seed: int) -> int:
    """Entry point: prints one line ``episodes N  mean M  std S`` (population std); 0 on success.

    Raises:
        oakemu_core.errors.CheckpointError: as :func:`evaluate` (``oakemu`` prints it, exit status 2).
    """
    returns = evaluate(checkpoint, episodes=episodes, greedy=greedy, seed=seed)  # a CheckpointError: the CLI says it
    mode = "greedy" if greedy else "sampled"
    # Plain print: one unwrapped line that scripts can parse.
    print(f"{checkpoint}: {mode} policy, episodes {len(returns)}  mean {np.mean(returns):.2f}  "
          f"std {np.std(returns):.2f}  (min {np.min(returns):.1f}, max {np.max(returns):.1f})")
    return 0
