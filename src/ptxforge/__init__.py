"""ptxforge: GPU kernels written in PTX from Python, assembled in milliseconds, launched from PyTorch.

    import ptxforge
    q, s = ptxforge.quantize_fp8_per_token(x)          # bf16 [M, K] -> e4m3 + 1x128 scales
    y = ptxforge.rms_norm(x, weight)
    model = ptxforge.compile(model)                    # torch.compile with ptxforge's backend
    ids = ptxforge.generate(model, ids, 128)           # greedy decoding, no host sync a step
    model = ptxforge.onnx.load("model.onnx")           # an ONNX model as a torch module

The layers, in the order a call passes through them: ``ops`` (validate, pick a config,
launch) -> ``kernels`` (one generator per kernel) -> ``ptx`` (the builder) -> ``jit``
(assemble, cache) -> ``runtime`` (load, launch by name), with hardware numbers from
``arch``; ``testing`` holds the reference recipes and checks, ``bench`` the benchmark
suites, ``models`` the example models the reports and benchmarks build.
"""

from .public import PTXFORGE_NAMES

__version__ = "0.1.0"


def __getattr__(name):
    # The ops import torch; keep `import ptxforge` (and the builder, the CLI's help) light.
    if name in PTXFORGE_NAMES:
        from . import ops

        # Kept as a module global: later lookups do not come here (a call here costs a
        # microsecond, on every `ptxforge.op(...)`).
        value = globals()[name] = getattr(ops, name)
        return value
    if name == "compile":
        from .compiler import compile

        globals()[name] = compile
        return compile
    if name == "generate":
        from .compiler.decoding import generate

        globals()[name] = generate
        return generate
    if name == "onnx":   # the ONNX front end, which needs the onnx package
        import importlib

        return importlib.import_module(".onnx", __name__)
    raise AttributeError(f"module 'ptxforge' has no attribute {name!r}")


__all__ = [*PTXFORGE_NAMES, "compile", "generate"]
