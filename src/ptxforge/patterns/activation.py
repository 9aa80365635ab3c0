"""Activations on packed bf16 data, rounded as eager PyTorch rounds them.

Each function says what it emits.
"""

from __future__ import annotations

import math

from ..ptx import KernelBuilder, Reg
from .fp8 import unpack_bf16x2

LOG2_E = math.log2(math.e)


def silu_mul_bf16x2(k: KernelBuilder, h: list[Reg], gate: list[Reg], up: list[Reg],
                    scratch: list[Reg]) -> None:
    """14 instructions per b32 word: SwiGLU's ``h = silu(g) * u`` on words of two bf16
    each, in eager PyTorch's dataflow: ``s = g / (1 + exp(-g))`` in f32 rounded to bf16
    (torch's silu on a bf16 tensor), then ``h = s * u`` rounded to bf16 (torch's bf16
    multiply). ``scratch``: three f32 registers.

    Two approximations, one SFU instruction each, where torch divides in IEEE f32: an
    FFN's SwiGLU must stay bound by memory, not by issue (the kernel at I = 14336 is 976
    SASS instructions, 1728 with ``div.rn.f32``, 1128 with ``div.full.f32``; ptxas 13.0).
    ``exp(-g)`` is ``ex2.approx.ftz(-g * log2(e))``, CUDA's ``__expf``: within
    2 + 1.173|g| ulp (CUDA Programming Guide, intrinsic functions) where torch's ``expf``
    is within 2; the division is ``rcp.approx.ftz`` (1 ulp) then a multiply. So s is
    torch's bf16 except where the f32 quotient lies within a few ulp of a bf16 rounding
    midpoint, and then one bf16 step away. ``ftz`` flushes results below 2^-126 to zero:
    exp(-g) for g > 87.3, where 1 + exp(-g) is 1 either way, and the reciprocal for
    g < -87.3, where s becomes 0 instead of torch's below 2^-119 in magnitude; the
    quantized h is 0 either way (beside the group's amax, at least 1e-4) unless |up|
    exceeds 2^87.

    The product is a ``mul.rn.bf16x2``: the product of two bf16 is exact in f32, so
    rounding it once to bf16 is torch's f32 multiply and rounding."""
    lo, hi, e = scratch
    for dst, g, u in zip(h, gate, up):
        unpack_bf16x2(k, lo, hi, g)
        for s in (lo, hi):
            k.mul(e, s, -LOG2_E)
            k.ex2(e, e, ftz=True)
            k.add(e, e, 1.0)
            k.rcp(e, e, rnd="approx", ftz=True)
            k.mul(s, s, e)
        k.cvt(dst, hi, lo, dtype="bf16x2", rnd="rn")  # the first source is the upper half
        k.mul(dst, dst, u, type="bf16x2", rnd="rn")
