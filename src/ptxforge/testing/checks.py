"""Correctness checks of the shipped kernels against ``ptxforge.testing.reference``, on a GPU.

Each check draws fresh random inputs, poisons the memory the op will be handed for its
outputs (NaN bytes, so an element the kernel never writes cannot pass), runs the op and
the reference, and returns a ``CheckResult``. The GPU tests assert on these; ``ptxforge
demo`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from . import reference


@dataclass
class CheckResult:
    name: str
    shape: tuple
    metric: str
    value: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.value <= self.limit  # NaN compares False: a NaN metric fails

    def row(self) -> list:
        return [self.name, "x".join(map(str, self.shape)), self.metric, f"{self.value:.3g}",
                f"{self.limit:.3g}", "ok" if self.passed else "FAIL"]


def poison_allocator(device, nbytes: int) -> None:
    """Fill a block of the caching allocator with 0xFF (NaN in e4m3, f32 and bf16) and
    free it, so the next allocations of that size start as NaN instead of stale data."""
    junk = torch.empty(nbytes, dtype=torch.uint8, device=device)
    junk.fill_(0xFF)
    del junk


def fp8_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose e4m3 bits differ, counting any two NaNs as equal."""
    ua, ub = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (ua & 0x7F) == 0x7F, (ub & 0x7F) == 0x7F
    return int(((ua != ub) & ~(nan_a & nan_b)).sum())


def f32_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance in units in the last place between two f32 tensors (NaN == NaN)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    ia, ib = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    # Map the sign-magnitude bit patterns onto a monotonic integer line.
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    diff = (ia - ib).abs().masked_fill(both_nan, 0)
    if (torch.isnan(a) ^ torch.isnan(b)).any():
        return float("inf")
    return float(diff.max()) if diff.numel() else 0.0


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y64, r64 = y.double(), ref.double()
    return float((y64 - r64).norm() / r64.norm().clamp_min(1e-300))


