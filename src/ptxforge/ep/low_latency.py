"""The low-latency (decoding) dispatch and combine's host side, as plain functions the
``Buffer`` calls (DeepEP's ``low_latency_dispatch``, ``low_latency_combine`` and
``get_low_latency_rdma_size_hint``):

    size = buffer_size(max_tokens, hidden, ranks, experts)      # every rank's buffer
    group = Group(rank, ranks, peers, error, timeout_ns, device_index, arch, num_bytes)
    (recv_x, recv_scales), recv_count, handle, hook = dispatch(group, x, topk_idx,
        num_max_dispatch_tokens_per_rank=max_tokens, num_experts=experts)
    ... m_grouped_fp8_gemm_nt_masked((recv_x, recv_scales), ..., masked_m=recv_count) ...
    combined, hook = combine(group, y, topk_idx, topk_weights, handle)

Every size is fixed by ``max_tokens`` and nothing waits for the GPU, so calls can be
captured in a CUDA graph. With ``return_recv_hook``, a call launches its send half only
and returns ``hook``, which launches the receive half (on the then-current stream) when
called; without, one kernel does both (``hook`` None). The layout and protocol are in
``kernels/ep_low_latency/plan.py``: each dispatch must be followed by one combine (or by
nothing) before the next dispatch, on every rank alike.

Outputs, in the masked layout ``m_grouped_fp8_gemm_nt_masked`` reads (L = E / R local
experts, M = R * max_tokens rows each, rows of source rank 0 first, each source's in
token order):

    recv_x       e4m3 [L, M, H]
    recv_scales  f32 [L, M, H / 128], MN-major with TMA-aligned columns (a transposed
                 view of [L, H / 128, M aligned]): the GEMM reads it with no copy
    recv_count   int32 [L]: the rows each local expert received (the GEMM's masked_m)
    handle       what the combine needs: ``src_info`` int32 [L, M, 3] (each row's source
                 rank, token there, and the k position of the expert in its top-k row)
                 and recv_count

Top-k indices outside [0, E) (-1 among them) route nowhere and add nothing to the
combine: checking them would need the GPU's values on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import jit, ops
from ..arch import Arch
from ..kernels.ep_low_latency import combine as combine_kernel
from ..kernels.ep_low_latency import dispatch as dispatch_kernel
from ..kernels.ep_low_latency.plan import MAX_TOPK, LowLatencyPlan, check_problem
from ..ops.common import inspect, require_shape
from ..ops.layout import get_tma_aligned_size
from .checks import check_device


@dataclass(frozen=True)
class Group:
    """What the kernels need of the buffer: this rank and the group's size, ``peers`` (int64
    [ranks] on the device: every rank's buffer, mapped here), ``error`` (the device pointer
    of the mapped host record a timed-out wait writes), the time limit, the device, its
    arch, and the buffer's size in bytes (every rank's at least)."""

    rank: int
    ranks: int
    peers: torch.Tensor
    error: int
    timeout_ns: int
    device_index: int
    arch: Arch
    num_bytes: int


@dataclass(frozen=True)
class Handle:
    """What a low-latency dispatch leaves for its combine."""

    ranks: int
    max_tokens: int
    experts: int
    hidden: int
    topk: int
    tokens: int
    src_info: torch.Tensor    # int32 [L, R * max_tokens, 3]: source rank, token, k position
    recv_count: torch.Tensor  # int32 [L]
    # The top-k weights the dispatch sent with the tokens (f32 [T, k]): the combine then sums
    # a token's pairs on each experts' rank and sends one row a (token, rank) back.
    weights: torch.Tensor | None = None


def buffer_size(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                num_experts: int, num_topk: int = MAX_TOPK) -> int:
    """The bytes each rank's buffer needs for calls of up to these sizes (k up to
    ``num_topk``; DeepEP's ``get_low_latency_rdma_size_hint``, whose arguments come first)."""
    check_problem(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
    return LowLatencyPlan(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                          num_topk).bytes_needed


def check_dispatch(x, topk_idx, *, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                   ranks: int, device: int, topk_weights=None) -> tuple[int, int, int]:
    """A dispatch's arguments, checked before anything touches the GPU; (tokens, hidden,
    k)."""
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("num_experts", num_experts)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    (tokens, hidden), _, _, index = inspect("x", x, torch.bfloat16, 2)
    (idx_tokens, topk), _, _, idx_index = inspect("topk_idx", topk_idx, torch.int64, 2, align=8,
                                                  rows=False)
    check_problem(ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, topk)
    if not x.is_contiguous() or not topk_idx.is_contiguous():
        raise ValueError(f"x and topk_idx must be contiguous, got strides {x.stride()} and "
                         f"{topk_idx.stride()}")
    if idx_tokens != tokens:
        raise ValueError(f"topk_idx must have x's {tokens} tokens, got {idx_tokens}")
    if tokens > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"x must have at most num_max_dispatch_tokens_per_rank "
                         f"({num_max_dispatch_tokens_per_rank}) tokens, got {tokens}")
    if topk_weights is not None:
        shape, _, _, weights_index = inspect("topk_weights", topk_weights, torch.float32, 2,
                                             align=4, rows=False)
        require_shape("topk_weights", shape, (tokens, topk))
        if not topk_weights.is_contiguous():
            raise ValueError(f"topk_weights must be contiguous, got strides "
                             f"{topk_weights.stride()}")
    check_device("x", x, index, device)
    check_device("topk_idx", topk_idx, idx_index, device)
    if topk_weights is not None:
        check_device("topk_weights", topk_weights, weights_index, device)
    return tokens, hidden, topk


