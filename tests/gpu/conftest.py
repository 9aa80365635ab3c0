import pytest


@pytest.fixture
def gpu_arch():
    """The description of the GPU the tests run on, for make_config (a forced tile)."""
    import torch

    from ptxforge.ops import common

    return common.device_arch(torch.cuda.current_device())
