"""The ops' benchmarks, run side by side with their torch peers in the same process:
``ptxforge bench memory``, ``fp8-gemm``, ``grouped-gemm``, ``bf16-gemm``, ``decode`` and
``chain``, each a suite, its table and, but for the chain, its plot; with the timer, copies,
shape tables and operand builders they share, which bench/ scripts use too.

Method (the project's measurement rules, and the anchors'): count the bytes each op must
move; take the kernel time from the profiler after warm-up, with the L2 cache flushed
before every call by writing a buffer larger than it; report the median; measure the
device-to-device copy ceiling in the same run and state every bandwidth against it.
"""

from __future__ import annotations

import collections
import itertools
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from .. import kernels, ops
from ..testing import reference
from ..testing.checks import bf16_gemm_operands, calc_diff, fp8_gemm_operands
from . import format_table, pyplot


@dataclass
class Timer:
    """Median kernel time of a callable (of each of several: ``each``): the sum of the GPU
    kernels (and memsets) it launches, from the profiler (CUPTI), with the L2 cache flushed
    before each call. This is the anchors' method; CUDA events around a call add 2-4 us of
    launch latency, which dwarfs the small GEMMs (measured on the H200: 12.2 us by events,
    8.5 us by the profiler).

    ``flush_by``: "write" fills a buffer larger than the L2 (the anchors' GEMM method); the
    L2 then holds its dirty lines, and the timed call pays for writing them back (about
    50 MB, some 12 us at the HBM's rate: of a memory-bound kernel of a few hundred
    microseconds, 5-10%). "read" reads the buffer instead (its maximum): the L2 is as
    evicted, and holds only clean lines (and the 1 MB of the maxima)."""

    warmup: int = 5
    reps: int = 30
    flush_bytes: int = 256 << 20
    flush_by: str = "write"
    _flush: torch.Tensor | None = field(default=None, repr=False)

    # The flush's kernel separates one call from the next: a fill, or a max, of a uint8
    # buffer (no timed op launches either).
    FLUSH_KERNELS = {"write": "FillFunctor<unsigned char>",
                     "read": "MaxNanFunctor<unsigned char>"}

    def __post_init__(self):
        if self.flush_by not in self.FLUSH_KERNELS:
            raise ValueError(f"flush_by must be write or read, got {self.flush_by!r}")

    def flush(self) -> None:
        """Write (or read) a buffer larger than the L2 cache, evicting what it held."""
        if self._flush is None:
            self._flush = torch.empty(self.flush_bytes, dtype=torch.uint8, device="cuda")
        if self.flush_by == "write":
            self._flush.zero_()
        else:     # rows of 256: one kernel, no memset (a full reduction's would be one)
            self._flush.view(-1, 256).amax(1)

    def __call__(self, fn) -> float:
        return self.each([fn])[0]

    def each(self, fns) -> list[float]:
        """The median kernel time of each callable, timed one after another in a single
        profiler session (its start and stop are host work, paid once for the lot)."""
        calls = [sum(end - start for start, end in call) for call in self.intervals(fns)]
        return [statistics.median(calls[i:i + self.reps]) / 1e3  # us -> ms
                for i in range(0, len(calls), self.reps)]

    def intervals(self, fns) -> list[list[tuple[float, float]]]:
        """Each call's device work as (start, end) times in us, in the order it started:
        ``reps`` calls of each callable after the warm-up, one after another, in a single
        profiler session, with the L2 flushed before each."""
        self.flush()     # the buffer, allocated before the profiler starts
        for fn in fns:
            for _ in range(self.warmup):
                fn()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for fn in fns:
                for _ in range(self.reps):
                    self.flush()
                    fn()
            torch.cuda.synchronize()
        device_work = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                             key=lambda e: e.time_range.start)
        calls = []
        for event in device_work:
            if self.FLUSH_KERNELS[self.flush_by] in event.name:
                calls.append([])
            elif calls:
                calls[-1].append((event.time_range.start, event.time_range.end))
        expected = self.reps * len(fns)
        if len(calls) != expected or not all(calls):
            raise RuntimeError(f"the profiler saw {len(calls)} calls with device work, "
                               f"expected {expected}")
        return calls


