"""FP8 GEMM on DeepGEMM's dense shape table beside torch's blockwise-scaled cuBLAS call and
bf16 cuBLAS, one process. Kernel time: CUDA events, L2 flushed, median of 30."""

import sys

import torch

import ptxforge
from ptxforge import reference
from ptxforge.bench import Timer, format_table

SHAPES = [(m, n, k) for m in (64, 128, 4096) for n, k in
          ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))]
if len(sys.argv) > 1 and sys.argv[1] == "quick":
    SHAPES = [(128, 7168, 2048), (4096, 7168, 2048)]


def calc_diff(x, y):
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def torch_blockwise(qa, sa, qb, sb):
    """torch's blockwise-scaled FP8 GEMM; the scale layouts it accepts are probed once."""
    F = torch.nn.functional
    st = F.ScalingType
    candidates = [
        (sa, sb), (sa.contiguous(), sb), (sa, sb.t().contiguous().t()), (sa.contiguous(), sb.t()),
        (sa, sb.t()), (sa.t().contiguous().t(), sb),
    ]
    errors = []
    for sa_c, sb_c in candidates:
        try:
            fn = lambda sa_c=sa_c, sb_c=sb_c: F.scaled_mm(qa, qb.t(), sa_c, st.BlockWise1x128, sb_c,
                                                         st.BlockWise128x128, output_dtype=torch.bfloat16)
            fn()
            return fn
        except Exception as exc:  # a layout torch refuses: try the next
            errors.append(str(exc).splitlines()[0][:120])
    print("torch blockwise unavailable:", errors[:2])
    return None


timer = Timer()
rows = []
for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    qa, sa = ptxforge.quantize_fp8_per_token(a)
    qb, sb = ptxforge.quantize_fp8_per_block(b)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptxforge.fp8_gemm_nt((qa, sa), (qb, sb), d)
    ref = reference.dequantize_per_token(qa, sa).double() @ reference.dequantize_per_block(qb, sb).double().t()
    diff = calc_diff(d, ref)
    flops = 2 * m * n * k
    ms = timer(lambda: ptxforge.fp8_gemm_nt((qa, sa), (qb, sb), d))
    peer = torch_blockwise(qa, sa, qb, sb)
    peer_ms = timer(peer) if peer else float("nan")
    peer_diff = calc_diff(peer(), ref) if peer else float("nan")
    bf16_ms = timer(lambda: a @ b.t())
    rows.append([m, n, k, f"{flops / ms / 1e9:.0f}", f"{flops / peer_ms / 1e9:.0f}",
                 f"{flops / bf16_ms / 1e9:.0f}", f"{peer_ms / ms:.2f}x", f"{diff:.1e}", f"{peer_diff:.1e}"])
    del a, b, qa, qb, d, ref
print(f"{torch.cuda.get_device_name()}: TFLOPS (2MNK / kernel time)")
print(format_table(["M", "N", "K", "ptxforge", "cublas-blockwise", "bf16", "vs blockwise",
                    "diff", "peer diff"], rows))
