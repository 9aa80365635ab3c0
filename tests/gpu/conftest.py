import pytest


@pytest.fixture
def force_gemm_config(monkeypatch):
    """``force(cfg)``: every GEMM op call plans with ``cfg`` (a forced tile) until the test
    ends; returns the device's arch description, for make_config."""
    import torch

    from ptxforge.ops import _common
    from ptxforge.ops import gemm as gemm_ops

    def force(cfg):
        monkeypatch.setattr(gemm_ops, "_config", lambda *args: cfg)
        gemm_ops._plan.cache_clear()  # plans hold the config they were made with

    force.arch = _common.device_arch(torch.cuda.current_device())
    yield force
    gemm_ops._plan.cache_clear()  # no forced plan outlives the test
