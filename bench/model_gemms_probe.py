"""The GEMMs of issue 14's models timed alone, to set beside the same kernels inside a
compiled call (`bench/model_profile.py`): profiler kernel time, median of 30, with the L2
flushed before each call (the anchors' method) and without (back to back, as in a model),
and for the residual epilogue what it costs over the plain GEMM of the same shape.

    python bench/model_gemms_probe.py
"""

import torch

from ptxforge import ops
from ptxforge.bench import format_table
from ptxforge.bench.ops import Timer

# (label, M, N, K): the FFN block at 4096 tokens and Llama-3-8B's layer at 2048.
SHAPES = [("ffn gate_up", 4096, 4096, 7168), ("ffn down", 4096, 7168, 2048),
          ("llama qkv", 2048, 6144, 4096), ("llama o", 2048, 4096, 4096),
          ("llama gate_up", 2048, 28672, 4096), ("llama down", 2048, 4096, 14336)]


def main():
    flushed, back_to_back = Timer(), Timer(flush_bytes=1)
    rows = []
    for label, m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        qa, qb = ops.quantize_fp8_per_token(a), ops.quantize_fp8_per_block(b)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        calls = {"plain": lambda: ops.fp8_gemm_nt(qa, qb, d),
                 "residual": lambda: ops.fp8_gemm_nt(qa, qb, d, residual=residual),
                 "residual=d": lambda: ops.fp8_gemm_nt(qa, qb, d, residual=d)}
        for timer, how in ((flushed, "L2 flushed"), (back_to_back, "back to back")):
            times = dict(zip(calls, timer.each(list(calls.values()))))
            tflops = 2 * m * n * k / times["plain"] / 1e9
            rows.append([label, f"{m}x{n}x{k}", how, f"{times['plain'] * 1e3:.1f}",
                         f"{tflops:.0f}", f"{times['residual'] * 1e3:.1f}",
                         f"{times['residual=d'] * 1e3:.1f}",
                         f"{(times['residual'] - times['plain']) * 1e3:+.1f}"])
    print(format_table(["gemm", "MxNxK", "timing", "plain us", "TFLOPS", "residual us",
                        "residual=d us", "residual cost us"], rows))


if __name__ == "__main__":
    main()
