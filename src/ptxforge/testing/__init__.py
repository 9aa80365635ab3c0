"""What checks and measures the kernels, apart from what ships them: the torch recipes the
kernels must match (``reference``), correctness checks against them (``checks``, which the
GPU tests and ``ptxforge demo`` run), and the benchmark suites with their shape tables and
operand builders (``bench``, behind ``ptxforge bench`` and the scripts in bench/)."""
