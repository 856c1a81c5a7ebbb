"""Game Boy backend (PyBoy) on the generated test ROM: env behaviour, RAM rewards, states, bad inputs.

The ROM (oakemu_core/envs/emulators/testrom.py) counts new presses of A at 0xC000 and keeps an (x, y)
position at 0xC001/0xC002 moved by the direction buttons.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyboy", reason="PyBoy is not installed (pip install 'oakemu-rl[emulators]')")

from oakemu_core.envs.emulators import (
    EmulatorConfigError,
    is_emulator_env,
    make_emulator_env,
    validate_emulator_env,
)
from oakemu_core.envs.emulators.gameboy import check_gameboy_rom
from oakemu_core.envs.emulators.ram import read_value
from oakemu_core.envs.emulators.settings import RamValue
from oakemu_core.envs.emulators.testrom import (
    A_COUNTER,
    NINTENDO_LOGO,
    X_POSITION,
    build_test_rom,
    global_checksum,
    header_checksum,
    write_test_rom,
)

A_REWARD = """
[[gameboy.reward]]
name = "a_presses"
kind = "delta"
address = 0xC000
"""
ACTIONS = [
    None,
    "a",
    "b",
    "start",
    "select",
    "up",
    "down",
    "left",
    "right",
]  # the default action set


def position_hook(read_byte: Callable[[int], int], state: dict[str, Any]) -> float:
    """Reward hook for the tests: 0.5 per step while x > 0; counts its calls in the episode state."""
    state["calls"] = state.get("calls", 0) + 1
    return 0.5 if read_byte(X_POSITION) > 0 else 0.0


@pytest.fixture(scope="module")
def rom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_rom(tmp_path_factory.mktemp("rom") / "test.gb")


@pytest.fixture
def settings(tmp_path: Path) -> Callable[[str], Path]:
    """Write a settings file: ``[gameboy]`` with 4 frames per action (press 2) plus ``extra`` TOML."""

    def write(extra: str = A_REWARD, *, head: str = "") -> Path:
        path = tmp_path / "emulator.toml"
        body = (
            textwrap.dedent(head)
            + "\n[gameboy]\nframes_per_action = 4\npress_frames = 2\n"
            + textwrap.dedent(extra)
        )
        path.write_text(body)
        return path

    return write


@pytest.fixture
def make(rom: Path) -> Iterator[Callable[..., Any]]:
    """``make(settings_path, max_episode_steps=None, rom=...)``: an env, closed after the test."""
    envs: list[Any] = []

    def build(
        settings_path: Path,
        max_episode_steps: int | None = None,
        rom_path: Path = rom,
        seed: int = 0,
    ) -> Any:
        env = make_emulator_env(
            f"gameboy:{rom_path}",
            max_episode_steps=max_episode_steps,
            settings_file=str(settings_path),
            seed=seed,
        )
        envs.append(env)
        return env

    yield build
    for env in envs:
        env.close()


# ----------------------------------------------------------------------------------------- test ROM


def test_generated_rom_has_a_valid_header(rom: Path) -> None:
    data = rom.read_bytes()
    assert len(data) == 32768
    assert data[0x104:0x134] == NINTENDO_LOGO
    assert data[0x14D] == header_checksum(data)
    assert (data[0x14E] << 8 | data[0x14F]) == global_checksum(data)
    header = check_gameboy_rom(rom)
    assert header.title == "OAKEMU TEST"
    assert not header.has_cartridge_ram


def test_other_ids_are_not_owned() -> None:
    assert (
        make_emulator_env("CartPole-v1", max_episode_steps=None, settings_file=None, seed=None)
        is None
    )
    assert not is_emulator_env("ALE/Breakout-v5")
    validate_emulator_env("CartPole-v1", None)  # not ours: nothing to check


# ----------------------------------------------------------------------------------------- env


def test_reset_and_step_give_stacked_uint8_frames(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(settings())
    assert env.action_space.n == 9
    assert env.observation_space.shape == (4, 72, 80)
    observation, _ = env.reset(seed=3)
    assert observation.shape == (4, 72, 80) and observation.dtype == np.uint8
    assert env.observation_space.contains(observation)
    assert all(
        np.array_equal(observation[0], frame) for frame in observation
    )  # reset fills the stack
    for _ in range(3):
        observation, _, terminated, truncated, _ = env.step(8)  # right: the block moves 8 px
    assert observation.shape == (4, 72, 80) and observation.dtype == np.uint8
    assert not np.array_equal(observation[0], observation[-1]), "the screen must follow the buttons"
    assert not terminated and not truncated


@pytest.mark.parametrize("action", range(9))
def test_ram_reward_moves_only_for_the_right_button(
    action: int, make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(settings())
    env.reset(seed=0)
    rewards = [env.step(action)[1] for _ in range(3)]
    expected = 1.0 if ACTIONS[action] == "a" else 0.0
    assert rewards == [expected] * 3, f"action {action} ({ACTIONS[action]}): rewards {rewards}"
    assert env.unwrapped.read_byte(A_COUNTER) == (3 if expected else 0)


def test_custom_button_set_and_no_noop(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(settings('buttons = ["b", "a"]\nnoop_action = false\n' + A_REWARD))
    env.reset(seed=0)
    assert env.action_space.n == 2
    assert [env.step(a)[1] for a in (0, 1, 0, 1)] == [0.0, 1.0, 0.0, 1.0]


def test_exploration_reward_counts_each_new_tile_once(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(
        settings("""
        [[gameboy.reward]]
        name = "explore"
        kind = "new_value"
        addresses = [0xC001, 0xC002]
        weight = 0.25
    """)
    )
    env.reset(seed=0)
    right, left, down = 8, 7, 6
    rewards = [env.step(a)[1] for a in (right, left, right, down, left, 0)]
    # (1,0) new, (0,0) start tile, (1,0) seen, (1,1) new, (0,1) new, no-op stays
    assert rewards == [0.25, 0.0, 0.0, 0.25, 0.25, 0.0]
    env.reset()
    assert env.step(right)[1] == 0.25, "exploration memory is per episode"


def test_reward_hook_and_ram_observation(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(
        settings("""
        reward_hook = "tests.envs.test_emulators_gameboy:position_hook"
        [[gameboy.ram_observation]]
        key = "position"
        addresses = [0xC001, 0xC002]
        [[gameboy.ram_observation]]
        key = "presses"
        address = 0xC000
        normalize = false
    """)
    )
    assert set(env.observation_space.spaces) == {"screen", "position", "presses"}
    observation, _ = env.reset(seed=0)
    assert observation["screen"].shape == (4, 72, 80) and observation["screen"].dtype == np.uint8
    assert observation["position"].dtype == np.float32
    assert env.observation_space.contains(observation)
    observation, reward, *_ = env.step(8)
    assert reward == 0.5
    np.testing.assert_allclose(observation["position"], [1 / 255, 0.0])
    observation, reward, *_ = env.step(1)
    assert observation["presses"].tolist() == [1.0]
    assert env.unwrapped.reward_terms == {"hook": 0.5}


def test_time_limit_truncates_and_argument_overrides_settings(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(settings("max_episode_steps = 7\n" + A_REWARD))
    env.reset(seed=0)
    flags = [env.step(0)[2:4] for _ in range(7)]
    assert flags == [(False, False)] * 6 + [(False, True)]
    env = make(settings("max_episode_steps = 7\n" + A_REWARD), max_episode_steps=3)
    env.reset(seed=0)
    assert [env.step(1)[3] for _ in range(3)] == [False, False, True]


def test_terminate_condition_ends_the_episode(
    make: Callable[..., Any], settings: Callable[..., Path]
) -> None:
    env = make(settings(A_REWARD + "[[gameboy.terminate]]\naddress = 0xC000\nequals = 2\n"))
    env.reset(seed=0)
    assert [env.step(1)[2] for _ in range(2)] == [False, True]


def test_saved_state_start(
    make: Callable[..., Any], settings: Callable[..., Path], tmp_path: Path
) -> None:
    source = make(settings())
    source.reset(seed=0)
    for action in (1, 1, 1, 8, 8):  # A x3, right x2
        source.step(action)
    state_a = tmp_path / "three_presses.state"
    state_a.write_bytes(source.unwrapped.save_state())
    source.step(6)  # down
    state_b = tmp_path / "moved_down.state"
    state_b.write_bytes(source.unwrapped.save_state())

    env = make(
        settings('states = ["three_presses.state"]\n' + A_REWARD)
    )  # relative to the settings file
    env.reset(seed=0)
    assert env.unwrapped.read_byte(A_COUNTER) == 3
    assert env.unwrapped.read_byte(X_POSITION) == 2
    assert env.step(1)[1] == 1.0, "the reward counts from the state's value, not from 0"
    assert env.unwrapped.read_byte(A_COUNTER) == 4
    env.reset()
    assert env.unwrapped.read_byte(A_COUNTER) == 3, "every episode starts from the state again"

    pool = make(settings(f'states = ["{state_a}", "{state_b}"]\n' + A_REWARD))
    starts = set()
    for episode in range(12):
        pool.reset(seed=episode)
        starts.add(pool.unwrapped.read_byte(0xC002))
    assert starts == {0, 1}, "a pool is sampled per episode"

    per_env = make(
        settings(f'states = ["{state_a}", "{state_b}"]\nstate_selection = "per_env"\n' + A_REWARD)
    )
    per_env.reset(seed=5)
    first = per_env.unwrapped.read_byte(0xC002)
    for _ in range(6):
        per_env.reset()
        assert per_env.unwrapped.read_byte(0xC002) == first


def test_read_value_kinds() -> None:
    memory = bytearray(0x10000)
    memory[0xC000:0xC003] = bytes([0x34, 0x12, 0x99])
    read = memory.__getitem__
    assert read_value(read, 0xC000, RamValue(address=0xC000)) == 0x34
    assert read_value(read, 0xC000, RamValue(address=0xC000, read="u16le")) == 0x1234
    assert read_value(read, 0xC000, RamValue(address=0xC000, read="u16be")) == 0x3412
    assert read_value(read, 0xC000, RamValue(address=0xC000, read="bcd", size=3)) == 341299


def test_signed_delta_and_sum_over_addresses() -> None:
    from oakemu_core.envs.emulators.ram import RewardTracker
    from oakemu_core.envs.emulators.settings import RewardTerm

    memory = bytearray(0x10000)
    read = memory.__getitem__
    levels = RewardTerm(name="levels", kind="delta", addresses=[0xD18C, 0xD1B8], weight=2.0)
    money = RewardTerm(
        name="money", kind="delta", address=0xD347, read="bcd", size=3, signed=True, weight=0.001
    )
    tracker = RewardTracker([levels, money])
    memory[0xD18C], memory[0xD1B8] = 5, 3
    memory[0xD347:0xD34A] = bytes([0x00, 0x30, 0x00])  # 3000
    tracker.reset(read)
    memory[0xD1B8] = 5  # +2 levels
    memory[0xD348] = 0x10  # 1000: -2000
    reward, parts = tracker.step(read)
    assert reward == pytest.approx(2.0)
    assert parts == {"levels": 4.0, "money": pytest.approx(-2.0)}
    memory[0xD18C] = 1  # a level sum that drops gives 0 (unsigned)
    assert tracker.step(read)[1]["levels"] == 0.0


# ----------------------------------------------------------------------------------------- bad inputs


def _expect_error(env_id: str, settings_path: Path | None, *fragments: str) -> str:
    with pytest.raises(EmulatorConfigError) as caught:
        validate_emulator_env(env_id, None if settings_path is None else str(settings_path))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture
def no_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation must not start an emulator: PyBoy's constructor fails the test."""
    import pyboy

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("validate_emulator_env started an emulator")

    monkeypatch.setattr(pyboy, "PyBoy", refuse)


