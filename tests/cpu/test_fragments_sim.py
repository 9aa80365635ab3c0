"""The simulator's mma.sync m16n8k16 and movmatrix against numpy: D = A @ B + C and the
transposed matrix, through the PTX ISA's fragment layouts (tests/support/fragments.py;
tests/gpu/test_fragments_gpu.py runs the same kernel on the GPU)."""

import numpy as np

from support import fragments


def test_mma_and_movmatrix_match_numpy():
    a_bits, b_bits, c, m = fragments.random_problem()
    a, b, cr = fragments.mma_fragments(a_bits, b_bits, c)
    d, t = fragments.run_on_simulator(a, b, cr, fragments.matrix_fragment(m))
    expected = (fragments.bf16_values(a_bits).astype(np.float64)
                @ fragments.bf16_values(b_bits).astype(np.float64) + c)
    np.testing.assert_array_equal(fragments.mma_result(d), expected.astype(np.float32))
    np.testing.assert_array_equal(t, fragments.matrix_fragment(m.T.copy()))
