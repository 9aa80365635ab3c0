"""Multi-instruction building blocks for bf16 <-> f32 and f32 -> fp8 (e4m3) data.

Each function says what it emits. They are the single implementation of these steps
for every kernel that quantizes (per-token, per-block, fused with RMSNorm).

The quantization recipe is DeepGEMM's (``per_token_cast_to_fp8``):
``amax = max(max|x|, 1e-4)``, ``q = e4m3(x * (448 / amax))``, ``scale = amax / 448``,
both divisions IEEE round-to-nearest so the result is bit-for-bit torch's.
"""

from __future__ import annotations

from ..ptx import KernelBuilder, Reg, vec

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def unpack_bf16x2(k: KernelBuilder, lo: Reg, hi: Reg, packed: Reg) -> None:
    """Two instructions: the two bf16 halves of ``packed`` as exact f32 values.
    (A bf16 is the upper half of the f32 with the same value.)"""
    k.shl(lo, packed, 16, type="b32")
    k.and_(hi, packed, 0xFFFF0000, type="b32")


def pack_e4m3x4(k: KernelBuilder, dst: Reg, values: list[Reg], scratch: list[Reg]) -> None:
    """Three instructions: four f32 -> four saturated e4m3 bytes of ``dst``, values[0] lowest.
    ``scratch`` holds two b16 registers."""
    lo, hi = scratch
    # cvt puts its first source in the upper byte.
    k.cvt(lo, values[1], values[0], dtype="e4m3x2", rnd="rn", sat="satfinite")
    k.cvt(hi, values[3], values[2], dtype="e4m3x2", rnd="rn", sat="satfinite")
    k.mov(dst, vec(lo, hi), type="b32")


def max_abs(k: KernelBuilder, acc: Reg, values: list[Reg], scratch: Reg) -> None:
    """2 instructions per value: acc = max(acc, |v|), NaN-propagating like torch's amax."""
    for v in values:
        k.abs(scratch, v)
        k.max(acc, acc, scratch, nan=True)


def butterfly_max(k: KernelBuilder, value: Reg, lanes: int, scratch: Reg) -> None:
    """2 instructions per step: max over aligned groups of ``lanes`` lanes (a power of two
    <= 32); every lane of the group ends with the result."""
    offset = lanes // 2
    while offset:
        k.shfl_sync(scratch, value, offset, mode="bfly")
        k.max(value, value, scratch, nan=True)
        offset //= 2


def butterfly_sum(k: KernelBuilder, value: Reg, lanes: int, scratch: Reg) -> None:
    """2 instructions per step: sum over aligned groups of ``lanes`` lanes."""
    offset = lanes // 2
    while offset:
        k.shfl_sync(scratch, value, offset, mode="bfly")
        k.add(value, value, scratch)
        offset //= 2


def scale_from_amax(k: KernelBuilder, amax: Reg, inv_scale: Reg, scale: Reg) -> None:
    """Three instructions: clamp amax, then ``inv_scale = 448 / amax`` and ``scale = amax / 448``."""
    k.max(amax, amax, AMAX_FLOOR, nan=True)
    k.div(inv_scale, E4M3_MAX, amax, rnd="rn")
    k.div(scale, amax, E4M3_MAX, rnd="rn")