def test_valid_settings_validate_without_an_emulator(
    rom: Path, settings: Callable[..., Path], no_emulator: None
) -> None:
    validate_emulator_env(f"gameboy:{rom}", str(settings()))


def test_missing_rom(tmp_path: Path, settings: Callable[..., Path], no_emulator: None) -> None:
    _expect_error(f"gameboy:{tmp_path / 'nope.gb'}", settings(), "nope.gb", "not found")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"just some text\n", "at least 32768 bytes"),
        (bytes(32768), "not a Game Boy ROM (the Nintendo logo"),
    ],
)
def test_file_that_is_not_a_rom(
    content: bytes, fragment: str, tmp_path: Path, settings: Callable[..., Path], no_emulator: None
) -> None:
    path = tmp_path / "notes.gb"
    path.write_bytes(content)
    _expect_error(f"gameboy:{path}", settings(), "notes.gb", fragment)


def test_corrupt_header_checksum(
    tmp_path: Path, settings: Callable[..., Path], no_emulator: None
) -> None:
    data = bytearray(build_test_rom())
    data[0x134] ^= 0x01  # change the title, keep the old checksum
    path = tmp_path / "corrupt.gb"
    path.write_bytes(bytes(data))
    _expect_error(f"gameboy:{path}", settings(), "header checksum")


