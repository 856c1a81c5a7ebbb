"""What the README and the docs pages tell a user, checked against the code: the option groups
``oakemu train --help`` prints, the Game Boy saved-state steps of docs/emulators.md run as written, and
what ``--run-name`` of an existing run does under ``oakemu train`` and ``oakemu learner``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from oakemu_services import cli

REPO_ROOT = Path(__file__).resolve().parents[1]


def read(page: str) -> str:
    return (REPO_ROOT / page).read_text(encoding="utf-8")


def fenced_blocks(text: str, language: str) -> list[str]:
    """The ``language`` code blocks of a Markdown text, their list indentation removed."""
    blocks = re.findall(rf"^( *)```{language}\n(.*?)^\1```$", text, flags=re.M | re.S)
    return [re.sub(rf"^{indent}", "", body, flags=re.M) for indent, body in blocks]


# ------------------------------------------------------------------------------- README vs the pages
SHARED_WORDS = 20
"""Words in a row the README may share with a reference page: a sentence or more is a copy to keep
in one place (the page), with a link from the README."""


def prose_words(text: str) -> list[str]:
    """The words of a page's prose: no code blocks, no table rows, no list of ``--help``'s groups (which
    the README and docs/options.md both give, checked against the parser below)."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"^\|.*\|$", " ", text, flags=re.M)
    text = re.sub(r"in groups \([^)]*\)", " ", text)
    return text.split()


@pytest.mark.parametrize(
    "page",
    [
        "docs/options.md",
        "docs/training.md",
        "docs/python-api.md",
        "docs/spaces-and-policies.md",
        "docs/multi-machine.md",
        "docs/emulators.md",
        "docs/tuning.md",
        "deploy/README.md",
    ],
)
def test_the_readme_links_a_reference_page_rather_than_repeating_it(page: str) -> None:
    readme = read("README.md")
    readme = readme[: readme.index("## Figures")] + readme[readme.index("## Tests") :]
    words = prose_words(readme)
    runs = {tuple(words[i : i + SHARED_WORDS]) for i in range(len(words) - SHARED_WORDS + 1)}
    other = prose_words(read(page))
    copied = [
        " ".join(other[i : i + SHARED_WORDS])
        for i in range(len(other) - SHARED_WORDS + 1)
        if tuple(other[i : i + SHARED_WORDS]) in runs
    ]
    assert copied == [], f"README.md repeats {page}: {copied[0]!r} ..."


# ------------------------------------------------------------------------------- option groups
def help_groups(command: str) -> list[str]:
    """The titles of the option groups ``oakemu COMMAND --help`` prints, in order, without "settings"."""
    _, commands = cli.build_parser()
    titles = [group.title for group in commands[command]._action_groups if group._group_actions]
    return [title.removesuffix(" settings") for title in titles if title not in ("options",)]


@pytest.mark.parametrize("page", ["README.md", "docs/options.md"])
def test_the_pages_list_the_option_groups_as_train_help_prints_them(page: str) -> None:
    text = " ".join(read(page).split())
    match = re.search(
        r"`oakemu train --help` lists (?:every option|the options), in groups \(([^)]*)\)", text
    )
    assert match, f"{page}: no list of the --help groups"
    assert [group.strip() for group in match.group(1).split(",")] == help_groups("train")


def test_options_md_says_which_groups_learner_and_actor_have() -> None:
    text = " ".join(read("docs/options.md").split())
    train, learner, actor = help_groups("train"), help_groups("learner"), help_groups("actor")
    assert learner == [group for group in train if group != "starting point"] + ["security"]
    assert "`oakemu learner` has no starting point and adds security" in text
    assert f"(`oakemu actor --help`: {', '.join(actor)})" in text


# ------------------------------------------------------------------------------- actor layouts
def test_the_readme_states_the_actor_layout_its_breakout_command_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default Breakout run's figure names its layout: the command as written gives it on the
    2-core machine the README's times are for, and the default split is the fitted one."""
    import shlex

    from oakemu_core import config as config_module
    from oakemu_core.actor.fitting import fit_actors
    from oakemu_core.config import load_config

    monkeypatch.setattr(config_module, "available_cpus", lambda: 2)
    text = " ".join(read("README.md").split())
    match = re.search(
        r"`\./run\.sh train ([^`]*--total-env-steps 150000[^`]*)`[^()]*\((\d+) actors? x (\d+) envs\)",
        text,
    )
    assert match, "README: no layout for the 150000-step Breakout command"
    config = load_config(shlex.split(match.group(1)))
    assert (config.num_actors, config.envs_per_actor) == (int(match.group(2)), int(match.group(3)))
    assert "split over 1 actor on 2 cores (2 x 8 on 4, 4 x 4 on 8+)" in text
    fitted = {
        cpus: fit_actors(None, 8, None, envs_per_actor_given=False, cpus=cpus) for cpus in (2, 4, 8)
    }
    assert fitted == {2: (1, 16), 4: (2, 8), 8: (4, 4)}


