"""Warp-level data exchange: shuffles, warp reductions, votes, matches."""

from __future__ import annotations

from .arith import bits_type
from .operands import Operand, Reg

FULL_MASK = 0xFFFFFFFF


class WarpOps:
    def shfl_sync(self, d: Reg, a: Operand, lane_or_delta: Operand, *, mode: str,
                  clamp: Operand | None = None, membermask: Operand = FULL_MASK) -> None:
        """``shfl.sync.mode.b32 d, a, b, c, mask`` with mode up/down/bfly/idx. ``c`` packs the
        clamp value and segment mask; the default spans the whole warp (0x1f, or 0 for up)."""
        if clamp is None:
            clamp = 0 if mode == "up" else 0x1F
        self.emit(f"shfl.sync.{mode}.b32", d, a, lane_or_delta, clamp, membermask)

    def redux_sync(self, d: Reg, a: Operand, *, op: str, membermask: Operand = FULL_MASK,
                   type: str | None = None) -> None:
        """Warp-wide integer reduction (``op``: add, min, max, and, or, xor)."""
        t = type or (d.type if op in ("add", "min", "max") else "b32")
        self.emit(f"redux.sync.{op}.{t}", d, a, membermask)

    def vote_sync(self, d: Reg, p: Operand, *, mode: str, membermask: Operand = FULL_MASK) -> None:
        """``vote.sync.mode``: 'all'/'any'/'uni' into a predicate, 'ballot' into a b32."""
        t = "b32" if mode == "ballot" else "pred"
        self.emit(f"vote.sync.{mode}.{t}", d, p, membermask)

    def match_any_sync(self, d: Reg, a: Reg, *, membermask: Operand = FULL_MASK) -> None:
        """``match.any.sync.b32`` (``.b64`` for a 64-bit ``a``): ``d`` = the mask of the lanes
        of ``membermask`` whose ``a`` equals this lane's. Every lane of the mask executes it."""
        self.emit(f"match.any.sync.{bits_type(a.type)}", d, a, membermask)
