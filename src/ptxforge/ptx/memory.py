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
           sem: str | None = None, scope: str | None = None, cache: str | None = None,
           eviction: str | None = None, prefetch: str | None = None,
           type: str | None = None) -> None:
        """``ld{.sem.scope}.space{.nc}{.cop}{.eviction}{.prefetch}{.vN}.type d, [a]``.
        ``nc`` reads through the non-coherent (read-only) path: only for data no thread
        writes while the kernel runs. ``sem`` ('relaxed', 'acquire') with ``scope`` ('cta',
        'gpu', 'sys'): a strong load, e.g. ``ld.acquire.sys`` polling a flag another GPU
        sets."""
        dst, width, t = _vector_and_type(d, type)
        opcode = "ld" + _hints(sem, scope, space) + (".nc" if nc else "")
        self.emit(f"{opcode}{_hints(cache, eviction, prefetch)}{width}.{t}", dst, address)

    def st(self, address: Address, src: Reg | list, *, space: str = "global",
           sem: str | None = None, scope: str | None = None, cache: str | None = None,
           eviction: str | None = None, type: str | None = None) -> None:
        """``st{.sem.scope}.space{.cop}{.eviction}{.vN}.type [a], b``; ``sem`` ('relaxed',
        'release') with ``scope``: a strong store, e.g. ``st.release.sys`` publishing a
        counter after the data it counts."""
        data, width, t = _vector_and_type(src, type)
        self.emit("st" + _hints(sem, scope, space, cache, eviction) + f"{width}.{t}", address, data)

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