def _randn(shape, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(torch.bfloat16)


def check_quantize_per_token(m: int, k: int, layout: str = "mn_major", device="cuda",
                             with_nan: bool = False) -> list[CheckResult]:
    x = _randn((m, k), device, scale=3.0)
    if with_nan:
        x[m // 2, k // 3] = float("nan")
    poison_allocator(device, 4 * m * k + (1 << 20))
    q, s = ops.quantize_fp8_per_token(x, scale_layout=layout)
    rq, rs = reference.quantize_fp8_per_token(x)
    name = f"quantize_fp8_per_token[{layout}{',nan' if with_nan else ''}]"
    return [CheckResult(name, (m, k), "fp8 bit mismatches", fp8_mismatches(q, rq), 0),
            CheckResult(name, (m, k), "scale ulps", f32_ulps(s, rs), 1)]


def check_quantize_per_block(n: int, k: int, device="cuda") -> list[CheckResult]:
    w = _randn((n, k), device, scale=0.05)
    poison_allocator(device, 4 * n * k + (1 << 20))
    q, s = ops.quantize_fp8_per_block(w)
    rq, rs = reference.quantize_fp8_per_block(w)
    name = "quantize_fp8_per_block"
    return [CheckResult(name, (n, k), "fp8 bit mismatches", fp8_mismatches(q, rq), 0),
            CheckResult(name, (n, k), "scale ulps", f32_ulps(s, rs), 1)]


def check_rms_norm(m: int, k: int, device="cuda") -> list[CheckResult]:
    x = _randn((m, k), device, scale=2.0)
    w = _randn((k,), device)
    poison_allocator(device, 4 * m * k + (1 << 20))
    y = ops.rms_norm(x, w, 1e-6)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    return [CheckResult("rms_norm", (m, k), "rel. error vs fp64", relative_error(y, ref), 1e-2),
            CheckResult("rms_norm", (m, k), "non-finite outputs", float((~torch.isfinite(y)).sum()), 0)]


def check_rms_norm_quantize(m: int, k: int, device="cuda") -> list[CheckResult]:
    x = _randn((m, k), device, scale=2.0)
    w = _randn((k,), device)
    poison_allocator(device, 4 * m * k + (1 << 20))
    q, s = ops.rms_norm_quantize_fp8(x, w, 1e-6)
    # The fused kernel must give exactly the two-step result of our own kernels...
    uq, us = ops.quantize_fp8_per_token(ops.rms_norm(x, w, 1e-6))
    # ...and stay close to the fp64 truth once dequantized.
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    name = "rms_norm_quantize_fp8"
    return [CheckResult(name, (m, k), "fp8 bits vs two-step", fp8_mismatches(q, uq), 0),
            CheckResult(name, (m, k), "scale ulps vs two-step", f32_ulps(s, us), 0),
            CheckResult(name, (m, k), "dequant rel. error vs fp64",
                        relative_error(reference.dequantize_per_token(q, s), ref), 5e-2)]


def silu_other_rounding(gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(where, other)``: where the kernel's bf16 silu(gate) may round one step away from
    eager's, and that other bf16 value (eager's, one step towards the exact silu).

    Where: the exact silu (f64) lies within the two f32 computations' error of a bf16
    rounding midpoint; elsewhere both round as the exact value does. In f32 ulps of the
    result (an error of n ulp in an operand is up to 2n in the result, one binade down):
    the kernel's exp, CUDA's __expf, 2 + 1.173|g| ulp, so 4 + 2.35|g|; its add, reciprocal
    and multiply 1 + 2 + 0.5; the f64 value's rounding to f32 0.5: 8 + 2.35|g|, taken as
    10 + 2.5|g|. torch's expf and divide err less."""
    g = gate.double()
    exact = (g / (1 + torch.exp(-g))).float()
    to_midpoint = ((exact.view(torch.int32) & 0xFFFF) - 0x8000).abs()
    where = to_midpoint <= 10 + 2.5 * gate.float().abs()
    eager = torch.nn.functional.silu(gate)
    # The int16 view of a bf16 steps its magnitude by one either sign.
    step = torch.where(exact.abs() > eager.float().abs(), 1, -1).to(torch.int16)
    return where, (eager.view(torch.int16) + step).view(torch.bfloat16)


def amax_fixed_groups(h: torch.Tensor, h_other: torch.Tensor, where: torch.Tensor,
                      group: int = 128) -> torch.Tensor:
    """[M, ceil(K/group)]: the groups of h [M, K] whose amax stays whichever of h and
    h_other each element in ``where`` takes: every such element stays below the largest
    element outside ``where``."""
    def per_group(t):
        return torch.nn.functional.pad(t, (0, -t.shape[1] % group)).view(t.shape[0], -1, group)

    magnitude, other_magnitude = h.float().abs(), h_other.float().abs()
    fixed_max = per_group(torch.where(where, 0, magnitude)).amax(-1)
    either_max = per_group(torch.where(where, torch.maximum(magnitude, other_magnitude),
                                       0)).amax(-1)
    return either_max < fixed_max


def check_silu_mul_quantize(m: int, k: int, layout: str = "mn_major", device="cuda",
                            halves: bool = False) -> list[CheckResult]:
    """silu_mul_quantize_fp8 against eager's ``F.silu(gate) * up`` quantized by the
    reference (m >= 1). ``halves``: gate and up are the two halves of one [M, 2K] tensor.

    Where the kernel's silu may round the other way (``silu_other_rounding``) its h is
    eager's or the other rounding's; a group whose amax neither can change (every such
    element stays below the largest that cannot) must then match exactly: its scale, and
    each e4m3 byte that of eager's h or, where the rounding may differ, of the other h.
    Every element, in every group: dequantized within 2^-4 (e4m3's rounding) of the
    kernel's h, which is within 2^-6 of eager's (one bf16 step of silu, up to 2^-7, and
    the product's rounding), plus 2^-10 scales (half e4m3's subnormal step)."""
    if halves:
        gate, up = _randn((m, 2 * k), device, scale=3.0).chunk(2, dim=-1)
    else:
        gate, up = _randn((m, k), device, scale=3.0), _randn((m, k), device, scale=3.0)
    poison_allocator(device, 4 * m * k + (1 << 20))
    q, s = ops.silu_mul_quantize_fp8(gate, up, scale_layout=layout)
    h = reference.silu_mul(gate, up)
    where, other_silu = silu_other_rounding(gate)
    h_other = torch.where(where, other_silu * up, h)
    rq, rs = reference.quantize_fp8_per_token(h)
    oq, _ = reference.quantize_fp8_per_token(h_other)
    stable = amax_fixed_groups(h, h_other, where)
    stable_elements = stable.repeat_interleave(128, dim=1)[:, :k]
    bits, eager_bits, other_bits = (t.view(torch.uint8) for t in (q, rq, oq))
    explained = (bits == eager_bits) | (where & (bits == other_bits))
    per_element_scale = s.float().repeat_interleave(128, dim=1)[:, :k]
    bound = ((2 ** -4 * (1 + 2 ** -6) + 2 ** -6) * h.float().abs()
             + 2 ** -10 * per_element_scale)
    dequantized = reference.dequantize_per_token(q, s)
    name = f"silu_mul_quantize_fp8[{layout}{',halves' if halves else ''}]"
    shape = (m, k)
    return [
        CheckResult(name, shape, "fp8 bits unexplained (amax-fixed groups)",
                    int((stable_elements & ~explained).sum()), 0),
        CheckResult(name, shape, "scale ulps vs eager (amax-fixed groups)",
                    f32_ulps(s[stable], rs[stable]), 1),
        CheckResult(name, shape, "scale rel. diff. vs eager (all groups)",
                    float(((s - rs).abs() / rs).max()), 2 ** -6),
        CheckResult(name, shape, "dequant error over its bound",
                    float(((dequantized - h.float()).abs() / bound).max()), 1),
    ]


def fp8_gemm_operands(m: int, n: int, k: int, device="cuda"):
    """Fresh random GEMM operands, quantized as DeepGEMM's recipe does, and the fp64
    product of their dequantized values: ``(qa, sa), (qb, sb), reference``."""
    qa, sa = ops.quantize_fp8_per_token(_randn((m, k), device))
    qb, sb = ops.quantize_fp8_per_block(_randn((n, k), device))
    ref = (reference.dequantize_per_token(qa, sa).double()
           @ reference.dequantize_per_block(qb, sb).double().t())
    return (qa, sa), (qb, sb), ref


def bf16_gemm_operands(m: int, n: int, k: int, device="cuda"):
    """Fresh random bf16 GEMM operands a [M, K], b [N, K] and their fp64 product:
    ``a, b, reference``."""
    a, b = _randn((m, k), device), _randn((n, k), device)
    return a, b, a.double() @ b.double().t()


def check_fp8_gemm(m: int, n: int, k: int, device="cuda") -> list[CheckResult]:
    (qa, sa), (qb, sb), ref = fp8_gemm_operands(m, n, k, device)
    d = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
    ops.fp8_gemm_nt((qa, sa), (qb, sb), d)
    name = "fp8_gemm_nt"
    return [CheckResult(name, (m, n, k), "calc_diff vs fp64", calc_diff(d, ref), 1e-3),
            CheckResult(name, (m, n, k), "rel. error vs fp64", relative_error(d, ref), 2e-3),
            CheckResult(name, (m, n, k), "unwritten outputs", float(torch.isnan(d).sum()), 0)]


def run_all(device="cuda", big: bool = True) -> list[CheckResult]:
    results = []
    shapes = [(1, 128), (7, 576), (33, 200), (129, 2112), (512, 7168), (3, 8), (65, 16384)]
    if big:
        shapes.append((16384, 7168))
    for m, k in shapes:
        results += check_quantize_per_token(m, k, "mn_major", device)
        results += check_quantize_per_token(m, k, "row_major", device)
        results += check_rms_norm(m, k, device)
        results += check_rms_norm_quantize(m, k, device)
    results += check_quantize_per_token(64, 7168, "mn_major", device, with_nan=True)
    for m, k in [(1, 128), (7, 1000), (129, 2048), (512, 18432)]:
        results += check_silu_mul_quantize(m, k, "mn_major", device)
        results += check_silu_mul_quantize(m, k, "row_major", device, halves=True)
    for n, k in [(1, 8), (129, 136), (300, 200), (7168, 2048), (4096, 7168)]:
        results += check_quantize_per_block(n, k, device)
    for m, n, k in [(1, 128, 256), (64, 2112, 7168), (129, 1544, 1040), (4096, 7168, 2048)]:
        results += check_fp8_gemm(m, n, k, device)
    return results