def copy_of(nbytes: int):
    """A device-to-device copy that moves ``nbytes``, counting bytes read plus bytes written
    (a uint8 tensor of nbytes / 2 into another), as a callable to time."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def copy_bandwidth_gbs(timer: Timer, nbytes: int = 4 << 30) -> float:
    """The large-copy roofline: GB/s of a device-to-device copy moving ``nbytes``."""
    return nbytes / timer(copy_of(nbytes)) / 1e6


def memory_suite(m: int = 16384, k: int = 7168, timer: Timer | None = None) -> dict:
    """The five memory-bound kernels and their torch peers at [m, k] (SwiGLU's gate and up
    [m, k] each)."""
    timer = timer or Timer()
    copy_gbs = copy_bandwidth_gbs(timer)
    x = (torch.randn((m, k), device="cuda") * 2).to(torch.bfloat16)
    w = torch.randn((k,), device="cuda").to(torch.bfloat16)
    groups = -(-k // 128)
    token_bytes = 2 * m * k + m * k + 4 * m * groups
    block_bytes = 2 * m * k + m * k + 4 * (-(-m // 128)) * groups
    norm_bytes = 2 * m * k + 2 * k + 2 * m * k
    fused_bytes = 2 * m * k + 2 * k + m * k + 4 * m * groups
    swiglu_bytes = 2 * 2 * m * k + m * k + 4 * m * groups
    up = (torch.randn((m, k), device="cuda") * 2).to(torch.bfloat16)
    cases = [
        ("quantize_fp8_per_token", token_bytes, lambda: ops.quantize_fp8_per_token(x),
         lambda: reference.quantize_fp8_per_token(x)),
        ("quantize_fp8_per_block", block_bytes, lambda: ops.quantize_fp8_per_block(x),
         lambda: reference.quantize_fp8_per_block(x)),
        ("rms_norm", norm_bytes, lambda: ops.rms_norm(x, w),
         lambda: torch.nn.functional.rms_norm(x, (k,), w, 1e-6)),
        ("rms_norm_quantize_fp8", fused_bytes, lambda: ops.rms_norm_quantize_fp8(x, w),
         lambda: reference.quantize_fp8_per_token(torch.nn.functional.rms_norm(x, (k,), w, 1e-6))),
        ("silu_mul_quantize_fp8", swiglu_bytes, lambda: ops.silu_mul_quantize_fp8(x, up),
         lambda: reference.quantize_fp8_per_token(reference.silu_mul(x, up))),
    ]
    rows = []
    for name, nbytes, ours, peer in cases:
        ms, peer_ms = timer(ours), timer(peer)
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "m": m, "k": k, "bytes": nbytes, "ms": ms, "gbs": gbs,
                     "fraction_of_copy": gbs / copy_gbs, "torch_ms": peer_ms,
                     "speedup_vs_torch": peer_ms / ms})
    return {"suite": "memory", "gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
            "rows": rows}


def host_overhead(calls: int = 1000, repeats: int = 5) -> dict:
    """Wall time per call of back-to-back small ops (host cost plus GPU launch throughput)."""
    x = torch.randn((4, 1024), device="cuda").to(torch.bfloat16)
    w = torch.randn((1024,), device="cuda").to(torch.bfloat16)
    cases = {
        "ptxforge.rms_norm [4x1024]": lambda: ops.rms_norm(x, w),
        "ptxforge.quantize_fp8_per_token [4x1024]": lambda: ops.quantize_fp8_per_token(x),
        "torch F.rms_norm [4x1024]": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
        "torch x.add_(0) [4x1024]": lambda: x.add_(0),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best.append((time.perf_counter() - start) / calls * 1e6)
        out[name] = statistics.median(best)
    return out


def memory_table(result: dict) -> str:
    rows = [[r["kernel"], f"{r['m']}x{r['k']}", f"{r['ms'] * 1e3:.1f}", f"{r['gbs']:.0f}",
             f"{100 * r['fraction_of_copy']:.1f}%", f"{r['torch_ms'] * 1e3:.1f}",
             f"{r['speedup_vs_torch']:.2f}x"] for r in result["rows"]]
    title = (f"{result['gpu']}: device-to-device copy {result['copy_gbs']:.0f} GB/s "
             f"(read + write), kernel times from the profiler, median of 30, L2 flushed")
    return title + "\n" + format_table(
        ["kernel", "shape", "us", "GB/s", "of copy", "torch us", "speedup"], rows)


def memory_plot(result: dict, path: str) -> None:
    """GB/s of each memory-bound kernel beside its torch peer's, under the copy ceiling."""
    plt = pyplot()
    if plt is None:
        return
    names = [r["kernel"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(names, [r["gbs"] for r in result["rows"]], label="ptxforge")
    ax.barh(names, [r["bytes"] / r["torch_ms"] / 1e6 for r in result["rows"]], height=0.35,
            label="torch")
    ax.axvline(result["copy_gbs"], color="k", linestyle="--", label="copy ceiling")
    ax.set_xlabel("GB/s (bytes read + written)")
    ax.set_title(f"{result['gpu']}: memory-bound kernels")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# DeepGEMM's dense benchmark table (M, N, K).
GEMM_SHAPES = [(m, n, k) for m in (64, 128, 4096) for n, k in kernels.GEMM_SHAPES]


def _torch_blockwise(qa, sa, qb, sb):
    """torch's blockwise-scaled FP8 GEMM (cuBLAS): the 1x128 x 128x128 recipe. torch wants
    B's scales as [K/128, N/128] (its B is [K, N]); the strides it accepts are probed."""
    F = torch.nn.functional
    failures = []
    for scale_a, scale_b in ((sa, sb.t()), (sa.contiguous(), sb.t()), (sa, sb.t().contiguous()),
                             (sa.contiguous(), sb.t().contiguous())):
        def call(scale_a=scale_a, scale_b=scale_b):
            return F.scaled_mm(qa, qb.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b,
                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        try:
            call()
            return call
        except (RuntimeError, ValueError) as exc:
            failures.append(str(exc).splitlines()[0])
    raise RuntimeError("torch's blockwise scaled_mm refused every scale layout: " + "; ".join(failures))


def _bf16_pair(m: int, n: int, k: int):
    """Random bf16 operands of a GEMM: a [M, K] and b [N, K]."""
    return (torch.randn(m, k, device="cuda").to(torch.bfloat16),
            torch.randn(n, k, device="cuda").to(torch.bfloat16))


def gemm_suite(shapes=None, timer: Timer | None = None) -> dict:
    """The FP8 GEMM beside cuBLAS blockwise (torch.nn.functional.scaled_mm) and bf16 cuBLAS."""
    timer = timer or Timer()
    rows = []
    for m, n, k in shapes or GEMM_SHAPES:
        a, b = _bf16_pair(m, n, k)
        qa, sa = ops.quantize_fp8_per_token(a)
        qb, sb = ops.quantize_fp8_per_block(b)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.fp8_gemm_nt((qa, sa), (qb, sb), d)
        ref = (reference.dequantize_per_token(qa, sa).double()
               @ reference.dequantize_per_block(qb, sb).double().t())
        peer = _torch_blockwise(qa, sa, qb, sb)
        flops = 2 * m * n * k
        ms = timer(lambda: ops.fp8_gemm_nt((qa, sa), (qb, sb), d))
        peer_ms, bf16_ms = timer(peer), timer(lambda: a @ b.t())
        nbytes = m * k + n * k + 2 * m * n
        rows.append({"m": m, "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9,
                     "gbs": nbytes / ms / 1e6, "blockwise_tflops": flops / peer_ms / 1e9,
                     "bf16_tflops": flops / bf16_ms / 1e9, "speedup_vs_blockwise": peer_ms / ms,
                     "calc_diff": calc_diff(d, ref), "peer_calc_diff": calc_diff(peer(), ref)})
    speedups = [r["speedup_vs_blockwise"] for r in rows]
    geomean = float(torch.tensor(speedups).log().mean().exp())
    return {"suite": "fp8-gemm", "gpu": torch.cuda.get_device_name(), "rows": rows,
            "geomean_speedup_vs_blockwise": geomean}


def gemm_table(result: dict) -> str:
    rows = [[r["m"], r["n"], r["k"], f"{r['tflops']:.0f}", f"{r['gbs']:.0f}",
             f"{r['blockwise_tflops']:.0f}", f"{r['bf16_tflops']:.0f}",
             f"{r['speedup_vs_blockwise']:.2f}x", f"{r['calc_diff']:.1e}"] for r in result["rows"]]
    title = (f"{result['gpu']}: FP8 GEMM (1x128 x 128x128 scaling), TFLOPS = 2MNK / kernel time "
             f"(profiler, median of 30, L2 flushed); geomean vs cuBLAS blockwise "
             f"{result['geomean_speedup_vs_blockwise']:.2f}x")
    return title + "\n" + format_table(
        ["M", "N", "K", "TFLOPS", "GB/s", "cuBLAS blockwise", "bf16 cuBLAS", "speedup", "calc_diff"],
        rows)


def _gemm_plot(result: dict, path: str, *, peer: str, peer_label: str, what: str) -> None:
    """Roofline-style: TFLOPS against arithmetic intensity, ours beside the peer's
    (``peer``: its rows' key)."""
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    intensity = [2 * r["m"] * r["n"] * r["k"] / (r["m"] * r["k"] + r["n"] * r["k"] + 2 * r["m"] * r["n"])
                 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.scatter(intensity, [r["tflops"] for r in rows], label="ptxforge", marker="o")
    ax.scatter(intensity, [r[peer] for r in rows], label=peer_label, marker="x")
    ax.set_xscale("log")
    ax.set_xlabel("FLOP per byte (A + B read, D written once)")
    ax.set_ylabel("TFLOPS")
    ax.set_title(f"{result['gpu']}: {what} on DeepGEMM's shape table")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)




def gemm_plot(result: dict, path: str) -> None:
    """The FP8 GEMM suite's TFLOPS against arithmetic intensity, beside cuBLAS blockwise."""
    _gemm_plot(result, path, peer="blockwise_tflops", peer_label="cuBLAS blockwise",
               what="FP8 GEMM")


# DeepGEMM's contiguous MoE rows: (groups, expected rows per group, N, K).
GROUPED_CONTIGUOUS = list(kernels.CONTIGUOUS_SHAPES)
# DeepGEMM's masked rows: (groups, valid rows per group, M_max, N, K); M_max is 4096 for
# one group and twice the valid rows otherwise, as in the anchors.
GROUPED_MASKED = [(g, rows, 4096 if g == 1 else 2 * rows, n, k)
                  for g, rows, n, k in kernels.MASKED_SHAPES]


def contiguous_problems(seed: int = 0):
    """DeepGEMM's contiguous rows with their group sizes drawn 0.7-1.3x the expected size:
    ``(groups, expected, N, K, sizes)``, the same draw for a given seed."""
    rng = random.Random(seed)
    for groups, expected, n, k in GROUPED_CONTIGUOUS:
        yield groups, expected, n, k, [int(expected * rng.uniform(0.7, 1.3)) for _ in range(groups)]


def padded_rows(sizes) -> list[int]:
    """Each group's rows in the contiguous layout: its size rounded up to the alignment."""
    align = ops.get_mk_alignment_for_contiguous_layout()
    return [-(-size // align) * align for size in sizes]


def group_weights(groups: int, n: int, k: int):
    """Each group's B [N, K] quantized per 128x128 block: the (qb, sb) pairs, and stacked
    (qb [G, N, K], sb [G, ceil(N/128), ceil(K/128)])."""
    weights = [ops.quantize_fp8_per_block(torch.randn(n, k, device="cuda").to(torch.bfloat16))
               for _ in range(groups)]
    return weights, (torch.stack([w[0] for w in weights]), torch.stack([w[1] for w in weights]))


def grouped_operands(sizes, n: int, k: int):
    """A contiguous-layout MoE problem: each group's rows padded with -1 rows to the
    alignment, quantized as DeepGEMM's recipe does, and the fp64 reference (padding rows
    zero): ``(qa, sa), (qb, sb), m_indices, reference``."""
    rows = []
    for group, (size, padded) in enumerate(zip(sizes, padded_rows(sizes))):
        rows += [group] * size + [-1] * (padded - size)
    m_indices = torch.tensor(rows, dtype=torch.int32, device="cuda")
    qa, sa = ops.quantize_fp8_per_token(torch.randn(len(rows), k, device="cuda").to(torch.bfloat16))
    weights, b = group_weights(len(sizes), n, k)
    a = reference.dequantize_per_token(qa, sa).double()
    ref = torch.zeros(len(rows), n, dtype=torch.float64, device="cuda")
    for group, (qb, sb) in enumerate(weights):
        mine = m_indices == group
        ref[mine] = a[mine] @ reference.dequantize_per_block(qb, sb).double().t()
    return (qa, sa), b, m_indices, ref


def masked_operands(counts, m_max: int, n: int, k: int):
    """A masked-layout MoE problem: A [G, M_max, K] quantized as one [G * M_max, K] matrix
    (its scales viewed [G, M_max, K/128]), B [G, N, K] per group, and the fp64 reference of
    each group's first counts[g] rows (clamped into [0, M_max]): ``(qa, sa), (qb, sb),
    masked_m, reference``."""
    groups = len(counts)
    qa, sa = ops.quantize_fp8_per_token(
        torch.randn(groups * m_max, k, device="cuda").to(torch.bfloat16))
    weights, b = group_weights(groups, n, k)
    a = reference.dequantize_per_token(qa, sa).double().view(groups, m_max, k)
    ref = torch.zeros(groups, m_max, n, dtype=torch.float64, device="cuda")
    for group, ((qb, sb), count) in enumerate(zip(weights, counts)):
        rows = min(max(count, 0), m_max)
        ref[group, :rows] = a[group, :rows] @ reference.dequantize_per_block(qb, sb).double().t()
    masked_m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    return ((qa.view(groups, m_max, k), sa.view(groups, m_max, sa.shape[1])), b, masked_m, ref)


def _torch_grouped(qa, qb, sizes):
    """torch._scaled_grouped_mm on the same e4m3 operands with row-wise unit scales (the
    coarser recipe torch offers for grouped FP8), or None where it does not run."""
    offs = torch.tensor(list(itertools.accumulate(padded_rows(sizes))), dtype=torch.int32,
                        device="cuda")
    scale_a = torch.ones(qa.shape[0], device="cuda")
    scale_b = torch.ones(qb.shape[0], qb.shape[1], device="cuda")

    def call():
        return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16)
    try:
        call()
        return call
    except (RuntimeError, AttributeError, TypeError):
        return None


def grouped_gemm_suite(timer: Timer | None = None, seed: int = 0) -> dict:
    """The MoE grouped FP8 GEMM on DeepGEMM's contiguous rows (group sizes drawn 0.7-1.3x
    the expected size; beside torch._scaled_grouped_mm where it runs) and masked rows
    (TFLOPS over the valid rows)."""
    timer = timer or Timer()
    rows = []
    for groups, expected, n, k, sizes in contiguous_problems(seed):
        a, b, m_indices, ref = grouped_operands(sizes, n, k)
        d = torch.full((a[0].shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)
        flops = 2 * sum(sizes) * n * k
        ms = timer(lambda: ops.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices))
        peer = _torch_grouped(a[0], b[0], sizes)
        rows.append({"layout": "contiguous", "groups": groups, "m_per_group": expected,
                     "m_sum": sum(sizes), "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9,
                     "torch_tflops": flops / timer(peer) / 1e9 if peer else None,
                     "calc_diff": calc_diff(d, ref)})
        del a, b, ref
    for groups, count, m_max, n, k in GROUPED_MASKED:
        a, b, masked_m, ref = masked_operands([count] * groups, m_max, n, k)
        d = torch.full((groups, m_max, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        call = lambda: ops.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, count)
        call()
        flops = 2 * groups * count * n * k
        ms = timer(call)
        rows.append({"layout": "masked", "groups": groups, "m_per_group": count, "m_max": m_max,
                     "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9, "torch_tflops": None,
                     "calc_diff": calc_diff(d[:, :count], ref[:, :count])})
        del a, b, ref
    return {"suite": "grouped-gemm", "gpu": torch.cuda.get_device_name(), "rows": rows}


def grouped_gemm_table(result: dict) -> str:
    rows = [[r["layout"], r["groups"], r["m_per_group"], r["n"], r["k"], f"{r['tflops']:.0f}",
             f"{r['torch_tflops']:.0f}" if r["torch_tflops"] else "n/a", f"{r['calc_diff']:.1e}"]
            for r in result["rows"]]
    title = (f"{result['gpu']}: MoE grouped FP8 GEMM (1x128 x 128x128 scaling), TFLOPS = "
             f"2 * valid rows * N * K / kernel time (profiler, median of 30, L2 flushed); torch: "
             f"_scaled_grouped_mm, row-wise scales")
    return title + "\n" + format_table(
        ["layout", "groups", "M per group", "N", "K", "TFLOPS", "torch", "calc_diff"], rows)


def grouped_gemm_plot(result: dict, path: str) -> None:
    """A bar per MoE row: ours, and torch._scaled_grouped_mm where it runs."""
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    names = [f"{r['layout']} {r['groups']}x{r['m_per_group']} N{r['n']} K{r['k']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, [r["tflops"] for r in rows], label="ptxforge")
    ax.barh(names, [r["torch_tflops"] or 0 for r in rows], height=0.35,
            label="torch._scaled_grouped_mm (row-wise)")
    ax.invert_yaxis()
    ax.set_xlabel("TFLOPS over the valid rows")
    ax.set_title(f"{result['gpu']}: MoE grouped FP8 GEMM")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bf16_gemm_suite(shapes=None, timer: Timer | None = None) -> dict:
    """The BF16 GEMM beside torch's ``a @ b.t()`` (cuBLAS) on DeepGEMM's dense shapes."""
    timer = timer or Timer()
    rows = []
    for m, n, k in shapes or GEMM_SHAPES:
        a, b, ref = bf16_gemm_operands(m, n, k)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.bf16_gemm_nt(a, b, d)
        flops = 2 * m * n * k
        ms = timer(lambda: ops.bf16_gemm_nt(a, b, d))
        peer_ms = timer(lambda: a @ b.t())
        rows.append({"m": m, "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9,
                     "cublas_tflops": flops / peer_ms / 1e9, "speedup": peer_ms / ms,
                     "calc_diff": calc_diff(d, ref)})
    geomean = float(torch.tensor([r["speedup"] for r in rows]).log().mean().exp())
    return {"suite": "bf16-gemm", "gpu": torch.cuda.get_device_name(), "rows": rows,
            "geomean_speedup_vs_cublas": geomean}


def bf16_gemm_table(result: dict) -> str:
    rows = [[r["m"], r["n"], r["k"], f"{r['tflops']:.0f}", f"{r['cublas_tflops']:.0f}",
             f"{r['speedup']:.2f}x", f"{r['calc_diff']:.1e}"] for r in result["rows"]]
    title = (f"{result['gpu']}: BF16 GEMM, TFLOPS = 2MNK / kernel time (profiler, median of 30, "
             f"L2 flushed); geomean vs cuBLAS (torch a @ b.t()) "
             f"{result['geomean_speedup_vs_cublas']:.2f}x")
    return title + "\n" + format_table(["M", "N", "K", "TFLOPS", "cuBLAS", "speedup", "calc_diff"],
                                       rows)


def bf16_gemm_plot(result: dict, path: str) -> None:
    """The BF16 GEMM suite's TFLOPS against arithmetic intensity, beside cuBLAS."""
    _gemm_plot(result, path, peer="cublas_tflops", peer_label="cuBLAS (a @ b.t())",
               what="BF16 GEMM")


# Decode-time GEMMs: a few tokens against DeepGEMM's weights, bound by the weight stream.
# M is the tokens; per group for the masked rows, with M_max twice that as in the
# grouped suite's masked rows.
DECODE_M = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_MASKED = [(groups, tokens, n, k) for n, k in ((4096, 7168), (7168, 2048))
                 for groups, tokens in ((8, 8), (8, 32), (32, 8), (32, 32))]
# Llama-3-8B's Linears as a text-generation step runs them (qkv, o, gate_up, down: N x K),
# at batch 1, 8 and 32: weights of 17-117 MB, where a kernel's fixed costs show beside its
# weight stream (`ptxforge bench generate`'s step).
LLAMA_DECODE_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
LLAMA_DECODE_M = (1, 8, 32)
DECODE_PEERS = {"fp8": "cuBLAS blockwise", "bf16": "cuBLAS a @ b.t()",
                "fp8 llama": "cuBLAS blockwise"}


def decode_problems():
    """``(family, groups, M, N, K)`` of every decode row."""
    for family in ("fp8", "bf16"):
        for n, k in kernels.GEMM_SHAPES:
            for m in DECODE_M:
                yield family, 1, m, n, k
    for groups, tokens, n, k in DECODE_MASKED:
        yield "masked fp8", groups, tokens, n, k
    for n, k in LLAMA_DECODE_SHAPES:
        for m in LLAMA_DECODE_M:
            yield "fp8 llama", 1, m, n, k


def gemm_bytes(rows_per_group, n: int, k: int, fp8: bool = True) -> int:
    """The bytes a GEMM must move: for each group with at least one row, its weights B [N, K]
    (FP8: and their 128x128 block scales), its rows of A (FP8: and their 1x128 scales) and
    of D (bf16) written. A dense GEMM is one group."""
    k_blocks, n_blocks = -(-k // 128), -(-n // 128)
    if fp8:
        weights, a_row = n * k + 4 * n_blocks * k_blocks, k + 4 * k_blocks
    else:
        weights, a_row = 2 * n * k, 2 * k
    return sum(weights + rows * (a_row + 2 * n) for rows in rows_per_group if rows > 0)


def _decode_case(family: str, groups: int, m: int, n: int, k: int):
    """The call to time, its output (poisoned with NaN) and fp64 reference, and its peer
    (None for the masked rows, and where torch refuses the shape)."""
    if family == "masked fp8":
        a, b, masked_m, ref = masked_operands([m] * groups, 2 * m, n, k)
        d = torch.full((groups, 2 * m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        call = lambda: ops.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, m)
        return call, d[:, :m], ref[:, :m], None
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    if family == "bf16":
        a, b, ref = bf16_gemm_operands(m, n, k)
        return lambda: ops.bf16_gemm_nt(a, b, d), d, ref, lambda: a @ b.t()
    a, b, ref = fp8_gemm_operands(m, n, k)
    try:
        peer = _torch_blockwise(*a, *b)
    except RuntimeError:
        peer = None
    return lambda: ops.fp8_gemm_nt(a, b, d), d, ref, peer


def decode_suite(timer: Timer | None = None) -> dict:
    """Each decode row's kernel time beside the limit, a device-to-device copy moving the same
    bytes (the faster of two), and beside its cuBLAS peer, all timed in one profiler session
    per row; the large-copy roofline measured in the same run."""
    timer = timer or Timer()
    copy_gbs = copy_bandwidth_gbs(timer)
    rows = []
    for family, groups, m, n, k in decode_problems():
        call, out, ref, peer = _decode_case(family, groups, m, n, k)
        call()
        diff = calc_diff(out, ref)
        nbytes = gemm_bytes([m] * groups, n, k, fp8=family != "bf16")
        # Two copies in separate buffers, the faster kept: one copy's time moved by up to 20%
        # between rows of the same size on an H200 (where its buffers landed).
        ms, copy_ms, again_ms, *peer_ms = timer.each(
            [call, copy_of(nbytes), copy_of(nbytes)] + ([peer] if peer else []))
        copy_ms = min(copy_ms, again_ms)
        peer_ms = peer_ms[0] if peer_ms else None
        rows.append({"family": family, "groups": groups, "m": m, "n": n, "k": k,
                     "bytes": nbytes, "ms": ms, "copy_ms": copy_ms, "of_copy": copy_ms / ms,
                     "of_roofline": nbytes / copy_gbs / 1e6 / ms, "peer_ms": peer_ms,
                     "speedup": peer_ms / ms if peer_ms else None, "calc_diff": diff})
    return {"suite": "decode", "gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
            "rows": rows, "summary": decode_summary(rows)}


def decode_summary(rows: list) -> list[dict]:
    """Per family, what says whether decode is memory-bound: the least fraction of the
    same-size copy's speed at M <= 64 and at M = 128, and the geomean and least speedup
    over the peer (on the rows where it ran)."""
    summary = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        speedups = [r["speedup"] for r in mine if r["speedup"]]
        of_copy = lambda tokens: min((r["of_copy"] for r in mine if tokens(r["m"])), default=None)
        summary.append({
            "family": family, "rows": len(mine), "peer_rows": len(speedups),
            "least_of_copy_m_le_64": of_copy(lambda m: m <= 64),
            "least_of_copy_m_128": of_copy(lambda m: m == 128),
            "geomean_speedup": statistics.geometric_mean(speedups) if speedups else None,
            "least_speedup": min(speedups, default=None)})
    return summary


def _or_na(value, fmt: str, scale: float = 1) -> str:
    return "n/a" if value is None else fmt.format(value * scale)


def decode_table(result: dict) -> str:
    rows = [[r["family"], r["groups"], r["m"], r["n"], r["k"], f"{r['bytes'] / 1e6:.1f}",
             f"{r['ms'] * 1e3:.1f}", f"{r['copy_ms'] * 1e3:.1f}", f"{r['of_copy']:.0%}",
             f"{r['of_roofline']:.0%}", _or_na(r["peer_ms"], "{:.1f}", 1e3),
             _or_na(r["speedup"], "{:.2f}x"), f"{r['calc_diff']:.1e}"] for r in result["rows"]]
    title = (f"{result['gpu']}: decode GEMMs against the memory limit, kernel times (profiler, "
             f"median of 30, L2 flushed). MB = A, B, scales and D; copy = a device-to-device "
             f"copy moving as many bytes, timed in the same run; roofline = those bytes at the "
             f"large copy's {result['copy_gbs']:.0f} GB/s; M = tokens (per group when masked); "
             f"peers: " + ", ".join(f"{peer} ({family})" for family, peer in DECODE_PEERS.items()))
    lines = []
    for family in result["summary"]:
        peer = DECODE_PEERS.get(family["family"])
        vs_peer = (f"geomean {_or_na(family['geomean_speedup'], '{:.2f}x')} (least "
                   f"{_or_na(family['least_speedup'], '{:.2f}x')}) vs {peer} over "
                   f"{family['peer_rows']} of {family['rows']} rows" if peer else "no peer")
        lines.append(f"{family['family']}: least of copy "
                     f"{_or_na(family['least_of_copy_m_le_64'], '{:.0%}')} at M <= 64, "
                     f"{_or_na(family['least_of_copy_m_128'], '{:.0%}')} at M = 128; {vs_peer}")
    return title + "\n" + format_table(
        ["family", "groups", "M", "N", "K", "MB", "us", "copy us", "of copy", "of roofline",
         "peer us", "speedup", "calc_diff"], rows) + "\n" + "\n".join(lines)


def decode_plot(result: dict, path: str) -> None:
    """% of the same-size copy's speed against M: a panel per family, a line per shape."""
    plt = pyplot()
    if plt is None:
        return
    lines = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in result["rows"]:
        lines[r["family"]][(r["groups"], r["n"], r["k"])].append((r["m"], 100 * r["of_copy"]))
    fig, axes = plt.subplots(1, len(lines), figsize=(5 * len(lines), 4.5), sharey=True,
                             squeeze=False)
    for ax, (family, shapes) in zip(axes[0], lines.items()):
        for (groups, n, k), points in shapes.items():
            ax.plot(*zip(*points), marker="o",
                    label=f"{n}x{k}" if groups == 1 else f"{groups} groups, {n}x{k}")
        ax.set_xscale("log", base=2)
        tokens = sorted({m for points in shapes.values() for m, _ in points})
        ax.set_xticks(tokens, [str(m) for m in tokens])
        ax.set_xlabel("M (tokens; per group when masked)")
        ax.set_title(family)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("% of a same-size copy's speed")
    fig.suptitle(f"{result['gpu']}: decode GEMMs against the memory limit")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# What programmatic dependent launch is for: a chain of dependent FP8 GEMMs as a decode step
# runs them, (N, K) alternating, at M tokens, where each kernel's launch and set-up can
# overlap the end of the one before it.
CHAIN_M = 8
CHAIN_SHAPES = ((4096, 7168), (7168, 2048), (4096, 7168), (7168, 2048))


def chain_suite(timer: Timer | None = None) -> dict:
    """CHAIN_SHAPES' FP8 GEMMs at M = CHAIN_M one after another on one stream, captured in
    a CUDA graph with pdl False and with pdl True (operands quantized beforehand: the graph
    holds the four GEMMs alone), each graph replayed with the L2 flushed before every
    replay. Per graph, medians over the replays: the chain's time (the first kernel's start
    to the last one's end, from the profiler's kernel records), the gaps between one
    kernel's end and the next one's start (negative: they overlap), and the replay's time
    by CUDA events around it (launch included; a check on the profiler's figure). Beside
    them the sum of the four kernels' times each timed alone (``Timer``), which the chain
    with PDL should not exceed, and the largest calc_diff of the graph's outputs."""
    timer = timer or Timer()
    calls = []
    for n, k in CHAIN_SHAPES:
        a, b, ref = fp8_gemm_operands(CHAIN_M, n, k)
        d = torch.full((CHAIN_M, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        calls.append((lambda pdl, a=a, b=b, d=d: ops.fp8_gemm_nt(a, b, d, pdl=pdl), d, ref))
    alone = timer.each([lambda call=call: call(False) for call, _, _ in calls])
    rows = []
    for pdl in (False, True):
        graph = _captured(lambda: [call(pdl) for call, _, _ in calls])
        for _, d, _ in calls:
            d.fill_(float("nan"))
        replays = timer.intervals([graph.replay])
        if any(len(replay) != len(calls) for replay in replays):
            counts = sorted({len(replay) for replay in replays})
            raise RuntimeError(f"the profiler saw {counts} kernels in a replay of the graph, "
                               f"expected {len(calls)}")
        chains = [max(end for _, end in replay) - replay[0][0] for replay in replays]
        gaps = [[later[0] - earlier[1] for earlier, later in zip(replay, replay[1:])]
                for replay in replays]
        rows.append({"pdl": pdl, "chain_us": statistics.median(chains),
                     "gaps_us": [statistics.median(gap) for gap in zip(*gaps)],
                     "events_us": _replay_us(graph, timer),
                     "calc_diff": max(calc_diff(d, ref) for _, d, ref in calls)})
        del graph
    alone_us = [ms * 1e3 for ms in alone]
    for row in rows:
        row["of_standalone_sum"] = row["chain_us"] / sum(alone_us)
    return {"suite": "chain", "gpu": torch.cuda.get_device_name(), "m": CHAIN_M,
            "shapes": [list(shape) for shape in CHAIN_SHAPES], "standalone_us": alone_us,
            "standalone_sum_us": sum(alone_us), "rows": rows}


def _captured(launch) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what ``launch()`` enqueues, run once first (plans, launchers)."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph


def _replay_us(graph, timer: Timer) -> float:
    """Median time of a replay by CUDA events recorded around it, the L2 flushed first."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(timer.reps)]
    for _ in range(timer.warmup):
        graph.replay()
    for start, end in events:
        timer.flush()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def chain_table(result: dict) -> str:
    shapes = ", ".join(f"{n}x{k}" for n, k in result["shapes"])
    alone = " + ".join(f"{us:.1f}" for us in result["standalone_us"])
    rows = [["on" if r["pdl"] else "off", f"{r['chain_us']:.1f}", f"{r['of_standalone_sum']:.1%}",
             ", ".join(f"{gap:+.1f}" for gap in r["gaps_us"]), f"{r['events_us']:.1f}",
             f"{r['calc_diff']:.1e}"] for r in result["rows"]]
    title = (f"{result['gpu']}: a CUDA graph of {len(result['shapes'])} FP8 GEMMs at M = "
             f"{result['m']}, (N, K) = {shapes}; chain = first kernel's start to last kernel's "
             f"end (profiler, median of the replays, L2 flushed before each); gaps = next "
             f"start - end (negative: overlap); graph = a replay by CUDA events, launch "
             f"included. Standalone (each kernel alone, profiler, L2 flushed): {alone} = "
             f"{result['standalone_sum_us']:.1f} us")
    lines = [f"PDL {row[0]}: chain {row[1]} us = {row[2]} of the standalone sum"
             for row in rows]
    return (title + "\n" + format_table(
        ["PDL", "chain us", "of standalone sum", "gaps us", "graph us", "calc_diff"], rows)
        + "\n" + "\n".join(lines))