def check_combine(x, topk_idx, topk_weights, handle: Handle, *, device: int) -> None:
    """A combine's arguments: x bf16 [L, R * max_tokens, H] (contiguous), the dispatch's
    topk_idx and f32 topk_weights [T, k]."""
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be what the low-latency dispatch returned, got "
                        f"{type(handle).__name__}")
    shape, _, _, index = inspect("x", x, torch.bfloat16, 3)
    require_shape("x", shape, (handle.experts // handle.ranks, handle.ranks * handle.max_tokens,
                               handle.hidden))
    (tokens, topk), _, _, idx_index = inspect("topk_idx", topk_idx, torch.int64, 2, align=8,
                                              rows=False)
    if (tokens, topk) != (handle.tokens, handle.topk):
        raise ValueError(f"topk_idx must have the dispatch's {handle.tokens} tokens and "
                         f"{handle.topk} columns, got shape {(tokens, topk)}")
    shape, _, _, weights_index = inspect("topk_weights", topk_weights, torch.float32, 2,
                                         align=4, rows=False)
    require_shape("topk_weights", shape, (tokens, topk))
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if handle.weights is not None and topk_weights is not handle.weights:
        raise ValueError("topk_weights must be the tensor the dispatch was given (its "
                         "weights already went to the experts' ranks), got another tensor")
    for name, t, at in (("x", x, index), ("topk_idx", topk_idx, idx_index),
                        ("topk_weights", topk_weights, weights_index)):
        check_device(name, t, at, device)


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, cfg):
    """The kernel's launcher and its parameters' names."""
    generate = {dispatch_kernel.DispatchConfig: dispatch_kernel.generate,
                combine_kernel.CombineConfig: combine_kernel.generate}[type(cfg)]
    compiled = jit.build(generate(cfg))
    return compiled.launcher(device_index), tuple(p.name for p in compiled.params)


def prepare(group: Group, max_tokens: int, hidden: int, experts: int, topk: int, *,
            summed: bool = False) -> None:
    """Build and load the one-launch dispatch and combine for these sizes now (the combine
    that sums on the experts' ranks where the dispatch sends weights): a rank assembling
    its kernel while its peer's already waits would eat into the peer's time limit. (The
    hooks' halves are built at their first use.)"""
    args = (group.arch, group.ranks, max_tokens, hidden, experts, topk)
    _launcher(group.device_index, dispatch_kernel.choose_config(*args))
    _launcher(group.device_index, combine_kernel.choose_config(*args, summed=summed))


def _require_buffer(group: Group, plan: LowLatencyPlan) -> None:
    if group.num_bytes < plan.bytes_needed:
        raise ValueError(f"the buffer must hold {plan.bytes_needed} bytes for these sizes "
                         f"(ptxforge.ep.low_latency.buffer_size), got {group.num_bytes}")


def _common(group: Group) -> dict:
    return dict(rank=group.rank, peers=group.peers.data_ptr(), error=group.error,
                timeout_ns=group.timeout_ns)


def _run(group: Group, make_config, return_recv_hook: bool, grid, arguments: dict):
    """Launch both halves now, or the send half now and return the hook that launches the
    receive half; each launch takes the arguments its kernel declares."""
    def launch(phase):
        cfg = make_config(phase)
        launcher, names = _launcher(group.device_index, cfg)
        stream = torch.cuda.current_stream(group.device_index).cuda_stream
        launcher((grid(cfg), 1, 1), stream, **{name: arguments[name] for name in names})

    if not return_recv_hook:
        launch("both")
        return None
    launch("send")
    return lambda: launch("receive")


