"""The FP8 GEMM with fine-grained scaling, on torch tensors (DeepGEMM's ``fp8_gemm_nt``)."""

from __future__ import annotations

import functools

import torch

from .. import jit
from ..jit.tensormap import encode_tiled
from ..kernels import sm90_fp8_gemm_1d2d as gemm_kernel
from ._common import (current_stream, device_arch, inspect, require_contiguous_rows,
                      require_disjoint, require_shape, row_span)
from .layout import (ceil_div, get_mn_major_tma_aligned_tensor, get_tma_aligned_size,
                     is_mn_major_tma_aligned)


_num_sms: int | None = None  # set_num_sms: leave SMs free for other work (DeepGEMM's knob)


def set_num_sms(num_sms: int) -> None:
    """Run the GEMM's persistent CTAs on at most ``num_sms`` SMs."""
    global _num_sms
    sm_count = device_arch(torch.cuda.current_device()).sm_count
    if not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be in [1, {sm_count}], got {num_sms}")
    _num_sms = num_sms


def get_num_sms(device_index: int | None = None) -> int:
    """SMs the GEMM may use on a device (the current one by default)."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    return _num_sms or device_arch(device_index).sm_count


def _config(device_index: int, m: int, n: int, k: int, sms: int, accumulate: bool):
    """The tile shape for one problem (M is a run-time argument of the kernel, but the
    best tile depends on it); _plan keeps the result."""
    return gemm_kernel.choose_config(device_arch(device_index), m, n, k, sms, accumulate)


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, cfg):
    """(launcher, clusters that fit on the device at once)."""
    module = jit.build(gemm_kernel.generate(cfg)).load(device_index)
    launcher = module.launcher(cfg.threads, cfg.dynamic_shared_bytes, cluster=cfg.multicast)
    if cfg.multicast == 1:
        return launcher, None
    return launcher, module.max_active_clusters(cfg.threads, cfg.dynamic_shared_bytes, cfg.multicast)


@functools.lru_cache(maxsize=4096)
def _plan(device_index: int, m: int, n: int, k: int, sms: int, accumulate: bool):
    """(config, launcher, grid, m_tiles): all a launch needs besides the tensors, worked
    out once per problem so a call pays one cache lookup."""
    cfg = _config(device_index, m, n, k, sms, accumulate)
    launcher, resident_clusters = _launcher(device_index, cfg)
    m_tiles = ceil_div(m, cfg.block_m)
    # Persistent: no more CTAs (whole clusters) than run at once.
    clusters = min(m_tiles * cfg.n_tiles, sms * cfg.ctas_per_sm) // cfg.multicast
    if resident_clusters is not None:
        clusters = min(clusters, resident_clusters)
    return cfg, launcher, clusters * cfg.multicast, m_tiles


def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """``d = a @ b.T`` (or ``d = c + a @ b.T``) with DeepGEMM's fine-grained FP8 scaling,
    written into ``d``.

    a: ``(A, sa)``, A e4m3 [M, K], sa f32 [M, ceil(K/128)] (one scale per row per 128 of K).
    b: ``(B, sb)``, B e4m3 [N, K], sb f32 [ceil(N/128), ceil(K/128)] (one per 128x128 block).
    d: bf16 [M, N], contiguous; with ``c``, f32 [M, N]. N a multiple of 8 and K of 16
    (16-byte rows).
    c: f32 [M, N] or None. ``c`` may be ``d`` itself (accumulate in place, the fast path);
    another tensor is first copied into ``d`` (one more kernel, on the same stream).

    Fast path: sa in the MN-major TMA-aligned layout that ``quantize_fp8_per_token``
    writes by default. A row-major sa is converted (one copy) on every call.
    """
    A, sa = a
    B, sb = b
    (m, k), a_strides, a_ptr, device = inspect("a[0]", A, torch.float8_e4m3fn, 2)
    (n, kb_), b_strides, b_ptr, _ = inspect("b[0]", B, torch.float8_e4m3fn, 2, device=device)
    if kb_ != k:
        raise ValueError(f"a[0] and b[0] must share K, got a[0] {tuple(A.shape)} and b[0] "
                         f"{tuple(B.shape)}")
    groups = ceil_div(k, gemm_kernel.BLOCK_K)  # one scale per 128 of K
    sa_shape, _, _, _ = inspect("a[1]", sa, torch.float32, 2, align=4, device=device, rows=False)
    require_shape("a[1]", sa_shape, (m, groups))
    if not is_mn_major_tma_aligned(sa):
        sa = get_mn_major_tma_aligned_tensor(sa)
    # The column stride TMA reads sa with; for a one-column sa it is never used but must be valid.
    sa_ptr, sa_column = sa.data_ptr(), get_tma_aligned_size(m, 4)
    sb_shape, sb_strides, sb_ptr, _ = inspect("b[1]", sb, torch.float32, 2, align=4,
                                              device=device)
    require_shape("b[1]", sb_shape, (ceil_div(n, 128), groups))
    accumulate = c is not None
    d_dtype = torch.float32 if accumulate else torch.bfloat16
    if accumulate and d.dtype is not torch.float32:
        raise TypeError(f"d must have dtype torch.float32 when accumulating into c, got {d.dtype}")
    d_shape, d_strides, d_ptr, _ = inspect("d", d, d_dtype, 2, device=device)
    require_shape("d", d_shape, (m, n))
    require_contiguous_rows("d", d_shape, d_strides)
    d_span = (d_ptr, d.itemsize * m * n)
    require_disjoint("d", d_span, row_span(a_ptr, m, a_strides[0], k, 1),
                     row_span(b_ptr, n, b_strides[0], k, 1),
                     row_span(sa_ptr, groups, sa_column, m, 4),
                     row_span(sb_ptr, sb_shape[0], sb_strides[0], groups, 4))
    if accumulate:
        c_shape, c_strides, c_ptr, _ = inspect("c", c, torch.float32, 2, device=device)
        require_shape("c", c_shape, (m, n))
        if (c_ptr, tuple(c_strides)) != (d_ptr, tuple(d_strides)):
            require_disjoint("d", d_span, row_span(c_ptr, m, c_strides[0], n, 4))
            d.copy_(c)
    if m == 0:
        return
    cfg, launcher, grid, m_tiles = _plan(device, m, n, k, get_num_sms(device), accumulate)
    tmap_a = encode_tiled(a_ptr, "float8_e4m3fn", (k, m), (a_strides[0],),
                          (gemm_kernel.BLOCK_K, cfg.a_box_rows), swizzle=128)
    tmap_b = encode_tiled(b_ptr, "float8_e4m3fn", (k, n), (b_strides[0],),
                          (gemm_kernel.BLOCK_K, cfg.block_n), swizzle=128)
    tmap_sa = encode_tiled(sa_ptr, "float32", (m, groups), (4 * sa_column,), (cfg.block_m, 1))
    tmap_d = encode_tiled(d_ptr, "float32" if accumulate else "bfloat16", (n, m),
                          (d.itemsize * d_strides[0],), (cfg.d_box_cols, 64),
                          swizzle=cfg.d_swizzle)
    launcher((grid, 1, 1), current_stream(device),
             (tmap_a, tmap_b, tmap_sa, tmap_d, sb_ptr, m_tiles, sb_strides[0]))
