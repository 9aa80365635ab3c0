"""Where the first call of a compiled model goes (issue 14: no slower than Inductor's own
compile of the same model), each candidate in a fresh process with empty Inductor, Triton
and ptxforge caches, so neither finds the other's kernels: seconds of the first call, and
torch's own breakdown of it (Dynamo's trace, AOTAutograd, Inductor, the backend).

    python bench/first_call_probe.py [llama-8b:64]     # runs each candidate in a subprocess
"""

import os
import subprocess
import sys
import tempfile
import time

CANDIDATES = ("inductor", "ptxforge")


def first_call(candidate: str, name: str, tokens: int) -> None:
    import torch
    from torch._dynamo.utils import compile_times

    from ptxforge import compiler
    from ptxforge import models

    torch.manual_seed(0)
    case = models.build(name)
    case.model.cuda()
    args, kwargs = case.inputs(tokens, "cuda")
    fn = (compiler.compile(case.model) if candidate == "ptxforge"
          else torch.compile(case.model, dynamic=False))
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(f"== {candidate}: {case.name}, {tokens} tokens, first call {seconds:.2f} s")
    print(compile_times(repr="str", aggregate=True))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        candidate, spec = sys.argv[2:4]
        name, tokens = spec.split(":")
        first_call(candidate, name, int(tokens))
        return
    spec = sys.argv[1] if len(sys.argv) > 1 else "llama-8b:64"
    for candidate in CANDIDATES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
                   "TRITON_CACHE_DIR": f"{cache}/triton", "PTXFORGE_CACHE_DIR": f"{cache}/ptxforge"}
            subprocess.run([sys.executable, __file__, "--one", candidate, spec], env=env,
                           check=True)


if __name__ == "__main__":
    main()
