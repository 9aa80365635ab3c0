"""First-call JIT cost per assembler: PTX generation, assembly and module load, cache off."""

import json
import os
import sys
import time

os.environ["PTXFORGE_DISABLE_CACHE"] = "1"

import torch  # noqa: E402

from ptxforge import arch, jit, kernels  # noqa: E402
from ptxforge.jit.assemble import get_assembler  # noqa: E402

a = arch.current()
# The first module load of a process pays the driver's one-time setup; keep it apart.
start = time.perf_counter()
jit.build(kernels.get("rms_norm").builder(a, hidden=512)).load(torch.cuda.current_device())
print(f"first build + module load in this process: {1e3 * (time.perf_counter() - start):.1f} ms")
rows = []
for name in ("nvjitlink", "ptxas", "driver"):
    try:
        asm = get_assembler(name)
    except Exception as exc:  # report what is missing and go on
        rows.append({"assembler": name, "error": str(exc)})
        continue
    for spec_name, options in (("quantize_fp8_per_token", {"hidden": 7168}),
                               ("rms_norm_quantize_fp8", {"hidden": 7168}),
                               ("quantize_fp8_per_block", {}),
                               ("fp8_gemm_nt", {"m": 4096, "n": 7168, "k": 16384}),
                               ("fp8_gemm_nt", {"m": 64, "n": 2112, "k": 7168}),
                               ("m_grouped_fp8_gemm_nt_contiguous",
                                {"groups": 4, "m": 32768, "n": 4096, "k": 7168}),
                               ("m_grouped_fp8_gemm_nt_masked",
                                {"groups": 4, "expected_m": 256, "n": 7168, "k": 2048}),
                               ("bf16_gemm_nt", {"m": 4096, "n": 7168, "k": 16384})):
        spec = kernels.get(spec_name)
        samples = []
        for sample in range(3):  # median of three cold builds
            jit._memory.clear()
            start = time.perf_counter()
            builder = spec.builder(a, **options)
            # A unique comment makes unique PTX: the driver's and nvJitLink's own caches miss.
            builder.comment(f"jit timing sample {time.time_ns()} {sample}")
            generated = time.perf_counter()
            compiled = jit.build(builder, assembler=name)
            assembled = time.perf_counter()
            compiled.load(torch.cuda.current_device())
            loaded = time.perf_counter()
            samples.append((generated - start, assembled - generated, loaded - assembled,
                            loaded - start))
        med = [sorted(col)[1] * 1e3 for col in zip(*samples)]
        rows.append({"assembler": repr(asm), "kernel": compiled.name, "generate_ms": med[0],
                     "assemble_ms": med[1], "load_ms": med[2], "total_ms": med[3],
                     "ptx_lines": compiled.ptx.count("\n")})
json.dump(rows, open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout, indent=2)
print()
for r in rows:
    if "error" in r:
        print(f"{r['assembler']:<16} unavailable: {r['error']}")
    else:
        print(f"{r['assembler']:<16} {r['kernel']:<62} gen {r['generate_ms']:6.1f} ms  asm "
              f"{r['assemble_ms']:6.1f} ms  load {r['load_ms']:5.1f} ms  total {r['total_ms']:6.1f} ms")