@pytest.mark.parametrize(
    ("address", "read", "fragment"),
    [
        ("0x0150", "u8", "0x0150"),  # ROM: not game state
        ("0xFEA0", "u8", "unusable"),
        ("0xA000", "u8", "cartridge RAM but the ROM header declares none"),
        ("0xDFFF", "u16le", "0xDFFF"),  # the second byte leaves work RAM
        ("0x10000", "u8", "0x10000"),
    ],
)
def test_reward_spec_with_an_invalid_address(
    address: str,
    read: str,
    fragment: str,
    rom: Path,
    settings: Callable[..., Path],
    no_emulator: None,
) -> None:
    path = settings(
        f'[[gameboy.reward]]\nname = "bad"\nkind = "delta"\naddress = {address}\nread = "{read}"\n'
    )
    _expect_error(f"gameboy:{rom}", path, "gameboy.reward[0]", fragment)


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ("", ("at least one [[gameboy.reward]]",)),
        ("prss_frames = 1\n" + A_REWARD, ("gameboy.prss_frames", "unknown setting")),
        ('reward_hook = "no_such_module_xyz:f"\n', ("reward_hook", "no_such_module_xyz")),
        ('reward_hook = "tests.envs.test_emulators_gameboy:missing"\n', ("reward_hook", "missing")),
        ('reward_hook = "not a hook"\n', ("module:function",)),
        ('states = ["missing.state"]\n' + A_REWARD, ("gameboy.states[0]", "missing.state")),
        ('buttons = ["a", "jump"]\n' + A_REWARD, ("buttons",)),
        (
            '[[gameboy.reward]]\nname = "x"\nkind = "delta"\n',
            ("exactly one of 'address' or 'addresses'",),
        ),
        ('[[gameboy.reward]]\nname = "x"\nkind = "maximum"\naddress = 0xC000\n', ("kind",)),
    ],
)
def test_bad_settings(
    extra: str,
    fragments: tuple[str, ...],
    rom: Path,
    settings: Callable[..., Path],
    no_emulator: None,
) -> None:
    _expect_error(f"gameboy:{rom}", settings(extra), *fragments)


