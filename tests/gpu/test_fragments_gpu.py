"""mma.sync m16n8k16 and movmatrix on the GPU give what the simulator gives on the same
registers (tests/support/fragments.py), bit for bit: the simulator's fragment layouts are
the hardware's."""

import numpy as np
import pytest
import torch

from ptxforge import jit
from support import fragments

pytestmark = pytest.mark.gpu


def test_the_gpu_gives_the_simulator_s_bits():
    a_bits, b_bits, c, m = fragments.random_problem(seed=3)
    a, b, cr = fragments.mma_fragments(a_bits, b_bits, c)
    mf = fragments.matrix_fragment(m)
    inputs = {name: torch.from_numpy(array.view(np.int32).copy()).cuda()
              for name, array in zip("abcm", (a, b, cr.view(np.uint32), mf))}
    d = torch.empty(32 * 4, dtype=torch.int32, device="cuda")
    t = torch.empty(32, dtype=torch.int32, device="cuda")
    launcher = jit.build(fragments.fragment_kernel()).launcher(0)
    launcher((1, 1, 1), torch.cuda.current_stream().cuda_stream,
             **{name: x.data_ptr() for name, x in inputs.items()}, d=d.data_ptr(),
             t=t.data_ptr())
    torch.cuda.synchronize()
    sim_d, sim_t = fragments.run_on_simulator(a, b, cr, mf)
    np.testing.assert_array_equal(d.cpu().numpy().view(np.float32).reshape(32, 4), sim_d)
    np.testing.assert_array_equal(t.cpu().numpy().view(np.uint32), sim_t)
