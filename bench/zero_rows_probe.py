import torch
from ptxforge import ops
from ptxforge.testing.bench import Timer, copy_of, gemm_bytes
timer = Timer()
for n, k in ((7168, 2048), (4096, 7168), (2112, 7168)):
    for m in (8, 64):
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        one = torch.zeros_like(full); one[0] = full[0]
        zero = torch.zeros_like(full)
        copy = copy_of(gemm_bytes([m], n, k, fp8=False))
        c = min(timer(copy), timer(copy))
        t = [timer(lambda a=a: ops.bf16_gemm_nt(a, b, d)) for a in (full, one, zero)]
        print(f"bf16 M={m} {n}x{k}: % of copy with A random / one row / zeros: " + " / ".join(f"{100*c/x:.0f}" for x in t), flush=True)
