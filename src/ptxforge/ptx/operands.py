"""Operands of PTX instructions: registers, predicates, immediates, addresses, special registers.

Operands know how to print themselves; instructions never build operand text by hand.
Floating-point immediates are printed in PTX's exact hex form (``0f3F800000``) so that
a constant in a kernel is the bit pattern the Python value has, with no decimal rounding.
An immediate that its instruction's type cannot hold is refused, since ptxas would
silently truncate it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# PTX fundamental types a register can hold.
REG_TYPES = frozenset(
    "pred b8 b16 b32 b64 u8 u16 u32 u64 s8 s16 s32 s64 f16 f16x2 bf16 bf16x2 f32 f64".split()
)


INTEGER_TYPES = frozenset(f"{kind}{bits}" for kind in "bus" for bits in (8, 16, 32, 64))


def bit_width(ptx_type: str) -> int:
    """Width in bits of a PTX scalar or packed type ('f32' -> 32, 'e4m3x2' -> 16)."""
    if ptx_type == "pred":
        return 1
    digits = "".join(ch for ch in ptx_type if ch.isdigit())
    if ptx_type.endswith("x2"):
        return {"f16x2": 32, "bf16x2": 32, "e4m3x2": 16, "e5m2x2": 16}[ptx_type]
    return int(digits)


@dataclass(frozen=True)
class Reg:
    """A virtual register. ``name`` includes the leading '%'."""

    name: str
    type: str

    def __str__(self) -> str:
        return self.name

    def __invert__(self) -> "NegPred":
        if self.type != "pred":
            raise TypeError(f"only predicates can be negated, {self.name} is .{self.type}")
        return NegPred(self)


@dataclass(frozen=True)
class NegPred:
    """A negated predicate, as used in guards (``@!p``) and some operands (``!p``)."""

    pred: Reg

    def __str__(self) -> str:
        return f"!{self.pred.name}"

    def __invert__(self) -> Reg:
        return self.pred


@dataclass(frozen=True)
class Special:
    """A special register such as ``%tid.x``; read it with ``mov``."""

    name: str
    type: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Symbol:
    """A named kernel-level entity used as an operand: a shared buffer, a parameter, a label."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Address:
    """A memory operand ``[base+offset]``; base is a register or a symbol."""

    base: Reg | Symbol
    offset: int = 0

    def __str__(self) -> str:
        if self.offset == 0:
            return f"[{self.base}]"
        sign = "+" if self.offset > 0 else "-"
        return f"[{self.base}{sign}{abs(self.offset)}]"

    def __add__(self, more: int) -> "Address":
        return Address(self.base, self.offset + more)


def addr(base: Reg | Symbol, offset: int = 0) -> Address:
    """``[base+offset]``."""
    return Address(base, offset)


@dataclass(frozen=True)
class Vector:
    """A brace-enclosed register list ``{%r0, %r1}``: vector loads/stores, packing, wgmma fragments."""

    regs: tuple

    def __str__(self) -> str:
        return "{" + ", ".join(str(r) for r in self.regs) + "}"


def vec(*regs) -> Vector:
    if len(regs) == 1 and isinstance(regs[0], (list, tuple)):
        regs = tuple(regs[0])
    return Vector(tuple(regs))


Operand = Reg | NegPred | Special | Symbol | Address | Vector | int | float | str


def format_operand(value: Operand, ptx_type: str | None = None) -> str:
    """Render an operand; floats need the instruction type to pick f32 or f64 hex form.
    Raises ValueError for an immediate that ``ptx_type`` cannot hold: an integer outside
    both its signed and unsigned range, or a float beyond the largest finite f32."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        if ptx_type in INTEGER_TYPES:
            bits = bit_width(ptx_type)
            if not -(1 << (bits - 1)) <= value < 1 << bits:
                raise ValueError(f"immediate {value} does not fit .{ptx_type}")
        return str(value)
    if isinstance(value, float):
        if ptx_type == "f64":
            return "0d%016X" % struct.unpack("<Q", struct.pack("<d", value))[0]
        if ptx_type in ("f32", None):
            try:
                packed = struct.pack("<f", value)
            except OverflowError:  # finite, but rounds past the largest f32
                raise ValueError(f"immediate {value!r} overflows .f32") from None
            return "0f%08X" % struct.unpack("<I", packed)[0]
        raise TypeError(f"a float immediate needs an f32 or f64 instruction, not .{ptx_type}")
    return str(value)
