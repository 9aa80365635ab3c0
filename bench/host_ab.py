"""Host time per call of each op, this tree's ptxforge against another source tree's. Each
side is a process of its own, importing its tree's ptxforge from its own PYTHONPATH; this
process steps them through the rounds, each round in a rotated order, so that clock and
load drift hit all alike. The baseline runs in two processes, so that the gap between its
two copies (A/A) shows what difference the method can resolve.

    python bench/host_ab.py BASELINE_SRC [rounds]     # BASELINE_SRC holds a ptxforge/ folder
    python bench/host_ab.py --native [rounds]         # this tree: ctypes launches (twice) vs C

BASELINE_SRC is the ``src`` of another checkout, e.g. ``git worktree add /tmp/base main``,
then ``/tmp/base/src``. With --native the baseline is this tree itself launching through
ctypes (PTXFORGE_NATIVE_LAUNCH=0), against its C launcher (runtime/native.c).

Per round and op: 1000 calls while a sleep kernel keeps the GPU busy (pure host cost, as
bench/host_breakdown.py's 'host' column); the table gives each side's minimum over rounds
(noise only adds time) and its median.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

THIS_TREE = Path(__file__).resolve().parents[1] / "src"   # the tree measured
SIDE = "--side"  # argv[1] of a side's process


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


def launch_path() -> str:
    """Which launch path the side's ptxforge takes: its C launcher or ctypes."""
    try:
        from ptxforge.runtime import native
    except ImportError:
        return "ctypes (the tree has no C launcher)"
    return "native" if native.module() is not None else "ctypes"


def side() -> None:
    """A side's process: build, load and warm every op, say which ptxforge it runs, then
    answer each op name read from stdin with that op's host time, one JSON line each."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what ptxforge, torch or a compiler print goes to stderr, off the replies
    import ptxforge

    ops = calls(ptxforge)
    for fn in ops.values():
        for _ in range(100):
            fn()
    torch.cuda.synchronize()
    replies.write(json.dumps({"ptxforge": ptxforge.__file__, "launch": launch_path(),
                              "ops": list(ops)}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(host_us(ops[line.strip()])) + "\n")


class Side:
    """A side's process, started with ``src`` as its only PYTHONPATH and the variables of
    ``env`` set (or, where None, unset)."""

    def __init__(self, name: str, src: Path, env: dict):
        self.name, self.src = name, src
        environment = {**os.environ, **env, "PYTHONPATH": str(src)}
        environment = {key: value for key, value in environment.items() if value is not None}
        self.process = subprocess.Popen([sys.executable, __file__, SIDE], env=environment,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1)

    def ready(self) -> dict:
        """The side's ptxforge, launch path and ops, once it has warmed them."""
        hello = self._reply()
        package = Path(hello["ptxforge"]).resolve().parent
        if package != self.src / "ptxforge":
            raise SystemExit(f"{self.name}: imported {package}, not {self.src / 'ptxforge'} "
                             f"(an installed ptxforge ahead of PYTHONPATH?)")
        return hello

    def host_us(self, op: str) -> float:
        self.process.stdin.write(op + "\n")
        return self._reply()

    def _reply(self):
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: its process ended (exit code "
                             f"{self.process.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def sides_to_compare(baseline: str) -> list[Side]:
    """The baseline twice (A/A), then the side measured."""
    if baseline == "--native":
        ctypes = {"PTXFORGE_NATIVE_LAUNCH": "0"}
        return [Side("ctypes", THIS_TREE, ctypes), Side("ctypes again", THIS_TREE, ctypes),
                Side("native", THIS_TREE, {"PTXFORGE_NATIVE_LAUNCH": None})]
    src = Path(baseline).resolve()
    if not (src / "ptxforge" / "__init__.py").is_file():
        raise SystemExit(f"BASELINE_SRC must hold a ptxforge/ package, got {baseline!r}")
    return [Side("baseline", src, {}), Side("baseline again", src, {}),
            Side("this tree", THIS_TREE, {})]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == SIDE:
        return side()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 21
    sides = sides_to_compare(sys.argv[1])
    try:
        ops = None
        for s in sides:
            hello = s.ready()
            print(f"{s.name}: {hello['ptxforge']}, launches through {hello['launch']}")
            if ops is not None and hello["ops"] != ops:
                raise SystemExit(f"{s.name} measures {hello['ops']}, the first side {ops}")
            ops = hello["ops"]
        times = {s.name: {op: [] for op in ops} for s in sides}
        for r in range(rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for op in ops:
                for s in order:
                    times[s.name][op].append(s.host_us(op))
    finally:
        for s in sides:
            s.close()
    names = [s.name for s in sides]
    print(f"host us per call, min / median of {rounds} rounds of 1000 calls (GPU kept busy)")
    print(f"{'op':<40} " + " ".join(f"{name:>15}" for name in names)
          + f" {'A/A (min)':>10} {'change (min)':>13}")
    for op in ops:
        cells = [(min(times[name][op]), statistics.median(times[name][op])) for name in names]
        print(f"{op:<40} " + " ".join(f"{lo:7.2f} /{mid:6.2f}" for lo, mid in cells)
              + f" {cells[1][0] - cells[0][0]:+10.2f} {cells[2][0] - cells[0][0]:+13.2f}")


if __name__ == "__main__":
    main()