# ------------------------------------------------------------------------------- run names
def test_each_page_says_what_an_existing_run_name_does_under_the_other_command() -> None:
    """``oakemu train --run-name`` of an existing run is refused; ``oakemu learner --run-name`` resumes
    it (tests/run/test_run_claims.py checks both): each page names the other command's way."""
    training = " ".join(read("docs/training.md").split())
    multi_machine = " ".join(read("docs/multi-machine.md").split())
    assert (
        "`oakemu learner --run-name NAME`" in training and "continues an existing run" in training
    )
    assert "`oakemu train` differs: it refuses the name of an existing run" in multi_machine


# ------------------------------------------------------------------------------- tuning
def test_docs_tuning_explains_every_study_option_of_tune_help() -> None:
    page = read("docs/tuning.md")
    _, commands = cli.build_parser()
    groups = [
        g for g in commands["tune"]._action_groups if g.title in ("study", "storage and workers")
    ]
    options = [
        option
        for group in groups
        for action in group._group_actions
        for option in action.option_strings
    ]
    assert {"--space", "--jobs", "--storage", "--objective", "--pruner", "--timeout"} <= set(
        options
    )
    missing = [option for option in options if f"`{option}" not in page]
    assert missing == [], f"docs/tuning.md does not explain {missing}"


def test_the_search_space_of_docs_tuning_is_a_valid_space(tmp_path: Path) -> None:
    from oakemu_core.config import make_config
    from oakemu_core.tuning.search_space import load_space

    [block] = fenced_blocks(read("docs/tuning.md"), "toml")
    path = tmp_path / "space.toml"
    path.write_text(block, encoding="utf-8")
    space = load_space(path)
    kinds = {parameter.name: parameter.kind for parameter in space.parameters}
    assert kinds == {"learning_rate": "float", "ppo_epochs": "int", "clip_coef": "categorical"}
    space.check(lambda **value: make_config(env_id="CartPole-v1", **value))


# ------------------------------------------------------------------------------- emulators
def test_the_saved_state_steps_of_docs_emulators_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/emulators.md, "Saved states": the settings file and ``states/`` made first, the Python snippet
    saves a state, and with the ``states`` line uncommented episodes start from it."""
    pytest.importorskip(
        "pyboy", reason="PyBoy is not installed (pip install 'oakemu-rl[emulators]')"
    )
    from oakemu_core.envs.emulators import make_emulator_env
    from oakemu_core.envs.emulators.testrom import A_COUNTER, write_test_rom

    page = read("docs/emulators.md")
    step = page[page.index("3. **Saved states.**") : page.index("4. **Reward spec.**")]
    [settings], [snippet] = fenced_blocks(step, "toml"), fenced_blocks(step, "python")
    assert "`mkdir states`" in step
    monkeypatch.chdir(tmp_path)
    write_test_rom(tmp_path / "roms" / "Game.gb")  # step 1: the ROM, at the page's path
    (tmp_path / "emulator.toml").write_text(settings, encoding="utf-8")
    (tmp_path / "states").mkdir()
    exec(compile(snippet, "docs/emulators.md", "exec"), {})
    assert (tmp_path / "states" / "start.state").stat().st_size > 0
    uncommented = re.sub(r"^# (states = .*?)\s+#.*$", r"\1", settings, flags=re.M)
    assert uncommented != settings
    (tmp_path / "emulator.toml").write_text(uncommented, encoding="utf-8")
    env = make_emulator_env(
        "gameboy:roms/Game.gb", max_episode_steps=None, settings_file="emulator.toml", seed=0
    )
    try:
        env.reset(seed=0)
        assert (
            env.unwrapped.read_byte(A_COUNTER) == 3
        )  # the snippet pressed A (action 1) three times
    finally:
        env.close()
