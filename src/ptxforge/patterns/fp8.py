"""Multi-instruction building blocks for bf16 <-> f32 and f32 -> fp8 (e4m3) data.

Each function says what it emits. They are the single implementation of these steps
for every kernel that quantizes (per-token, per-block, fused with RMSNorm).

The quantization recipe is DeepGEMM's (``per_token_cast_to_fp8``):
``amax = max(max|x|, 1e-4)``, ``q = e4m3(x * (448 / amax))``, ``scale = amax / 448``,
rounded step by step as torch rounds it, so the result is bit-for-bit torch's.
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


def packed_amax(k: KernelBuilder, amax: Reg, words: list[Reg], scratch: Reg, halves: list[Reg]) -> None:
    """len(words) + 3 instructions: ``amax`` (f32) = max |x| over the bf16 pairs in ``words``,
    NaN-propagating like torch's amax. The max is taken on packed bf16x2 (exact: the max of
    bf16 values is one of them); ``scratch`` is a b32 and ``halves`` two f32 registers."""
    k.max(scratch, words[0], words[1], nan=True, xorsign_abs=True, type="bf16x2")
    for word in words[2:]:
        k.max(scratch, scratch, word, nan=True, xorsign_abs=True, type="bf16x2")
    k.and_(scratch, scratch, 0x7FFF7FFF, type="b32")  # |.|: drop the xor-ed signs
    unpack_bf16x2(k, halves[0], halves[1], scratch)
    k.max(amax, halves[0], halves[1], nan=True)


def scale_from_amax(k: KernelBuilder, amax: Reg, inv_scale: Reg, scale: Reg) -> None:
    """Four instructions: clamp amax, ``inv_scale = 448 / amax``, ``scale = amax / 448``.

    Rounded exactly as torch evaluates the recipe: ``448.0 / t`` is ``t.reciprocal() * 448``
    and ``t / 448.0`` is ``t * (1 / 448)`` (a CPU-scalar divisor becomes its reciprocal), so
    the bits match the reference."""
    k.max(amax, amax, AMAX_FLOOR, nan=True)
    k.rcp(inv_scale, amax, rnd="rn")
    k.mul(inv_scale, inv_scale, E4M3_MAX, rnd="rn")
    k.mul(scale, amax, 1.0 / E4M3_MAX, rnd="rn")


def add_batched_row_offset(k: KernelBuilder, offset: Reg, row, rows_per_batch: Reg,
                           batch_stride: Reg, row_stride: Reg) -> None:
    """Four instructions: ``offset += (row / rows_per_batch) * batch_stride + (row %
    rows_per_batch) * row_stride`` (u32), where a grouped layout's row ``row`` has its
    scales in MN-major layouts of ``rows_per_batch`` rows each (the masked layout's
    [E, M_max, G]: M_max rows a batch; the contiguous layout's: one batch)."""
    batch, in_batch = k.reg("u32", "scale_batch"), k.reg("u32", "row_in_batch")
    k.div(batch, row, rows_per_batch, type="u32")
    k.mad(offset, batch, batch_stride, offset, mode="lo")
    k.rem(in_batch, row, rows_per_batch, type="u32")
    k.mad(offset, in_batch, row_stride, offset, mode="lo")
