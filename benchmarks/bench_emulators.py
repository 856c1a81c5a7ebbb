"""Benchmark the emulator backends: raw emulator speed next to the env adapter's, as a ratio.

One process, one core (OpenCV single-threaded).  Rows, each measured for ``--seconds``:

* Game Boy (PyBoy, the generated test ROM, oakemu_core/envs/emulators/testrom.py):
  raw ``tick(1, render=False)`` and ``tick(1, render=True)`` frames/s, and ``tick(N, True)`` (N frames
  per call, only the last rendered: what one agent step costs the emulator); our Gymnasium env
  (``frames_per_action`` frames per agent step, button press + release, render only the last frame,
  RAM reward, grayscale 72x80, 4 stacked frames); and the project's ``VectorEnv`` over 1 env when
  ``oakemu_core.envs`` can build it (the actor loop minus the policy).
* stable-retro Airstriker-Genesis-v0: raw ``em.step()`` (the emulator core, no observation) and
  ``RetroEnv.step`` (one frame with its screen and reward) frames/s; our env (frame skip 4,
  84x84 grayscale, 4 stacked); ``VectorEnv`` over 1 env.

The ratio column is frames/s through that row divided by the backend's raw no-render frames/s
(agent steps/s = frames/s / frames per action).

Run: ``python benchmarks/bench_emulators.py [--seconds 3 --frames-per-action 24]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing
warnings.filterwarnings("ignore")

from oakemu_core.envs.emulators import make_emulator_env
from oakemu_core.envs.emulators.testrom import write_test_rom


def rate(step: Callable[[], object], seconds: float) -> float:
    """Calls of ``step`` per second over about ``seconds`` (after 20 warm-up calls)."""
    for _ in range(20):
        step()
    calls, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(50):
            step()
        calls += 50
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


def vector_env_rate(
    env_id: str, settings: str | None, action: Callable[[], np.ndarray], seconds: float
) -> float | None:
    """Agent steps/s of the project's VectorEnv over one env, or None when it cannot be built here."""
    try:
        from oakemu_core.envs import make_vector_env

        vector = make_vector_env(env_id, 1, seed=0, settings_file=settings)
    except Exception as error:  # noqa: BLE001 - the row is optional
        print(f"  (VectorEnv row skipped: {type(error).__name__}: {error})")
        return None
    try:
        vector.reset()
        return rate(lambda: vector.step(action()), seconds)
    finally:
        vector.close()


def gameboy_rows(
    seconds: float, frames_per_action: int, folder: Path
) -> list[tuple[str, float, int]]:
    from pyboy import PyBoy

    rom = write_test_rom(folder / "bench.gb")
    settings = folder / "bench.toml"
    settings.write_text(
        textwrap.dedent(f"""
        [gameboy]
        frames_per_action = {frames_per_action}
        press_frames = {max(1, frames_per_action // 3)}
        max_episode_steps = 1000000
        [[gameboy.reward]]
        name = "a_presses"
        kind = "delta"
        address = 0xC000
    """)
    )
    rows = []
    pyboy = PyBoy(str(rom), window="null", sound_emulated=False, log_level="ERROR")
    pyboy.set_emulation_speed(0)
    try:
        rows.append(("PyBoy tick(1, render=False)", rate(lambda: pyboy.tick(1, False), seconds), 1))
        rows.append(("PyBoy tick(1, render=True)", rate(lambda: pyboy.tick(1, True), seconds), 1))
        batched = rate(lambda: pyboy.tick(frames_per_action, True), seconds)
        rows.append(
            (
                f"PyBoy tick({frames_per_action}, render last)",
                batched * frames_per_action,
                frames_per_action,
            )
        )
    finally:
        pyboy.stop(save=False)
    env = make_emulator_env(
        f"gameboy:{rom}", max_episode_steps=None, settings_file=str(settings), seed=0
    )
    rng = np.random.default_rng(0)
    try:
        env.reset(seed=0)
        actions = rng.integers(0, env.action_space.n, size=4096)
        counter = iter(range(1 << 62))
        steps = rate(lambda: env.step(int(actions[next(counter) % 4096])), seconds)
        rows.append(
            (
                f"our env ({frames_per_action} frames/step)",
                steps * frames_per_action,
                frames_per_action,
            )
        )
    finally:
        env.close()
    vector = vector_env_rate(
        f"gameboy:{rom}", str(settings), lambda: rng.integers(0, 9, size=1), seconds
    )
    if vector is not None:
        rows.append(("VectorEnv(1) over our env", vector * frames_per_action, frames_per_action))
    return rows


def retro_rows(seconds: float) -> list[tuple[str, float, int]]:
    import stable_retro

    rows = []
    game = "Airstriker-Genesis-v0"
    raw = stable_retro.make(game, render_mode=None)
    try:
        raw.reset(seed=0)
        rows.append(("stable-retro em.step()", rate(raw.unwrapped.em.step, seconds), 1))
        # One frame with screen + reward; random buttons, restarting at game over.
        rng = np.random.default_rng(0)

        def retro_step() -> None:
            _, _, done, _, _ = raw.step(rng.integers(0, 2, size=12))
            if done:
                raw.reset()

        rows.append(("RetroEnv.step (1 frame)", rate(retro_step, seconds), 1))
    finally:
        raw.close()
    env = make_emulator_env(f"retro:{game}", max_episode_steps=None, settings_file=None, seed=0)
    frames = env.unwrapped.settings.frames_per_action
    try:
        env.reset(seed=0)

        def env_step() -> None:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()

        rows.append((f"our env ({frames} frames/step)", rate(env_step, seconds) * frames, frames))
    finally:
        env.close()
    vector = vector_env_rate(
        f"retro:{game}", None, lambda: rng.integers(0, 2, size=(1, 12)), seconds
    )
    if vector is not None:
        rows.append(("VectorEnv(1) over our env", vector * frames, frames))
    return rows


def print_table(title: str, rows: list[tuple[str, float, int]]) -> None:
    base = rows[0][1]
    print(f"\n{title}")
    print(f"  {'what':34s} {'frames/s':>10s} {'agent steps/s':>14s} {'ratio to raw':>13s}")
    for name, frames_per_second, frames in rows:
        print(
            f"  {name:34s} {frames_per_second:10.0f} {frames_per_second / frames:14.0f} {frames_per_second / base:13.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per row")
    parser.add_argument(
        "--frames-per-action", type=int, default=24, help="Game Boy frames per agent step"
    )
    args = parser.parse_args()
    import cv2

    cv2.setNumThreads(1)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs visible, one process; {args.seconds:.0f} s per row"
    )
    with tempfile.TemporaryDirectory() as folder:
        print_table(
            "Game Boy (PyBoy, generated test ROM)",
            gameboy_rows(args.seconds, args.frames_per_action, Path(folder)),
        )
    print_table("stable-retro (Airstriker-Genesis-v0)", retro_rows(args.seconds))


if __name__ == "__main__":
    main()
