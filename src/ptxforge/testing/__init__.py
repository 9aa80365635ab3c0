"""What the kernels are held to: the torch recipes they must match (``reference``: the
FP8 quantizers, RMSNorm, SwiGLU, dequantization, the MoE routing layout and combine), and
correctness checks of the shipped ops against them on a GPU (``checks``, which the GPU
tests and ``ptxforge demo`` run, and whose operand builders and ``calc_diff`` the
benchmark suites, ``ptxforge.bench``, use). The tests' own helpers live in tests/support."""
