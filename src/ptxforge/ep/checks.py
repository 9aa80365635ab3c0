"""The argument checks of ``Buffer``'s methods, apart from the buffer: each names the
argument, what it got and what it needs, and every one runs before anything touches the
GPU (``require_cuda`` last, as in the ops), so they run, and are tested, without one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.ep_intranode import combine as combine_kernel
from ..kernels.ep_intranode import dispatch as dispatch_kernel
from ..kernels.ep_intranode import layout as layout_kernel
from ..kernels.ep_intranode.plan import SCALE_GROUP
from ..ops.common import inspect, pair, require_cuda, require_shape


class DispatchInputs(NamedTuple):
    fp8: bool
    tokens: int
    hidden: int
    topk: int               # 0: no top-k travels
    x: int                  # pointers
    scales: int
    scale_strides: tuple    # elements: (token, group)
    topk_idx: int
    topk_weights: int


def _contiguous(name: str, t, dtype, ndim: int, align: int, device: int):
    shape, strides, ptr, index = inspect(name, t, dtype, ndim, align=align, device=device,
                                         rows=False)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(strides)}")
    return shape, ptr, index


def check_device(name: str, t, index: int, device: int) -> None:
    """The last check: ``t`` on the buffer's CUDA device."""
    require_cuda(name, t, index)
    if index != device:
        raise ValueError(f"{name} must be on the buffer's device cuda:{device}, got {t.device}")


def layout_inputs(topk_idx, num_experts, ranks: int, device: int) -> tuple:
    """get_dispatch_layout's arguments: (tokens, k, topk_idx pointer)."""
    (tokens, k), ptr, index = _contiguous("topk_idx", topk_idx, torch.int64, 2, 8, None)
    if type(num_experts) is not int:
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    layout_kernel.check_problem(num_experts, ranks, k)
    if tokens >= 1 << 31:
        raise ValueError(f"topk_idx must have fewer than 2**31 tokens, got {tokens}")
    check_device("topk_idx", topk_idx, index, device)
    return tokens, k, ptr


def dispatch_inputs(x, topk_idx, topk_weights, *, device: int,
                    cached: bool) -> tuple[DispatchInputs, int]:
    """x, topk_idx and topk_weights of a dispatch; returns (the inputs, x's device index).
    x: bf16 [T, H], or (e4m3 [T, H], f32 scales [T, H / 128]) as quantize_fp8_per_token
    writes them (any scale strides); rows contiguous. topk_idx int64 [T, k] and
    topk_weights f32 [T, k], contiguous; both needed unless ``cached`` (then both or
    neither)."""
    if isinstance(x, torch.Tensor):
        fp8, rows, rows_name = False, x, "x"
    else:
        fp8, rows_name = True, "x[0]"
        rows, scales = pair("x", x, "e4m3 [T, H] and f32 scales [T, H / 128]")
    (tokens, hidden), x_ptr, index = _contiguous(
        rows_name, rows, torch.float8_e4m3fn if fp8 else torch.bfloat16, 2, 16, None)
    dispatch_kernel.check_hidden(hidden, fp8)
    scales_ptr, scale_strides = 0, (0, 0)
    if fp8:
        shape, scale_strides, scales_ptr, _ = inspect("x[1]", scales, torch.float32, 2, align=4,
                                                      device=index, rows=False)
        require_shape("x[1]", tuple(shape), (tokens, hidden // SCALE_GROUP))
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights go together: give both or neither, got "
                         f"{'topk_idx' if topk_weights is None else 'topk_weights'} alone")
    if topk_idx is None and not cached:
        raise ValueError("a dispatch without a handle needs topk_idx and topk_weights")
    topk, idx_ptr, weights_ptr = 0, 0, 0
    if topk_idx is not None:
        (t, topk), idx_ptr, _ = _contiguous("topk_idx", topk_idx, torch.int64, 2, 8, index)
        require_shape("topk_idx", (t, topk), (tokens, topk))
        w_shape, weights_ptr, _ = _contiguous("topk_weights", topk_weights, torch.float32, 2, 4,
                                              index)
        require_shape("topk_weights", tuple(w_shape), (tokens, topk))
        dispatch_kernel.check_topk(topk)
    if tokens >= 1 << 31:
        raise ValueError(f"x must have fewer than 2**31 tokens, got {tokens}")
    check_device(rows_name, rows, index, device)
    return DispatchInputs(fp8, tokens, hidden, topk, x_ptr, scales_ptr, tuple(scale_strides),
                          idx_ptr, weights_ptr), index


def routing_inputs(is_token_in_rank, num_tokens_per_expert, num_tokens_per_rank,
                   num_tokens_per_rdma_rank, *, tokens: int, ranks: int, device: int) -> int:
    """get_dispatch_layout's outputs given to a dispatch without a handle; returns E."""
    if num_tokens_per_rdma_rank is not None:
        raise ValueError("num_tokens_per_rdma_rank must be None: ptxforge.ep is intranode only")
    if is_token_in_rank is None or num_tokens_per_expert is None:
        raise ValueError("a dispatch without a handle needs is_token_in_rank and "
                         "num_tokens_per_expert (from get_dispatch_layout)")
    shape, _, _ = _contiguous("is_token_in_rank", is_token_in_rank, torch.bool, 2, 1, device)
    require_shape("is_token_in_rank", tuple(shape), (tokens, ranks))
    (experts,), _, _ = _contiguous("num_tokens_per_expert", num_tokens_per_expert, torch.int32,
                                   1, 4, device)
    if experts % ranks:
        raise ValueError(f"num_tokens_per_expert must have a multiple of the {ranks} ranks' "
                         f"entries, got {experts}")
    if num_tokens_per_rank is not None:
        (n,), _, _ = _contiguous("num_tokens_per_rank", num_tokens_per_rank, torch.int32, 1, 4,
                                 device)
        require_shape("num_tokens_per_rank", (n,), (ranks,))
    return experts


def combine_inputs(x, topk_weights, *, num_recv_tokens: int, device: int) -> tuple:
    """x bf16 [N, H] contiguous, N the dispatch's received tokens, and topk_weights (None,
    or f32 [N, k] contiguous): (hidden, x pointer, k or 0, weights pointer or 0)."""
    (rows, hidden), ptr, index = _contiguous("x", x, torch.bfloat16, 2, 16, None)
    require_shape("x", (rows, hidden), (num_recv_tokens, hidden))
    topk, weights_ptr = 0, 0
    if topk_weights is not None:
        (n, topk), weights_ptr, _ = _contiguous("topk_weights", topk_weights, torch.float32, 2,
                                                4, index)
        require_shape("topk_weights", (n, topk), (num_recv_tokens, topk))
        if topk == 0:
            raise ValueError("topk_weights must have 1 to 32 columns, got 0")
    combine_kernel.check_problem(hidden, topk)
    check_device("x", x, index, device)
    return hidden, ptr, topk, weights_ptr


def require_buffer(nbytes: int, needed: int, what: str) -> None:
    """A buffer of ``nbytes`` (the smallest rank's) must hold ``needed`` for ``what``."""
    if needed > nbytes:
        raise ValueError(f"the buffer's num_nvl_bytes ({nbytes}, the smallest rank's) is too "
                         f"small for {what}: it needs {needed}; create the Buffer with at least "
                         f"that (ptxforge.ep.buffer_size gives it)")


