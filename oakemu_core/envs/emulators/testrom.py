"""A tiny Game Boy "game" assembled in Python, for tests and benchmarks (PyBoy ships no ROM).

:func:`build_test_rom` returns the bytes of a valid 32 KiB ROM-only cartridge: entry point,
Nintendo logo, title, header checksum and global checksum are all correct, so PyBoy (and the
header checks of :func:`oakemu_core.envs.emulators.gameboy.check_gameboy_rom`) accept it.

The program polls the joypad once per frame (in vertical blank) and reacts to *new presses*
(a button that was up the previous frame and is down now), as games do:

=========  =========================================================================
address    meaning (all u8 in work RAM)
=========  =========================================================================
``C000``   A-press counter: +1 per new press of A (the "rewarded button")
``C001``   x position: +1 per new press of Right, -1 per Left (wraps at 256)
``C002``   y position: +1 per new press of Down, -1 per Up (wraps at 256)
``C003``   action buttons down last frame (bit 0 A, 1 B, 2 Select, 3 Start)
``C004``   frame counter (+1 per frame, wraps)
``C005``   direction buttons down last frame (bit 0 Right, 1 Left, 2 Up, 3 Down)
``C006``   B-press counter: +1 per new press of B (a "wrong button" for tests)
=========  =========================================================================

The screen shows a black 8x8 block that moves 8 pixels per direction press (background scroll
registers) on a background whose shade flips with the parity of the A counter, so the screen
depends on the buttons pressed too.  Holding a button without releasing it counts once: an
agent must press and release, as a human would.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "A_COUNTER",
    "B_COUNTER",
    "FRAME_COUNTER",
    "NINTENDO_LOGO",
    "X_POSITION",
    "Y_POSITION",
    "build_test_rom",
    "global_checksum",
    "header_checksum",
    "write_test_rom",
]

A_COUNTER = 0xC000
X_POSITION = 0xC001
Y_POSITION = 0xC002
FRAME_COUNTER = 0xC004
B_COUNTER = 0xC006
_PREV_ACTION = 0xC003
_PREV_DIRECTION = 0xC005

ROM_SIZE = 0x8000  # 32 KiB, cartridge type 0x00 (ROM only), ROM size code 0x00

# The 48 bytes every cartridge carries at 0x104-0x133 (checked by the boot ROM; Pan Docs, "The
# Cartridge Header").
NINTENDO_LOGO = bytes.fromhex(
    "CEED6666CC0D000B03730083000C000D0008111F8889000EDCCC6EE6DDDDD999BBBB67636E0EECCCDDDC999FBBB9333E"
)


def header_checksum(rom: bytes | bytearray) -> int:
    """The header checksum (byte 0x14D): ``x = x - rom[i] - 1`` over 0x134..0x14C, mod 256."""
    value = 0
    for byte in rom[0x134:0x14D]:
        value = (value - byte - 1) & 0xFF
    return value


def global_checksum(rom: bytes | bytearray) -> int:
    """The global checksum (bytes 0x14E-0x14F, big endian): sum of all other bytes, mod 65536."""
    return (sum(rom) - rom[0x14E] - rom[0x14F]) & 0xFFFF


class _Assembler:
    """Just enough of an SM83 assembler for the test program: bytes, labels, relative jumps."""

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self.code = bytearray()
        self.labels: dict[str, int] = {}
        self.fixups: list[tuple[int, str]] = []  # (offset of the displacement byte, label)

    def emit(self, *values: int) -> None:
        self.code.extend(value & 0xFF for value in values)

    def emit16(self, opcode: int, value: int) -> None:
        self.emit(opcode, value & 0xFF, value >> 8)

    def label(self, name: str) -> None:
        self.labels[name] = self.origin + len(self.code)

    def jr(self, opcode: int, label: str) -> None:
        """``JR`` (0x18), ``JR NZ`` (0x20), ``JR Z`` (0x28) to ``label``."""
        self.emit(opcode, 0)
        self.fixups.append((len(self.code) - 1, label))

    def assemble(self) -> bytes:
        for offset, label in self.fixups:
            displacement = self.labels[label] - (self.origin + offset + 1)
            if not -128 <= displacement <= 127:
                raise AssertionError(f"relative jump to {label} out of range ({displacement})")
            self.code[offset] = displacement & 0xFF
        return bytes(self.code)


# SM83 opcodes used below.
_LD_A_N, _LD_B_N, _LD_HL_NN, _LD_SP_NN, _LD_BC_NN = 0x3E, 0x06, 0x21, 0x31, 0x01
_LD_NN_A, _LD_A_NN, _LDH_N_A, _LDH_A_N = 0xEA, 0xFA, 0xE0, 0xF0
_LDI_HL_A, _INC_HL_MEM, _DEC_HL_MEM, _DEC_B, _DEC_BC = 0x22, 0x34, 0x35, 0x05, 0x0B
_XOR_A, _CPL, _INC_A, _AND_N, _OR_N, _CP_N, _AND_B, _AND_C, _OR_C = (
    0xAF,
    0x2F,
    0x3C,
    0xE6,
    0xF6,
    0xFE,
    0xA0,
    0xA1,
    0xB1,
)
_LD_B_A, _LD_C_A, _LD_D_A, _LD_E_A, _LD_A_B, _LD_A_C = 0x47, 0x4F, 0x57, 0x5F, 0x78, 0x79
_JR, _JR_NZ, _JR_Z, _JP_NN, _DI, _NOP, _CB = 0x18, 0x20, 0x28, 0xC3, 0xF3, 0x00, 0xCB
_REG_B, _REG_C, _REG_D, _REG_E, _REG_A = 0, 1, 2, 3, 7


def _bit(asm: _Assembler, bit: int, register: int) -> None:
    asm.emit(_CB, 0x40 + bit * 8 + register)


def _sla_a(asm: _Assembler) -> None:
    asm.emit(_CB, 0x27)


def _wait_vblank_start(asm: _Assembler, name: str) -> None:
    """Wait until LY leaves line 144, then until it reaches 144 again: one pass per frame."""
    asm.label(f"{name}_leave")
    asm.emit(_LDH_A_N, 0x44, _CP_N, 144)
    asm.jr(_JR_Z, f"{name}_leave")
    asm.label(f"{name}_enter")
    asm.emit(_LDH_A_N, 0x44, _CP_N, 144)
    asm.jr(_JR_NZ, f"{name}_enter")


def _read_joypad(asm: _Assembler, select: int) -> None:
    """A = the 4 buttons of the group selected by ``select`` (0x10 action, 0x20 direction), 1 = down."""
    asm.emit(_LD_A_N, select, _LDH_N_A, 0x00)
    for _ in range(4):  # let the lines settle, as games do
        asm.emit(_LDH_A_N, 0x00)
    asm.emit(_CPL, _AND_N, 0x0F)


def _program() -> bytes:
    asm = _Assembler(origin=0x150)
    asm.emit(_DI)
    asm.emit16(_LD_SP_NN, 0xFFFE)
    asm.emit(_XOR_A)
    for address in range(0xC000, 0xC008):
        asm.emit16(_LD_NN_A, address)
    # Graphics: LCD off in vertical blank, tile 0 blank, tile 1 solid (colour 3), map all tile 0
    # except the top-left tile, then LCD on (BG on, tile data 0x8000, map 0x9800).
    _wait_vblank_start(asm, "init")
    asm.emit(_XOR_A, _LDH_N_A, 0x40)
    asm.emit16(_LD_HL_NN, 0x8000)
    asm.emit(_LD_B_N, 16)
    asm.label("tile0")
    asm.emit(_LDI_HL_A, _DEC_B)
    asm.jr(_JR_NZ, "tile0")
    asm.emit(_LD_A_N, 0xFF, _LD_B_N, 16)
    asm.label("tile1")
    asm.emit(_LDI_HL_A, _DEC_B)
    asm.jr(_JR_NZ, "tile1")
    asm.emit16(_LD_HL_NN, 0x9800)
    asm.emit16(_LD_BC_NN, 0x0400)
    asm.label("map")
    asm.emit(_XOR_A, _LDI_HL_A, _DEC_BC, _LD_A_B, _OR_C)
    asm.jr(_JR_NZ, "map")
    asm.emit(_LD_A_N, 1)
    asm.emit16(_LD_NN_A, 0x9800)
    asm.emit(_XOR_A, _LDH_N_A, 0x42, _LDH_N_A, 0x43)  # SCY = SCX = 0
    asm.emit(_LD_A_N, 0xE4, _LDH_N_A, 0x47)  # BGP
    asm.emit(_LD_A_N, 0x91, _LDH_N_A, 0x40)  # LCDC: on
    # Main loop, once per frame.
    asm.label("main")
    _wait_vblank_start(asm, "frame")
    asm.emit16(_LD_HL_NN, FRAME_COUNTER)
    asm.emit(_INC_HL_MEM)
    _read_joypad(asm, 0x10)
    asm.emit(_LD_B_A)
    _read_joypad(asm, 0x20)
    asm.emit(_LD_C_A)
    asm.emit(_LD_A_N, 0x30, _LDH_N_A, 0x00)
    # D = new action presses, E = new direction presses; remember this frame's buttons.
    asm.emit16(_LD_A_NN, _PREV_ACTION)
    asm.emit(_CPL, _AND_B, _LD_D_A, _LD_A_B)
    asm.emit16(_LD_NN_A, _PREV_ACTION)
    asm.emit16(_LD_A_NN, _PREV_DIRECTION)
    asm.emit(_CPL, _AND_C, _LD_E_A, _LD_A_C)
    asm.emit16(_LD_NN_A, _PREV_DIRECTION)
    for register, bit, address, opcode, name in (
        (_REG_D, 0, A_COUNTER, _INC_HL_MEM, "a"),
        (_REG_D, 1, B_COUNTER, _INC_HL_MEM, "b"),
        (_REG_E, 0, X_POSITION, _INC_HL_MEM, "right"),
        (_REG_E, 1, X_POSITION, _DEC_HL_MEM, "left"),
        (_REG_E, 2, Y_POSITION, _DEC_HL_MEM, "up"),
        (_REG_E, 3, Y_POSITION, _INC_HL_MEM, "down"),
    ):
        _bit(asm, bit, register)
        asm.jr(_JR_Z, f"skip_{name}")
        asm.emit16(_LD_HL_NN, address)
        asm.emit(opcode)
        asm.label(f"skip_{name}")
    # Screen: SCX = -8x, SCY = -8y moves the block; background shade = A counter parity.
    for position, register in ((X_POSITION, 0x43), (Y_POSITION, 0x42)):
        asm.emit16(_LD_A_NN, position)
        _sla_a(asm)
        _sla_a(asm)
        _sla_a(asm)
        asm.emit(_CPL, _INC_A, _LDH_N_A, register)
    asm.emit16(_LD_A_NN, A_COUNTER)
    asm.emit(_AND_N, 0x01, _OR_N, 0xC0, _LDH_N_A, 0x47)
    asm.emit16(_JP_NN, asm.labels["main"])
    return asm.assemble()


def build_test_rom(title: str = "OAKEMU TEST") -> bytes:
    """The test ROM (32768 bytes) with valid logo, header checksum and global checksum.

    Args:
        title: up to 15 ASCII characters stored at 0x134 (what ``PyBoy.cartridge_title`` reports).
    """
    encoded = title.encode("ascii")
    if len(encoded) > 15:
        raise ValueError(f"title: expected at most 15 ASCII characters, received {title!r}")
    rom = bytearray(ROM_SIZE)
    rom[0x100:0x104] = bytes([_NOP, _JP_NN, 0x50, 0x01])  # NOP; JP 0x0150
    rom[0x104:0x134] = NINTENDO_LOGO
    rom[0x134 : 0x134 + len(encoded)] = encoded
    rom[0x143] = 0x00  # DMG only
    rom[0x147] = 0x00  # cartridge type: ROM only
    rom[0x148] = 0x00  # ROM size: 32 KiB
    rom[0x149] = 0x00  # no cartridge RAM
    rom[0x14A] = 0x01  # destination: overseas
    rom[0x14B] = 0x00
    program = _program()
    rom[0x150 : 0x150 + len(program)] = program
    rom[0x14D] = header_checksum(rom)
    checksum = global_checksum(rom)
    rom[0x14E] = checksum >> 8
    rom[0x14F] = checksum & 0xFF
    return bytes(rom)


def write_test_rom(path: str | Path) -> Path:
    """Write :func:`build_test_rom` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(build_test_rom())
    return path