def test_press_frames_must_leave_time_to_release(
    rom: Path, tmp_path: Path, no_emulator: None
) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[gameboy]\nframes_per_action = 4\npress_frames = 4\n" + A_REWARD)
    _expect_error(f"gameboy:{rom}", path, "press_frames", "release")


def test_missing_settings_file_section_and_syntax(
    rom: Path, tmp_path: Path, no_emulator: None
) -> None:
    _expect_error(f"gameboy:{rom}", None, "[gameboy]", "no settings file")
    _expect_error(f"gameboy:{rom}", tmp_path / "absent.toml", "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[gameboy\n")
    _expect_error(f"gameboy:{rom}", broken, "not valid TOML")
    _expect_error("gameboy:", None, "expected e.g.")


def test_a_state_pyboy_cannot_load(
    rom: Path, settings: Callable[..., Path], tmp_path: Path
) -> None:
    (tmp_path / "garbage.state").write_bytes(b"\x01\x02not a state")
    with pytest.raises(EmulatorConfigError, match=r"gameboy.states\[0\]"):
        make_emulator_env(
            f"gameboy:{rom}",
            max_episode_steps=None,
            seed=0,
            settings_file=str(settings('states = ["garbage.state"]\n' + A_REWARD)),
        )


def test_pokemon_example_settings_are_valid() -> None:
    """examples/pokemon_red/emulator.toml parses and its addresses are valid (Pokemon Red has cartridge RAM)."""
    from oakemu_core.envs.emulators.ram import check_gameboy_addresses
    from oakemu_core.envs.emulators.settings import load_emulator_settings

    path = Path(__file__).resolve().parents[2] / "examples" / "pokemon_red" / "emulator.toml"
    settings, _ = load_emulator_settings(path)
    assert settings.gameboy is not None
    check_gameboy_addresses(settings.gameboy, has_cartridge_ram=True)
    assert [term.name for term in settings.gameboy.reward] == ["explore", "levels", "badges"]
