"""Loads, stores, atomics and reductions across the state spaces.

A vector access passes a list of registers as the destination or source; the ``.vN``
width follows from its length. Cache hints are spelled as in the PTX ISA, e.g.
``eviction="L1::no_allocate"``, ``prefetch="L2::256B"``.
"""

from __future__ import annotations

from .arith import type_of
from .operands import Address, Operand, Reg, vec


def _vector_and_type(regs, type: str | None):
    if isinstance(regs, (list, tuple)):
        if len(regs) not in (2, 4, 8):
            raise ValueError(f"vector accesses take 2, 4 or 8 registers, got {len(regs)}")
        return vec(regs), f".v{len(regs)}", type_of(regs[0], type)
    return regs, "", type_of(regs, type)


def _hints(*parts: str | None) -> str:
    return "".join(f".{p}" for p in parts if p)


class MemoryOps:
    def ld(self, d: Reg | list, address: Address, *, space: str = "global", nc: bool = False,
           cache: str | None = None, eviction: str | None = None, prefetch: str | None = None,
           type: str | None = None) -> None:
        """``ld.space{.nc}{.cop}{.eviction}{.prefetch}{.vN}.type d, [a]``.
        ``nc`` reads through the non-coherent (read-only) path: only for data no thread writes."""
        dst, width, t = _vector_and_type(d, type)
        opcode = f"ld.{space}" + (".nc" if nc else "") + _hints(cache, eviction, prefetch)
        self.emit(f"{opcode}{width}.{t}", dst, address)

    def st(self, address: Address, src: Reg | list, *, space: str = "global",
           cache: str | None = None, eviction: str | None = None, type: str | None = None) -> None:
        data, width, t = _vector_and_type(src, type)
        self.emit(f"st.{space}" + _hints(cache, eviction) + f"{width}.{t}", address, data)

    def ld_param(self, d: Reg, param) -> None:
        self.emit(f"ld.param.{type_of(d)}", d, Address(param))

    def atom(self, d: Reg, address: Address, b: Operand, *, op: str, space: str = "global",
             sem: str | None = None, scope: str | None = None, type: str | None = None) -> None:
        """``atom{.sem}{.scope}.space.op.type d, [a], b`` (op: add, max, min, exch, ...)."""
        t = type_of(d, type)
        self.emit("atom" + _hints(sem, scope, space, op, t), d, address, b, imm_type=t)

    def red(self, address: Address, b: Operand, *, op: str, space: str = "global",
            sem: str | None = None, scope: str | None = None, type: str | None = None) -> None:
        """Reduction without a result: ``red{.sem}{.scope}.space.op.type [a], b``."""
        t = type_of(b, type)
        self.emit("red" + _hints(sem, scope, space, op, t), address, b, imm_type=t)

    def prefetch(self, address: Address, *, level: str = "L2", space: str = "global") -> None:
        self.emit(f"prefetch.{space}.{level}", address)

    def prefetch_tensormap(self, tensormap: Address) -> None:
        """Pull a TMA descriptor into the descriptor cache before its first use."""
        self.emit("prefetch.tensormap", tensormap)
