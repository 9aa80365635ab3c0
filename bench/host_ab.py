"""Host time per call of each op, this tree's ptxforge against another source tree's, in one
process: rounds rotate through the sides so that clock and load drift hit all alike, and
the baseline is loaded twice, so that the gap between its two copies (A/A) shows what
difference the method can resolve.

    python bench/host_ab.py BASELINE_SRC [rounds]     # BASELINE_SRC holds a ptxforge/ folder
    python bench/host_ab.py --native [rounds]         # this tree: ctypes launches (twice) vs C

With --native the baseline is this tree itself launching through ctypes
(PTXFORGE_NATIVE_LAUNCH=0), against its C launcher (runtime/native.c).

Per round and op: 1000 calls while a sleep kernel keeps the GPU busy (pure host cost, as
bench/host_breakdown.py's 'host' column); the table gives each side's minimum over rounds
(noise only adds time) and its median.
"""

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import ptxforge


def load_as(name: str, package_dir: Path):
    """Import the package in ``package_dir`` under another name (its imports are relative)."""
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def calls(p):
    """op name -> a zero-argument call of that op in package ``p`` on small cached problems."""
    bf = lambda *shape: torch.randn(shape, device="cuda").to(torch.bfloat16)  # noqa: E731
    x, w, y = bf(4, 1024), bf(1024), bf(4, 1024)
    q = torch.empty((4, 1024), dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((4, 8), dtype=torch.float32, device="cuda")
    a, b = p.quantize_fp8_per_token(x), p.quantize_fp8_per_block(bf(256, 1024))
    d = torch.empty((4, 256), dtype=torch.bfloat16, device="cuda")
    ga = p.quantize_fp8_per_token(bf(256, 1024))
    gb16 = bf(2, 256, 1024)
    gb = (gb16.to(torch.float8_e4m3fn), torch.ones((2, 2, 8), device="cuda"))
    m_indices = torch.arange(256, device="cuda", dtype=torch.int32) // 128
    gd = torch.empty((256, 256), dtype=torch.bfloat16, device="cuda")
    ma = (ga[0].view(2, 128, 1024), ga[1].view(2, 128, 8))
    masked_m = torch.tensor([64, 64], device="cuda", dtype=torch.int32)
    md = torch.empty((2, 128, 256), dtype=torch.bfloat16, device="cuda")
    return {
        "rms_norm(out=)": lambda: p.rms_norm(x, w, out=y),
        "rms_norm": lambda: p.rms_norm(x, w),
        "quantize_fp8_per_token(out=)": lambda: p.quantize_fp8_per_token(x, out=(q, s)),
        "quantize_fp8_per_token": lambda: p.quantize_fp8_per_token(x),
        "fp8_gemm_nt 4x256x1024": lambda: p.fp8_gemm_nt(a, b, d),
        "bf16_gemm_nt 4x256x1024": lambda: p.bf16_gemm_nt(x, gb16[0], d),
        "m_grouped_fp8_gemm_nt_contiguous 2x128": lambda: p.m_grouped_fp8_gemm_nt_contiguous(
            ga, gb, gd, m_indices),
        "m_grouped_fp8_gemm_nt_masked 2x64/128": lambda: p.m_grouped_fp8_gemm_nt_masked(
            ma, gb, md, masked_m, 64),
    }


def host_us(fn, count: int = 1000) -> float:
    torch.cuda._sleep(200_000_000)  # the GPU stays busy: nothing waits on it
    start = time.perf_counter()
    for _ in range(count):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / count * 1e6


def warm(ops) -> None:
    """Build, load and warm every kernel and cache of one side."""
    for fn in ops.values():
        for _ in range(100):
            fn()


def sides_to_compare(baseline: str) -> dict:
    """side -> its op calls, warmed: the baseline loaded twice (A/A), then the side measured."""
    if baseline == "--native":
        # A copy takes its launch path when it makes its first launcher: the ctypes copies
        # are set up and warmed under PTXFORGE_NATIVE_LAUNCH=0.
        package = Path(ptxforge.__file__).parent
        os.environ["PTXFORGE_NATIVE_LAUNCH"] = "0"
        copies = {"ctypes": load_as("ptxforge_ctypes", package),
                  "ctypes again": load_as("ptxforge_ctypes_again", package)}
        sides = {side: calls(copy) for side, copy in copies.items()}
        for ops in sides.values():
            warm(ops)
        del os.environ["PTXFORGE_NATIVE_LAUNCH"]
        sides["native"] = calls(ptxforge)
        warm(sides["native"])
        for side, copy in {**copies, "native": ptxforge}.items():
            launcher = copy.ops.rowwise._kernel(0, 1024, True, False, None)[2]
            print(f"{side}: rms_norm launches through {launcher.path}")
        return sides
    package = Path(baseline) / "ptxforge"
    sides = {"baseline": calls(load_as("ptxforge_baseline", package)),
             "baseline again": calls(load_as("ptxforge_baseline_again", package)),
             "this tree": calls(ptxforge)}
    for ops in sides.values():
        warm(ops)
    return sides


def main() -> None:
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 21
    sides = sides_to_compare(sys.argv[1])
    torch.cuda.synchronize()
    times = {side: {op: [] for op in ops} for side, ops in sides.items()}
    names = list(sides)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for op in sides[names[0]]:
            for side in order:
                times[side][op].append(host_us(sides[side][op]))
    print(f"host us per call, min / median of {rounds} rounds of 1000 calls (GPU kept busy)")
    print(f"{'op':<40} " + " ".join(f"{side:>15}" for side in names)
          + f" {'A/A (min)':>10} {'change (min)':>13}")
    for op in sides[names[0]]:
        cells = [(min(times[side][op]), statistics.median(times[side][op])) for side in names]
        print(f"{op:<40} " + " ".join(f"{lo:7.2f} /{mid:6.2f}" for lo, mid in cells)
              + f" {cells[1][0] - cells[0][0]:+10.2f} {cells[2][0] - cells[0][0]:+13.2f}")


if __name__ == "__main__":
    main()