def dispatch(group: Group, x: torch.Tensor, topk_idx: torch.Tensor, *,
             num_max_dispatch_tokens_per_rank: int, num_experts: int,
             return_recv_hook: bool = False):
    """Send each token, quantized to e4m3 with 1 x 128 scales, to the ranks of its experts.
    Returns ``((recv_x, recv_scales), recv_count, handle, hook)`` (the module's docstring
    says what each holds)."""
    sizes = check_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        num_experts=num_experts, ranks=group.ranks, device=group.device_index)
    return launch_dispatch(group, x, topk_idx, sizes,
                           max_tokens=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
                           return_recv_hook=return_recv_hook)


def launch_dispatch(group: Group, x: torch.Tensor, topk_idx: torch.Tensor, sizes: tuple, *,
                    max_tokens: int, num_experts: int, return_recv_hook: bool,
                    topk_weights: torch.Tensor | None = None):
    """``dispatch`` after ``check_dispatch`` gave ``sizes`` (tokens, hidden, k)."""
    tokens, hidden, topk = sizes
    plan = LowLatencyPlan(group.ranks, max_tokens, hidden, num_experts, topk)
    _require_buffer(group, plan)
    local, rows, groups = plan.local_experts, group.ranks * max_tokens, plan.scale_groups
    device = x.device
    aligned = get_tma_aligned_size(rows, 4)
    recv_x = torch.empty((local, rows, hidden), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((local, groups, aligned), dtype=torch.float32, device=device)
    recv_scales = scales[:, :, :rows].transpose(1, 2)
    src_info = torch.empty((local, rows, 3), dtype=torch.int32, device=device)
    recv_count = torch.empty(local, dtype=torch.int32, device=device)
    # Each token quantized once (the row kernel), not once for each expert it goes to.
    q, q_scales = ops.quantize_fp8_per_token(x, "row_major")
    arguments = dict(x=q.data_ptr(), x_scales=q_scales.data_ptr(), topk_idx=topk_idx.data_ptr(),
                     topk_weights=0 if topk_weights is None else topk_weights.data_ptr(),
                     tokens=tokens,
                     recv_x=recv_x.data_ptr(), recv_scales=scales.data_ptr(),
                     scale_expert_stride=groups * aligned, scale_group_stride=aligned,
                     recv_src_info=src_info.data_ptr(), recv_count=recv_count.data_ptr(),
                     **_common(group))
    hook = _run(group, lambda phase: dispatch_kernel.choose_config(
        group.arch, group.ranks, max_tokens, hidden, num_experts, topk, phase=phase),
        return_recv_hook, lambda cfg: cfg.grid, arguments)
    handle = Handle(group.ranks, max_tokens, num_experts, hidden, topk, tokens, src_info,
                    recv_count, topk_weights)
    return (recv_x, recv_scales), recv_count, handle, hook


def combine(group: Group, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: Handle, *, return_recv_hook: bool = False):
    """Send each row of the experts' outputs ``x`` (bf16 [L, R * max_tokens, H], the
    dispatch's layout) back to its token's rank and sum there: returns ``(combined bf16
    [T, H], hook)``, combined[t] the f32 sum in k order of topk_weights[t, j] times the
    row of expert topk_idx[t, j] (pairs outside [0, E) skipped), rounded to bf16 once;
    after a dispatch given the weights, each experts' rank's part so summed and rounded to
    bf16, then the parts summed in rank order in f32 and rounded once; the same bits run
    to run."""
    check_combine(x, topk_idx, topk_weights, handle, device=group.device_index)
    plan = LowLatencyPlan(handle.ranks, handle.max_tokens, handle.hidden, handle.experts,
                          handle.topk)
    _require_buffer(group, plan)
    out = torch.empty((handle.tokens, handle.hidden), dtype=torch.bfloat16, device=x.device)
    arguments = dict(x=x.data_ptr(), src_info=handle.src_info.data_ptr(),
                     recv_count=handle.recv_count.data_ptr(), topk_idx=topk_idx.data_ptr(),
                     topk_weights=topk_weights.data_ptr(), tokens=handle.tokens,
                     out=out.data_ptr(), **_common(group))
    hook = _run(group, lambda phase: combine_kernel.choose_config(
        group.arch, handle.ranks, handle.max_tokens, handle.hidden, handle.experts,
        handle.topk, phase=phase, summed=handle.weights is not None), return_recv_hook,
        lambda cfg: cfg.grid(handle.tokens), arguments)
    return out, hook
