import contextlib

import pytest


@pytest.fixture
def force_gemm_config():
    """``force(cfg)``: every GEMM op call plans with ``cfg`` (a forced tile) until the next
    force or the end of the test; ``force.arch`` is the device's description, for
    make_config."""
    import torch

    from ptxforge.bench import forced_gemm_config
    from ptxforge.ops import _common

    with contextlib.ExitStack() as stack:
        def force(cfg):
            stack.enter_context(forced_gemm_config(cfg))

        force.arch = _common.device_arch(torch.cuda.current_device())
        yield force
