"""What ``./run.sh`` installs (its install steps printed by ``OAKEMU_INSTALL_DRY_RUN=1``, nothing installed) and
the extras of pyproject.toml: the main install brings what every preset needs and no test tool; ``./run.sh
test`` adds the test tools on its first use; .ci/run installs through it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from oakemu_core.config import make_config
from oakemu_core.presets import load_preset, preset_names

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_SH = REPO_ROOT / "run.sh"
TEST_TOOLS = {"pytest", "pytest-timeout", "hypothesis"}


def install_steps(venv: Path, *args: str, run_sh: Path = RUN_SH) -> list[str]:
    """The install commands ``./run.sh ARGS`` would run for the venv at ``venv`` (printed, not run)."""
    assert "OAKEMU_INSTALL_DRY_RUN" in run_sh.read_text(), (
        "run.sh has no dry run: it would install for real"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("OAKEMU_")}
    env |= {"OAKEMU_VENV": str(venv), "OAKEMU_INSTALL_DRY_RUN": "1"}
    done = subprocess.run([str(run_sh), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not venv.exists() or venv.is_dir()
    return done.stdout.splitlines()


def extras_installed(steps: list[str]) -> list[str]:
    """The extras of the ``pip install -e .[EXTRA,...]`` steps among ``steps``, in order."""
    return [
        extra
        for step in steps
        if (match := re.search(r" -e \.\[([\w,]+)\]$", step))
        for extra in match.group(1).split(",")
    ]


MAIN_EXTRAS = ["presets", "tune", "export"]
"""What ``./run.sh`` installs: every preset's needs, ``oakemu tune``'s and ``oakemu export``'s (the README's
``./run.sh tune`` and ``./run.sh export ... --push-to-hub``)."""


def test_a_fresh_machine_gets_the_presets_tune_and_export_extras_and_no_test_tools(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    steps = install_steps(venv, "train", "--preset", "airstriker")
    assert extras_installed(steps) == MAIN_EXTRAS, steps
    assert any("torch" in step for step in steps) and not venv.exists()
    assert extras_installed(install_steps(venv, "test")) == [
        *MAIN_EXTRAS,
        "dev",
    ]  # test tools on top
    assert {"safetensors", "huggingface-hub", "optuna"} <= set().union(
        *(distributions(extra) for extra in MAIN_EXTRAS)
    )


def test_the_test_tools_come_on_the_first_test_run_and_installs_rerun_after_pyproject_changes(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("oakemu", "python"):
        (venv / "bin" / name).touch(mode=0o755)
    main = venv / ".oakemu-installed"
    main.touch()
    assert install_steps(venv, "train") == []  # installed: nothing to do
    assert extras_installed(install_steps(venv, "test")) == ["dev"]
    (venv / ".oakemu-test-installed").touch()
    assert install_steps(venv, "test") == []
    older = (REPO_ROOT / "pyproject.toml").stat().st_mtime - 10
    os.utime(main, (older, older))  # pyproject.toml changed since the main install
    steps = install_steps(venv, "train")
    assert extras_installed(steps) == MAIN_EXTRAS and not any(
        "venv" in step.split()[:3] for step in steps
    ), steps


def test_an_install_runs_again_after_run_sh_changes(tmp_path: Path) -> None:
    """A run.sh that installs more (an extra added) reinstalls a venv made by an older one."""
    repo, venv = tmp_path / "repo", tmp_path / "venv"
    repo.mkdir()
    for name in ("run.sh", "pyproject.toml"):
        shutil.copy2(REPO_ROOT / name, repo / name)
    (venv / "bin").mkdir(parents=True)
    for name in ("oakemu", "python"):
        (venv / "bin" / name).touch(mode=0o755)
    main = venv / ".oakemu-installed"
    main.touch()
    start = time.time() - 100
    for path, age in ((repo / "pyproject.toml", 0), (main, 10), (repo / "run.sh", 20)):
        os.utime(path, (start + age, start + age))  # pyproject.toml, the install, then run.sh
    steps = install_steps(venv, "train", run_sh=repo / "run.sh")
    assert extras_installed(steps) == MAIN_EXTRAS, steps
    os.utime(main, (start + 30, start + 30))  # installed since
    assert install_steps(venv, "train", run_sh=repo / "run.sh") == []


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def distributions(extra: str) -> set[str]:
    """The distributions an extra brings, its references to other extras (``oakemu-rl[a,b]``) followed."""
    names: set[str] = set()
    for requirement in _extras()[extra]:
        if requirement.startswith("oakemu-rl["):
            for inner in requirement[len("oakemu-rl[") : requirement.index("]")].split(","):
                names |= distributions(inner.strip())
        else:
            names.add(_name(requirement))
    return names


def needed_by(env_id: str) -> set[str]:
    """Distributions an env id needs beyond the core to train and be recorded on video (its evaluations)."""
    video = {"imageio", "imageio-ffmpeg"}
    if env_id.startswith("retro:"):
        return video | {"stable-retro"}
    if env_id.startswith("ALE/"):
        return video  # ale-py is a core dependency; it renders its own frames
    if env_id.startswith("LunarLander"):
        return video | {"box2d", "pygame"}
    return video | {
        "pygame"
    }  # Gymnasium's classic-control and toy-text envs draw their frames with pygame


@pytest.mark.parametrize("name", preset_names())
def test_the_presets_extra_brings_what_each_preset_needs(name: str) -> None:
    env_id = make_config(base=load_preset(name).settings).env_id
    assert needed_by(env_id) <= distributions("presets"), env_id


def test_the_presets_extra_has_no_test_tools_and_dev_has_presets_and_the_tested_extras() -> None:
    presets, dev = distributions("presets"), distributions("dev")
    assert not presets & TEST_TOOLS
    assert presets | TEST_TOOLS <= dev
    for extra in ("onnx", "bc", "mlflow", "wandb", "export"):  # the suite tests these integrations
        assert distributions(extra) <= dev, extra


def test_ci_installs_through_run_sh_test_and_the_readme_has_no_manual_install_step() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\./run\.sh test ", ci, flags=re.MULTILINE), (
        "CI must install the dev extra via ./run.sh test"
    )
    readme = (REPO_ROOT / "README.md").read_text()
    assert "gymnasium[box2d]" not in readme


def test_every_package_folder_is_installed() -> None:
    """A non-editable install (the Docker image, a wheel) holds only the packages pyproject lists:
    every folder of ``oakemu_core`` with an ``__init__.py`` must be one of them."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for init in (REPO_ROOT / "oakemu_core").rglob("__init__.py")
    }
    assert found - listed == set(), f"not in [tool.setuptools] packages: {sorted(found - listed)}"
