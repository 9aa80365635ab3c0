"""Integer, floating-point, logic, comparison and conversion instructions.

Each method emits exactly one instruction. The instruction type defaults to the
destination register's type; pass ``type=`` where PTX wants another (``mul.wide.u32``
takes its type from the sources, ``mov.b32 r, {h0, h1}`` packs halves).
"""

from __future__ import annotations

from .operands import Operand, Reg


def type_of(operand: Operand, given: str | None = None) -> str:
    """The PTX type an instruction should carry: ``given`` or the register's own."""
    if given is not None:
        return given
    if isinstance(operand, Reg):
        return operand.type
    raise TypeError(f"cannot infer the instruction type from {operand!r}; pass type=")


def bits_type(ptx_type: str) -> str:
    """Logic instructions take untyped bits of the register's width: u32 -> b32."""
    if ptx_type == "pred" or ptx_type.startswith("b"):
        return ptx_type
    return "b" + "".join(ch for ch in ptx_type if ch.isdigit())


def _suffix(*parts: str | None) -> str:
    return "".join(f".{p}" for p in parts if p)


class ArithmeticOps:
    # ---------------------------------------------------------------- moves
    def mov(self, d: Reg, a: Operand, *, type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"mov.{t}", d, a, imm_type=t)

    def selp(self, d: Reg, a: Operand, b: Operand, p: Reg, *, type: str | None = None) -> None:
        """d = p ? a : b"""
        t = type_of(d, type)
        self.emit(f"selp.{t}", d, a, b, p, imm_type=t)

    # ---------------------------------------------------------------- integer and float arithmetic
    def add(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None,
            rnd: str | None = None, sat: bool = False) -> None:
        t = type_of(d, type)
        self.emit("add" + _suffix(rnd, "sat" if sat else None, t), d, a, b, imm_type=t)

    def sub(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None,
            rnd: str | None = None) -> None:
        t = type_of(d, type)
        self.emit("sub" + _suffix(rnd, t), d, a, b, imm_type=t)

    def mul(self, d: Reg, a: Operand, b: Operand, *, mode: str | None = None,
            type: str | None = None, rnd: str | None = None) -> None:
        """Integers need ``mode`` 'lo', 'hi' or 'wide' (wide: type is the sources' type)."""
        if mode == "wide" and type is None:
            type = a.type if isinstance(a, Reg) else None
        t = type_of(d, type)
        self.emit("mul" + _suffix(mode, rnd, t), d, a, b, imm_type=t)

    def mad(self, d: Reg, a: Operand, b: Operand, c: Operand, *, mode: str = "lo",
            type: str | None = None) -> None:
        """Integer d = a * b + c (``mode`` 'lo', 'hi' or 'wide')."""
        if mode == "wide" and type is None:
            type = a.type if isinstance(a, Reg) else None
        t = type_of(d, type)
        self.emit(f"mad.{mode}.{t}", d, a, b, c, imm_type=t)

    def fma(self, d: Reg, a: Operand, b: Operand, c: Operand, *, rnd: str = "rn",
            type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"fma.{rnd}.{t}", d, a, b, c, imm_type=t)

    def div(self, d: Reg, a: Operand, b: Operand, *, rnd: str | None = None,
            type: str | None = None) -> None:
        """Floats need ``rnd`` ('rn' is IEEE division, 'approx'/'full' are faster)."""
        t = type_of(d, type)
        self.emit("div" + _suffix(rnd, t), d, a, b, imm_type=t)

    def rem(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"rem.{t}", d, a, b, imm_type=t)

    def min(self, d: Reg, a: Operand, b: Operand, *, nan: bool = False,
            type: str | None = None) -> None:
        """``nan=True`` emits min.NaN: a NaN operand gives NaN instead of the other operand."""
        t = type_of(d, type)
        self.emit("min" + _suffix("NaN" if nan else None, t), d, a, b, imm_type=t)

    def max(self, d: Reg, a: Operand, b: Operand, *, nan: bool = False, xorsign_abs: bool = False,
            type: str | None = None) -> None:
        """``nan=True`` emits max.NaN: a NaN operand gives NaN instead of the other operand.
        ``xorsign_abs`` (f16/bf16 types): max(|a|, |b|) with the xor of the signs."""
        t = type_of(d, type)
        self.emit("max" + _suffix("NaN" if nan else None, "xorsign.abs" if xorsign_abs else None, t),
                  d, a, b, imm_type=t)

    def abs(self, d: Reg, a: Operand, *, type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"abs.{t}", d, a, imm_type=t)

    def neg(self, d: Reg, a: Operand, *, type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"neg.{t}", d, a, imm_type=t)

    def rcp(self, d: Reg, a: Operand, *, rnd: str = "rn", ftz: bool = False,
            type: str | None = None) -> None:
        """``rnd`` 'rn' (IEEE) or 'approx' (1 ulp; with ``ftz``, one SFU instruction in f32)."""
        t = type_of(d, type)
        self.emit("rcp" + _suffix(rnd, "ftz" if ftz else None, t), d, a, imm_type=t)

    def sqrt(self, d: Reg, a: Operand, *, rnd: str = "rn", type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"sqrt.{rnd}.{t}", d, a, imm_type=t)

    def rsqrt(self, d: Reg, a: Operand, *, type: str | None = None) -> None:
        """rsqrt.approx: about 2 ulp in f32."""
        t = type_of(d, type)
        self.emit(f"rsqrt.approx.{t}", d, a, imm_type=t)

    def ex2(self, d: Reg, a: Operand, *, ftz: bool = False, type: str | None = None) -> None:
        """2^a, approximate. ``ftz``: subnormal inputs and results flush to zero (one SFU
        instruction in f32; without it ptxas adds the subnormal handling)."""
        t = type_of(d, type)
        self.emit("ex2.approx" + _suffix("ftz" if ftz else None, t), d, a, imm_type=t)

    # ---------------------------------------------------------------- bits
    def and_(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = bits_type(type_of(d, type))
        self.emit(f"and.{t}", d, a, b, imm_type=t)

    def or_(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = bits_type(type_of(d, type))
        self.emit(f"or.{t}", d, a, b, imm_type=t)

    def xor(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = bits_type(type_of(d, type))
        self.emit(f"xor.{t}", d, a, b, imm_type=t)

    def not_(self, d: Reg, a: Operand, *, type: str | None = None) -> None:
        t = bits_type(type_of(d, type))
        self.emit(f"not.{t}", d, a, imm_type=t)

    def shl(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = bits_type(type_of(d, type))
        self.emit(f"shl.{t}", d, a, b)

    def shr(self, d: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"shr.{t}", d, a, b)

    def prmt(self, d: Reg, a: Operand, b: Operand, selector: Operand) -> None:
        """Byte permute: d's bytes picked from the 8 bytes of {b, a} by ``selector``'s nibbles."""
        self.emit("prmt.b32", d, a, b, selector)

    def bfe(self, d: Reg, a: Operand, start: Operand, length: Operand, *,
            type: str | None = None) -> None:
        t = type_of(d, type)
        self.emit(f"bfe.{t}", d, a, start, length)

    def popc(self, d: Reg, a: Operand, *, type: str = "b32") -> None:
        self.emit(f"popc.{type}", d, a)

    def bfind(self, d: Reg, a: Operand, *, type: str = "u32") -> None:
        """d = the position of a's most significant set bit (0xffffffff when a is 0)."""
        self.emit(f"bfind.{type}", d, a)

    # ---------------------------------------------------------------- comparison
    def setp(self, cmp: str, p: Reg, a: Operand, b: Operand, *, type: str | None = None) -> None:
        """p = a <cmp> b, with ``cmp`` a PTX comparison ('lt', 'ge', 'eq', 'ne', 'lo', 'hs', ...).
        The type comes from ``a`` unless given."""
        t = type_of(a, type)
        self.emit(f"setp.{cmp}.{t}", p, a, b, imm_type=t)

    def and_pred(self, p: Reg, a: Operand, b: Operand) -> None:
        self.emit("and.pred", p, a, b)

    # ---------------------------------------------------------------- conversion
    def cvt(self, d: Reg, a: Operand, b: Operand | None = None, *, dtype: str | None = None,
            stype: str | None = None, rnd: str | None = None, sat: str | None = None,
            ftz: bool = False) -> None:
        """``cvt{.rnd}{.ftz}{.sat}.dtype.stype``. Packed conversions take two sources, the
        first landing in the upper half: ``cvt.rn.satfinite.e4m3x2.f32 d, hi, lo``."""
        dt = type_of(d, dtype)
        st = type_of(a, stype)
        opcode = "cvt" + _suffix(rnd, "ftz" if ftz else None, sat, dt, st)
        if b is None:
            self.emit(opcode, d, a, imm_type=st)
        else:
            self.emit(opcode, d, a, b, imm_type=st)

    def cvta(self, d: Reg, a: Operand, *, space: str, to: bool = False) -> None:
        """Generic <-> state-space address conversion (``to=True``: generic -> ``space``)."""
        self.emit("cvta" + (".to" if to else "") + f".{space}.u64", d, a)
