"""Warp reductions by butterfly shuffles, and a warp prefix sum."""

from __future__ import annotations

from ..ptx import KernelBuilder, Reg


def butterfly_max(k: KernelBuilder, values: list[Reg], lanes: int, scratch: list[Reg]) -> None:
    """2 instructions per value and step: each value's max over aligned groups of ``lanes``
    lanes (a power of two <= 32); every lane of a group ends with its result. The values'
    shuffles are interleaved step by step so their latencies overlap."""
    _butterfly(k, values, lanes, scratch, lambda v, other: k.max(v, v, other, nan=True))


def butterfly_sum(k: KernelBuilder, values: list[Reg], lanes: int, scratch: list[Reg]) -> None:
    """2 instructions per value and step: sums over aligned groups of ``lanes`` lanes."""
    _butterfly(k, values, lanes, scratch, lambda v, other: k.add(v, v, other))


def _butterfly(k, values, lanes, scratch, combine) -> None:
    offset = lanes // 2
    while offset:
        for v, s in zip(values, scratch):
            k.shfl_sync(s, v, offset, mode="bfly")
        for v, s in zip(values, scratch):
            combine(v, s)
        offset //= 2


def inclusive_sum(k: KernelBuilder, value: Reg, lane: Reg, scratch: Reg, has_giver: Reg) -> None:
    """15 instructions: ``value`` becomes the sum of its values in lanes 0 .. this lane (a
    Hillis-Steele scan over the warp: per step, shfl.up by 1, 2, 4, 8, 16, and a lane adds
    what it got where a lane that far below it exists). ``scratch``: a register of value's
    type; ``has_giver``: a predicate."""
    offset = 1
    while offset < 32:
        k.shfl_sync(scratch, value, offset, mode="up")
        k.setp("ge", has_giver, lane, offset)
        with k.guard(has_giver):
            k.add(value, value, scratch)
        offset *= 2
