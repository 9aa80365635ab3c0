"""The GEMMs on torch tensors: DeepGEMM's ``fp8_gemm_nt`` (fine-grained FP8 scaling) and
``bf16_gemm_nt``, with ``c`` or a fused ``bias``, ``residual`` or ``alpha``, the MoE grouped
forms (contiguous and masked layouts) of both, the SM budget (``set_num_sms``, a call's
``num_sms=``) and a call's programmatic dependent launch (``pdl=``).

Each op checks its arguments, builds the call's ``GemmProblem`` (kernels/gemm.py: N, K,
dtype, layout, epilogue terms) and hands it to ``_launch``: the problem, M and the SM
budget key the cached plan (the tile from ``kernels.gemm_config``, the same lookup
precompiling makes; the launcher; the grid), and the launch binds the tensor maps, the
layout's and the epilogue's arguments by the kernel's parameter names."""

from __future__ import annotations

import functools
import math

import torch

from .. import jit, kernels
from ..arch import tma_alignment
from ..kernels.gemm import BLOCK_K, CONTIGUOUS_ALIGNMENT, GemmProblem
from .common import (current_stream, device_arch, inspect, pair, programmatic,
                      require_contiguous_rows, require_cuda, require_disjoint, require_pdl,
                      require_shape, row_span, strided_span, traced)
from .layout import (ceil_div, get_mn_major_tma_aligned_tensor, get_tma_aligned_size,
                     is_mn_major_tma_aligned)


_num_sms: int | None = None  # set_num_sms: leave SMs free for other work (DeepGEMM's knob)


def set_num_sms(num_sms: int) -> None:
    """Run the GEMMs' persistent CTAs on at most ``num_sms`` SMs, unless a call says
    otherwise (its ``num_sms=``)."""
    global _num_sms
    _num_sms = _checked_sms(torch.cuda.current_device(), num_sms)


def get_num_sms(device_index: int | None = None) -> int:
    """SMs the GEMM may use on a device (the current one by default)."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    return _num_sms or device_arch(device_index).sm_count


def _checked_sms(device_index: int, num_sms) -> int:
    sm_count = device_arch(device_index).sm_count
    if type(num_sms) is not int or not 1 <= num_sms <= sm_count:
        raise ValueError(f"num_sms must be an int in [1, {sm_count}], got {num_sms!r}")
    return num_sms


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, cfg, programmatic: bool):
    """(launcher, clusters that fit on the device at once or None without clusters, the
    kernel's parameter names); ``programmatic``: a launcher with programmatic dependent
    launch (PDL)."""
    compiled = jit.build(kernels.generate_gemm(cfg))
    launcher = compiled.launcher(device_index, programmatic=programmatic)
    names = frozenset(param.name for param in compiled.params)
    if cfg.multicast == 1:
        return launcher, None, names
    return launcher, compiled.load(device_index).max_active_clusters(compiled.launch), names


# Each call's problem, made once per distinct problem: a cached lookup costs half of what
# the named tuple's constructor does (0.07 against 0.16 us), on every call.
_problem = functools.lru_cache(maxsize=4096)(GemmProblem)


def _check_config(config, problem: GemmProblem) -> None:
    """A ``config=`` given to a GEMM op must be one for this problem (its target is checked
    against the device when the call is planned)."""
    if not isinstance(getattr(config, "problem", None), GemmProblem):
        raise TypeError(f"config must be a GEMM config (kernels.gemm_config, or the "
                        f"generation's make_config), got {type(config).__name__}")
    if config.problem != problem:
        wrong = [field for field in GemmProblem._fields
                 if getattr(config.problem, field) != getattr(problem, field)]
        has = ", ".join(f"{key}={getattr(config.problem, key)!r}" for key in wrong)
        needs = ", ".join(f"{key}={getattr(problem, key)!r}" for key in wrong)
        raise ValueError(f"config does not fit the call: it has {has}, the call needs {needs}")


@functools.lru_cache(maxsize=4096)
def _plan(device_index: int, problem: GemmProblem, m: int, expected_m: int, sms: int, config,
          pdl: bool | None):
    """All a launch needs besides the tensors, worked out once per problem so that a call
    pays one cache lookup: (launcher, grid, the kernel's M arguments by parameter name,
    A's and B's element bytes, D's, the tensor maps' group axis: () or (groups,)). The
    tile is ``config`` where the caller forced one, else ``kernels.gemm_config``'s for M
    rows (M is a run-time argument of the kernel, but the best tile depends on it); the
    masked layout has ``groups`` matrices of ``m`` rows (M_max) and picks its tile for
    ``expected_m`` rows a group. ``pdl``: the call's, None for the process default."""
    arch = device_arch(device_index)
    masked = problem.masked
    if config is None:
        config = kernels.gemm_config(arch, problem, problem.groups * expected_m if masked else m,
                                     sms)
    elif config.target != arch.target:
        raise ValueError(f"config is for {config.target}, but cuda:{device_index} is "
                         f"{arch.target}")
    launcher, resident_clusters, names = _launcher(device_index, config, programmatic(pdl))
    m_tiles = ceil_div(m, config.rows)
    tiles = m_tiles * config.n_tiles * (problem.groups if masked else 1)
    # Persistent: no more CTAs (whole clusters) than run at once; at least one cluster.
    clusters = max(min(tiles, sms * config.ctas_per_sm) // config.multicast, 1)
    if resident_clusters is not None:
        clusters = min(clusters, resident_clusters)
    # M as the kernel takes it: in tiles (the masked kernel counts its own on the GPU), and
    # in rows where a layout or an epilogue reads no row past it.
    rows = {name: value for name, value in (("m_tiles", m_tiles), ("m_rows", m))
            if name in names}
    return (launcher, (clusters * config.multicast, 1, 1), rows, 1 if problem.scaled else 2,
            4 if problem.accumulate else 2, (problem.groups,) if masked else ())


def _scaled_a(a):
    """Check ``a = (A, sa)``: A e4m3 [M, K], sa f32 [M, ceil(K/128)]. Returns (m, k, A's
    row stride, A's pointer, device, the spans of A and sa, sa, sa's pointer or None when sa
    is not in the MN-major TMA-aligned layout the kernel reads: ``_sa_pointer`` then copies
    it, once the device is checked)."""
    A, sa = pair("a", a, "e4m3 [M, K] and f32 [M, ceil(K/128)]")
    (m, k), a_strides, a_ptr, device = inspect("a[0]", A, torch.float8_e4m3fn, 2)
    sa_shape, sa_strides, sa_ptr, _ = inspect("a[1]", sa, torch.float32, 2, align=4,
                                              device=device, rows=False)
    require_shape("a[1]", sa_shape, (m, ceil_div(k, BLOCK_K)))
    spans = (row_span(a_ptr, m, a_strides[0], k, 1),
             strided_span(sa_ptr, sa_shape, sa_strides, 4))
    mn_major = is_mn_major_tma_aligned(sa_shape, sa_strides, sa_ptr)
    return m, k, a_strides[0], a_ptr, device, spans, sa, sa_ptr if mn_major else None


def _sa_pointer(sa, sa_ptr: int | None) -> int:
    """Where the kernel reads ``sa``: at ``sa_ptr``, or (None) in a copy in the MN-major
    TMA-aligned layout, one more kernel on the call's stream."""
    return get_mn_major_tma_aligned_tensor(sa).data_ptr() if sa_ptr is None else sa_ptr


def _launch(device: int, problem: GemmProblem, m: int, a, b, d, arguments: dict, *,
            scales=None, expected_m: int = 0, num_sms=None, config=None, pdl=None) -> None:
    """Plan (cached) and launch; the tensor maps go to the launcher as views (address,
    shape, byte strides), which it encodes with the kernel's own TensorMap specs.

    ``a``, ``d``: (pointer, row stride in elements) of A [M, K] and D [M, N], in the masked
    layout with their group stride after it (and ``m`` is M_max); ``b``: (pointer, row
    stride, rows) of B as one [rows, K] matrix (N, or groups x N rows). ``scales``: e4m3
    operands' (sa pointer, sa's column stride, sa's group stride or None, sb pointer, sb's
    row stride), all in elements. ``expected_m``: the masked layout's rows a group, its
    tile hint. ``pdl``: the call's, checked. ``arguments``: the layout's (m_indices,
    rows_used or masked_m) and the epilogue's (bias; residual and its row stride; alpha)
    by the kernel's parameter names, a dict of the call's own, which the launch's other
    arguments join."""
    sms = get_num_sms(device) if num_sms is None else _checked_sms(device, num_sms)
    launcher, grid, rows, element_bytes, d_bytes, group = _plan(device, problem, m, expected_m,
                                                                sms, config, pdl)
    n, k = problem.n, problem.k
    # Byte strides spelled out: a tuple from a generator costs 0.3 us on every call. The
    # masked layout's group is a third dimension of A, D and sa.
    a_strides = (element_bytes * a[1],) + ((element_bytes * a[2],) if group else ())
    d_strides = (d_bytes * d[1],) + ((d_bytes * d[2],) if group else ())
    arguments["tmap_a"] = (a[0], (k, m) + group, a_strides)
    arguments["tmap_b"] = (b[0], (k, b[2]), (element_bytes * b[1],))
    arguments["tmap_d"] = (d[0], (n, m) + group, d_strides)
    if scales is not None:
        sa_ptr, sa_column, sa_group, sb_ptr, sb_row = scales
        # sa is MN-major: a column of M scales per 128 of K (its stride unused by a
        # one-column sa, but it must be valid).
        arguments["tmap_sa"] = (sa_ptr, (m, ceil_div(k, BLOCK_K)) + group,
                                (4 * sa_column,) + ((4 * sa_group,) if group else ()))
        arguments["sb"], arguments["sb_row_stride"] = sb_ptr, sb_row
    arguments.update(rows)
    launcher(grid, current_stream(device), **arguments)


def _epilogue(c, bias, residual, alpha, m: int, n: int, device: int, d_ptr: int, d_row: int,
              d_span) -> tuple[tuple[str, ...], dict]:
    """A dense GEMM call's epilogue, its arguments checked: its terms (in alphabetical
    order) and their kernel arguments by parameter name. A call with none of them pays one
    function call."""
    terms, arguments = ("accumulate",) if c is not None else (), {}
    if bias is None and residual is None and alpha is None:
        return terms, arguments
    bias_ptr = _bias(bias, c, n, device, d_span)
    residual_rows = _residual(residual, c, m, n, device, d_ptr, d_row, d_span)
    scale = _alpha(alpha, c, bias, residual)
    if bias_ptr is not None:
        terms += ("bias",)
        arguments["bias"] = bias_ptr
    if residual_rows is not None:
        terms += ("residual",)
        arguments["residual"], arguments["residual_row_stride"] = residual_rows
    if scale is not None:
        terms += ("scale",)
        arguments["alpha"] = scale
    return terms, arguments


def _alpha(alpha, c, bias, residual) -> float | None:
    """Check ``alpha`` (None, or a finite real number scaling a bf16 d computed without
    c, bias or residual) and return it as a float."""
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise TypeError(f"alpha must be a finite real number, got {alpha!r}")
    if c is not None or bias is not None or residual is not None:
        given = ", ".join(name for name, value in (("c", c), ("bias", bias),
                                                   ("residual", residual)) if value is not None)
        raise ValueError(f"alpha scales a bf16 d = a @ b.T alone; it cannot be combined with "
                         f"{given}")
    return float(alpha)


def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, *,
                bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                alpha: float | None = None, num_sms: int | None = None, config=None,
                pdl: bool | None = None) -> None:
    """``d = a @ b.T`` (or ``d = c + a @ b.T``, or ``d = a @ b.T + bias + residual``, either
    term optional, or ``d = alpha * (a @ b.T)``) with DeepGEMM's fine-grained FP8 scaling,
    written into ``d``.

    a: ``(A, sa)``, A e4m3 [M, K], sa f32 [M, ceil(K/128)] (one scale per row per 128 of K).
    b: ``(B, sb)``, B e4m3 [N, K], sb f32 [ceil(N/128), ceil(K/128)] (one per 128x128 block).
    d: bf16 [M, N], contiguous; with ``c``, f32 [M, N]. N a multiple of 8 and K of 16
    (16-byte rows).
    c: f32 [M, N] or None. ``c`` may be ``d`` itself (accumulate in place, the fast path);
    another tensor is first copied into ``d`` (one more kernel, on the same stream).
    bias: bf16 [N] or None, added to every row in f32 before d is rounded to bf16 (fused
    into the kernel's epilogue; not with ``c``).
    residual: bf16 [M, N] or None, added in f32 after the bias, before the rounding (fused
    likewise; not with ``c``): a transformer's ``x + o_proj(attn)`` in one kernel. Rows
    with unit column stride and any row stride that keeps them 4-byte aligned. It may be
    ``d`` itself (``residual=d``: d += a @ b.T in place, rounded once); any other residual
    must not overlap d.
    alpha: a float or None: d = alpha * (a @ b.T), multiplied in f32 before the one
    rounding to bf16 (a per-tensor dequantization scale; not with c, bias or residual).

    num_sms: SMs the persistent CTAs may use (by default ``get_num_sms()``), so that
    another kernel can run beside this one on the rest. config: a tile to use instead of
    the model's choice (``kernels.gemm_config`` or the generation's ``make_config``),
    checked against the call.
    pdl: launch with programmatic dependent launch (PDL): the kernel may start while the
    kernel before it on the stream finishes, its launch and set-up overlapping that
    kernel's end; it waits for that kernel before it reads
    an input or writes d. None: the process default, ``PTXFORGE_PDL`` (off unless set).
    The results are the same bits either way.

    Fast path: sa in the MN-major TMA-aligned layout that ``quantize_fp8_per_token``
    writes by default. A row-major sa is converted (one copy) on every call.
    """
    if torch.compiler.is_dynamo_compiling():
        a, b = pair("a", a, "A and its scales"), pair("b", b, "B and its scales")
        return traced("fp8_gemm_nt", *a, *b, d, c, bias=bias, residual=residual, alpha=alpha,
                      num_sms=num_sms, pdl=pdl, config=config)
    m, k, a_row, a_ptr, device, a_spans, sa, sa_ptr = _scaled_a(a)
    B, sb = pair("b", b, "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]")
    (n, kb_), b_strides, b_ptr, _ = inspect("b[0]", B, torch.float8_e4m3fn, 2, device=device)
    if kb_ != k:
        raise ValueError(f"a[0] and b[0] must share K, got a[0] {tuple(a[0].shape)} and b[0] "
                         f"{tuple(B.shape)}")
    k_groups = ceil_div(k, BLOCK_K)  # one scale per 128 of K
    sb_shape, sb_strides, sb_ptr, _ = inspect("b[1]", sb, torch.float32, 2, align=4,
                                              device=device)
    require_shape("b[1]", sb_shape, (ceil_div(n, 128), k_groups))
    d_ptr, d_row, copy_c = _output(d, c, m, n, device, *a_spans,
                                   row_span(b_ptr, n, b_strides[0], k, 1),
                                   row_span(sb_ptr, sb_shape[0], sb_strides[0], k_groups, 4))
    d_span = (d_ptr, d.itemsize * m * n)
    terms, epilogue = _epilogue(c, bias, residual, alpha, m, n, device, d_ptr, d_row, d_span)
    problem = _problem(n, k, "e4m3", "dense", 0, terms)
    if config is not None:
        _check_config(config, problem)
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("a[0]", a[0], device)
    if copy_c:
        d.copy_(c)
    if m == 0:
        return
    _launch(device, problem, m, (a_ptr, a_row), (b_ptr, b_strides[0], n), (d_ptr, d_row),
            epilogue, scales=(_sa_pointer(sa, sa_ptr), get_tma_aligned_size(m, 4), None, sb_ptr,
                              sb_strides[0]),
            num_sms=num_sms, config=config, pdl=pdl)


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                 c: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, alpha: float | None = None,
                 num_sms: int | None = None, config=None, pdl: bool | None = None) -> None:
    """``d = a @ b.T`` (or ``d = c + a @ b.T``, or ``d = a @ b.T + bias + residual``, either
    term optional, or ``d = alpha * (a @ b.T)``) in bf16 with f32 accumulation, written into
    ``d``: the FP8 GEMM's kernel with bf16 operands and no scales.

    a: bf16 [M, K], b: bf16 [N, K] (rows 16-byte aligned), d: bf16 [M, N], contiguous; with
    ``c``, f32 [M, N] (``c`` may be ``d``: accumulate in place; another c is copied first).
    bias, residual, alpha, num_sms, config, pdl: as ``fp8_gemm_nt``'s.
    """
    if torch.compiler.is_dynamo_compiling():
        return traced("bf16_gemm_nt", a, b, d, c, bias=bias, residual=residual, alpha=alpha,
                      num_sms=num_sms, pdl=pdl, config=config)
    (m, k), a_strides, a_ptr, device = inspect("a", a, torch.bfloat16, 2)
    (n, kb_), b_strides, b_ptr, _ = inspect("b", b, torch.bfloat16, 2, device=device)
    if kb_ != k:
        raise ValueError(f"a and b must share K, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    d_ptr, d_row, copy_c = _output(d, c, m, n, device, row_span(a_ptr, m, a_strides[0], k, 2),
                                   row_span(b_ptr, n, b_strides[0], k, 2))
    d_span = (d_ptr, d.itemsize * m * n)
    terms, epilogue = _epilogue(c, bias, residual, alpha, m, n, device, d_ptr, d_row, d_span)
    problem = _problem(n, k, "bf16", "dense", 0, terms)
    if config is not None:
        _check_config(config, problem)
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("a", a, device)
    if copy_c:
        d.copy_(c)
    if m == 0:
        return
    _launch(device, problem, m, (a_ptr, a_strides[0]), (b_ptr, b_strides[0], n),
            (d_ptr, d_row), epilogue, num_sms=num_sms, config=config, pdl=pdl)


def _bias(bias, c, n: int, device: int, d_span) -> int | None:
    """Check ``bias`` (None, or bf16 [N] with unit stride, 4-byte aligned: the epilogue
    reads it in column pairs, not overlapping ``d``) and return its pointer."""
    if bias is None:
        return None
    if c is not None:
        raise ValueError("bias is added to a bf16 d; it cannot be combined with c (f32 "
                         "accumulation): add it to c instead")
    shape, _, ptr, _ = inspect("bias", bias, torch.bfloat16, 1, align=4, device=device)
    require_shape("bias", shape, (n,))
    require_disjoint("d", d_span, (ptr, 2 * n))
    return ptr


def _residual(residual, c, m: int, n: int, device: int, d_ptr: int, d_row: int,
              d_span) -> tuple[int, int] | None:
    """Check ``residual`` (None, or bf16 [M, N] with unit column stride and 4-byte aligned
    rows: the epilogue reads it in column pairs; ``d`` itself, or not overlapping it) and
    return its (pointer, row stride in elements)."""
    if residual is None:
        return None
    if c is not None:
        raise ValueError("residual is added to a bf16 d; it cannot be combined with c (f32 "
                         "accumulation): add it to c instead")
    shape, strides, ptr, _ = inspect("residual", residual, torch.bfloat16, 2, align=4,
                                     device=device)
    require_shape("residual", shape, (m, n))
    # d itself is read in place (each element by the thread that writes it, before it is
    # written: see ResidualBf16Store); any other residual is read while d is written.
    if (ptr, strides[0]) != (d_ptr, d_row):
        require_disjoint("d", d_span, row_span(ptr, m, strides[0], n, 2))
    return ptr, strides[0]


def _output(d, c, m: int, n: int, device: int, *input_spans) -> tuple[int, int, bool]:
    """Check ``d`` (bf16 [M, N], or f32 with ``c``) and ``c`` (f32 [M, N]: d itself, or
    one the caller copies into d); neither may overlap an input. Returns (d's pointer, its
    row stride, whether c must be copied into d)."""
    accumulate = c is not None
    if accumulate and isinstance(d, torch.Tensor) and d.dtype is not torch.float32:
        raise TypeError(f"d must have dtype torch.float32 when accumulating into c, got {d.dtype}")
    d_shape, d_strides, d_ptr, _ = inspect("d", d, torch.float32 if accumulate else torch.bfloat16,
                                           2, device=device)
    require_shape("d", d_shape, (m, n))
    require_contiguous_rows("d", d_shape, d_strides)
    d_span = (d_ptr, d.itemsize * m * n)
    require_disjoint("d", d_span, *input_spans)
    if not accumulate:
        return d_ptr, d_strides[0], False
    c_shape, c_strides, c_ptr, _ = inspect("c", c, torch.float32, 2, device=device)
    require_shape("c", c_shape, (m, n))
    copy_c = (c_ptr, tuple(c_strides)) != (d_ptr, tuple(d_strides))
    if copy_c:
        require_disjoint("d", d_span, row_span(c_ptr, m, c_strides[0], n, 4))
    return d_ptr, d_strides[0], copy_c


def get_mk_alignment_for_contiguous_layout() -> int:
    """The row alignment of each group's segment in the contiguous layout: the tallest tile,
    so that no tile spans two groups."""
    return CONTIGUOUS_ALIGNMENT


def _grouped_b(a_shape, b, k: int, device: int, *, scaled: bool = True):
    """Check a grouped ``b``: ``(B, sb)`` with B e4m3 [G, N, K] and sb f32 [G, ceil(N/128),
    ceil(K/128)], or (``scaled`` False) B bf16 [G, N, K] alone; each group's matrix right
    after the previous one. Returns (G, N, B's row stride, B's pointer, sb's pointer and row
    stride or None, the spans of B and sb)."""
    if scaled:
        B, sb = pair("b", b, "e4m3 [G, N, K] and f32 [G, ceil(N/128), ceil(K/128)]")
    else:
        B, sb = b, None
    name = "b[0]" if scaled else "b"
    (num_groups, n, kb_), b_strides, b_ptr, _ = inspect(
        name, B, torch.float8_e4m3fn if scaled else torch.bfloat16, 3, device=device)
    if kb_ != k:
        raise ValueError(f"a and b must share K, got a {tuple(a_shape)} and {name} "
                         f"{tuple(B.shape)}")
    if num_groups < 1 or b_strides[0] != n * b_strides[1]:
        raise ValueError(f"{name} must hold at least one group, its [N, K] matrices back to "
                         f"back, got shape {tuple(B.shape)} and strides {tuple(b_strides)}")
    b_span = row_span(b_ptr, num_groups * n, b_strides[1], k, B.itemsize)
    if not scaled:
        return num_groups, n, b_strides[1], b_ptr, None, None, (b_span,)
    scale_rows, k_groups = ceil_div(n, 128), ceil_div(k, BLOCK_K)
    sb_shape, sb_strides, sb_ptr, _ = inspect("b[1]", sb, torch.float32, 3, align=4,
                                              device=device)
    require_shape("b[1]", sb_shape, (num_groups, scale_rows, k_groups))
    if sb_strides[0] != scale_rows * sb_strides[1]:
        raise ValueError(f"b[1] must hold its groups' scales back to back, got strides "
                         f"{tuple(sb_strides)}")
    sb_span = row_span(sb_ptr, num_groups * scale_rows, sb_strides[1], k_groups, 4)
    return num_groups, n, b_strides[1], b_ptr, sb_ptr, sb_strides[1], (b_span, sb_span)


def _contiguous(a_name: str, A, device: int, m: int, k: int, a_row, a_ptr, a_spans, grouped_b,
                d, m_indices, sa=None, sa_ptr=None, rows_used=None, **options) -> None:
    """The contiguous layout's m_indices, rows_used and d checks, the device check, then the
    launch (``sa`` and ``sa_ptr`` as ``_scaled_a`` returns them; ``sa`` None: bf16;
    ``options``: num_sms, config and pdl)."""
    num_groups, n, b_row, b_ptr, sb_ptr, sb_row, b_spans = grouped_b
    (mi,), _, mi_ptr, _ = inspect("m_indices", m_indices, torch.int32, 1, align=4, device=device)
    if mi != m:
        raise ValueError(f"m_indices must have one entry per row of a ({m}), got {mi}")
    rows_used_ptr = 0
    if rows_used is not None:
        (used,), _, rows_used_ptr, _ = inspect("rows_used", rows_used, torch.int32, 1, align=4,
                                               device=device)
        if used != 1:
            raise ValueError(f"rows_used must hold one int32, got shape {tuple(rows_used.shape)}")
    d_shape, d_strides, d_ptr, _ = inspect("d", d, torch.bfloat16, 2, device=device)
    require_shape("d", d_shape, (m, n))
    require_contiguous_rows("d", d_shape, d_strides)
    require_disjoint("d", (d_ptr, 2 * m * n), (mi_ptr, 4 * m), (rows_used_ptr, 4), *a_spans,
                     *b_spans)
    problem = _problem(n, k, "bf16" if sa is None else "e4m3", "contiguous", num_groups)
    if options.get("config") is not None:
        _check_config(options["config"], problem)
    if options.get("pdl") is not None:
        require_pdl(options["pdl"])
    require_cuda(a_name, A, device)
    if m == 0:
        return
    scales = None if sa is None else (_sa_pointer(sa, sa_ptr), get_tma_aligned_size(m, 4), None,
                                      sb_ptr, sb_row)
    _launch(device, problem, m, (a_ptr, a_row), (b_ptr, b_row, num_groups * n),
            (d_ptr, d_strides[0]), {"m_indices": mi_ptr, "rows_used": rows_used_ptr},
            scales=scales, **options)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, *,
                                     rows_used: torch.Tensor | None = None,
                                     num_sms: int | None = None, config=None,
                                     pdl: bool | None = None) -> None:
    """MoE, contiguous layout: row i of ``d`` = row i of ``a`` times group ``m_indices[i]``
    of ``b``, transposed, with DeepGEMM's fine-grained FP8 scaling.

    a: ``(A, sa)``, A e4m3 [M, K] (the groups' rows one segment after another), sa f32
    [M, ceil(K/128)]. b: ``(B, sb)``, B e4m3 [G, N, K], sb f32 [G, ceil(N/128), ceil(K/128)],
    both contiguous. d: bf16 [M, N], contiguous. m_indices: int32 [M] on the GPU, each row's
    group; -1 marks padding. Each group's segment starts at a multiple of
    ``get_mk_alignment_for_contiguous_layout()`` rows.

    Rows the GPU finds padding, an index outside [0, G), or a segment not aligned (a
    tile's row whose group differs from its first row's) are written as zeros; nothing is
    read outside B. Nothing is read back to the host: the call can be captured in a graph.
    rows_used: None, or int32 [1] on the GPU: the rows in use (the groups' segments); the
    tiles past them are neither computed nor written, so an ``a`` sized for the worst case
    of a routing known only on the GPU costs only the rows it fills (``moe_routing_layout``
    writes it). num_sms, config, pdl: as ``fp8_gemm_nt``'s.
    """
    if torch.compiler.is_dynamo_compiling():
        a, b = pair("a", a, "A and its scales"), pair("b", b, "B and its scales")
        return traced("m_grouped_fp8_gemm_nt_contiguous", *a, *b, d, m_indices,
                      rows_used=rows_used, num_sms=num_sms, pdl=pdl, config=config)
    m, k, a_row, a_ptr, device, a_spans, sa, sa_ptr = _scaled_a(a)
    _contiguous("a[0]", a[0], device, m, k, a_row, a_ptr, a_spans,
                _grouped_b(a[0].shape, b, k, device), d, m_indices, sa, sa_ptr,
                rows_used=rows_used, num_sms=num_sms, config=config, pdl=pdl)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      m_indices: torch.Tensor, *,
                                      rows_used: torch.Tensor | None = None,
                                      num_sms: int | None = None, config=None,
                                      pdl: bool | None = None) -> None:
    """``m_grouped_fp8_gemm_nt_contiguous`` with bf16 operands and no scales: a bf16
    [M, K], b bf16 [G, N, K], d bf16 [M, N], m_indices int32 [M], rows_used (same
    contract)."""
    if torch.compiler.is_dynamo_compiling():
        return traced("m_grouped_bf16_gemm_nt_contiguous", a, b, d, m_indices,
                      rows_used=rows_used, num_sms=num_sms, pdl=pdl, config=config)
    (m, k), a_strides, a_ptr, device = inspect("a", a, torch.bfloat16, 2)
    _contiguous("a", a, device, m, k, a_strides[0], a_ptr,
                (row_span(a_ptr, m, a_strides[0], k, 2),),
                _grouped_b(a.shape, b, k, device, scaled=False), d, m_indices, rows_used=rows_used,
                num_sms=num_sms, config=config, pdl=pdl)


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor,
                                 expected_m: int, *, num_sms: int | None = None,
                                 config=None, pdl: bool | None = None) -> None:
    """MoE, masked layout (decoding under CUDA graphs): for each group g, the first
    ``masked_m[g]`` rows of ``d[g]`` = those rows of ``a[g]`` times ``b[g]``, transposed,
    with DeepGEMM's fine-grained FP8 scaling.

    a: ``(A, sa)``, A e4m3 [G, M_max, K], sa f32 [G, M_max, ceil(K/128)] (MN-major, as
    ``get_mn_major_tma_aligned_tensor`` makes it; another layout is copied on each call).
    b: ``(B, sb)``, B e4m3 [G, N, K], sb f32 [G, ceil(N/128), ceil(K/128)], both contiguous.
    d: bf16 [G, M_max, N], rows contiguous. masked_m: int32 [G] on the GPU, read there, never
    by the host: a captured graph replays correctly when it changes. expected_m: a host-side
    hint of the rows a group holds, for the tile choice.

    A count above M_max is taken as M_max, a negative one as 0. Rows from masked_m[g] on
    are not meaningful: a tile that starts before masked_m[g] is written whole.
    num_sms, config, pdl: as ``fp8_gemm_nt``'s.
    """
    if torch.compiler.is_dynamo_compiling():
        a, b = pair("a", a, "A and its scales"), pair("b", b, "B and its scales")
        return traced("m_grouped_fp8_gemm_nt_masked", *a, *b, d, masked_m, expected_m,
                      num_sms=num_sms, pdl=pdl, config=config)
    A, sa = pair("a", a, "e4m3 [G, M_max, K] and f32 [G, M_max, ceil(K/128)]")
    (num_groups, m_max, k), a_strides, a_ptr, device = inspect("a[0]", A, torch.float8_e4m3fn, 3)
    sa_shape, sa_strides, sa_ptr, _ = inspect("a[1]", sa, torch.float32, 3, align=4,
                                              device=device, rows=False)
    require_shape("a[1]", sa_shape, (num_groups, m_max, ceil_div(k, BLOCK_K)))
    _masked("a[0]", A, a_strides, a_ptr, device, (sa, sa_shape, sa_strides, sa_ptr),
            _grouped_b(A.shape, b, k, device), d, masked_m, expected_m,
            num_sms=num_sms, config=config, pdl=pdl)


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                  masked_m: torch.Tensor, expected_m: int, *,
                                  num_sms: int | None = None, config=None,
                                  pdl: bool | None = None) -> None:
    """``m_grouped_fp8_gemm_nt_masked`` with bf16 operands and no scales: a bf16
    [G, M_max, K], b bf16 [G, N, K], d bf16 [G, M_max, N] (same contract)."""
    if torch.compiler.is_dynamo_compiling():
        return traced("m_grouped_bf16_gemm_nt_masked", a, b, d, masked_m, expected_m,
                      num_sms=num_sms, pdl=pdl, config=config)
    (_, _, k), a_strides, a_ptr, device = inspect("a", a, torch.bfloat16, 3)
    _masked("a", a, a_strides, a_ptr, device, None,
            _grouped_b(a.shape, b, k, device, scaled=False), d, masked_m, expected_m,
            num_sms=num_sms, config=config, pdl=pdl)


def _masked(a_name: str, A, a_strides, a_ptr, device: int, scaled_a, grouped_b, d, masked_m,
            expected_m, **options) -> None:
    """The masked layout's checks, the device check and the launch: A [G, M_max, K] through
    3-D tensor maps, e4m3 with ``scaled_a`` = (sa, its shape, strides and pointer), or bf16
    with ``scaled_a`` None; ``options``: num_sms, config and pdl."""
    num_groups, m_max, k = A.shape
    b_groups, n, b_row, b_ptr, sb_ptr, sb_row, b_spans = grouped_b
    if b_groups != num_groups:
        raise ValueError(f"a [G, M_max, K] and b [G, N, K] must share G, got a "
                         f"{tuple(A.shape)} and b with {b_groups} groups")
    alignment = tma_alignment()  # of the 3-D tensor maps' group strides
    if a_strides[0] * A.itemsize % alignment:
        raise ValueError(f"a's group stride must be a multiple of {alignment} bytes, got "
                         f"{a_strides[0]} elements")
    (mm,), _, mm_ptr, _ = inspect("masked_m", masked_m, torch.int32, 1, align=4, device=device)
    if mm != num_groups:
        raise ValueError(f"masked_m must have one entry per group ({num_groups}), got {mm}")
    if not isinstance(expected_m, int) or expected_m < 1:
        raise ValueError(f"expected_m must be a positive int, got {expected_m!r}")
    d_shape, d_strides, d_ptr, _ = inspect("d", d, torch.bfloat16, 3, device=device)
    require_shape("d", d_shape, (num_groups, m_max, n))
    if (d_strides[0] * 2) % alignment:
        raise ValueError(f"d's group stride must be a multiple of {alignment} bytes, got "
                         f"{d_strides[0]}")
    spans = [strided_span(a_ptr, A.shape, a_strides, A.itemsize), (mm_ptr, 4 * num_groups), *b_spans]
    if scaled_a is not None:
        sa, sa_shape, sa_strides, sa_ptr = scaled_a
        spans.append(strided_span(sa_ptr, sa_shape, sa_strides, 4))
    require_disjoint("d", strided_span(d_ptr, d_shape, d_strides, 2), *spans)
    problem = _problem(n, k, "bf16" if scaled_a is None else "e4m3", "masked", num_groups)
    if options.get("config") is not None:
        _check_config(options["config"], problem)
    if options.get("pdl") is not None:
        require_pdl(options["pdl"])
    require_cuda(a_name, A, device)
    if m_max == 0:
        return
    scales = None
    if scaled_a is not None:
        # The tensor map reads sa MN-major with TMA-aligned columns and groups; another
        # layout is copied into that one.
        if (sa_strides[1] != 1 or 4 * sa_strides[0] % alignment or 4 * sa_strides[2] % alignment
                or sa_ptr % alignment):
            sa = get_mn_major_tma_aligned_tensor(sa)
            sa_ptr, sa_strides = sa.data_ptr(), sa.stride()
        scales = (sa_ptr, sa_strides[2], sa_strides[0], sb_ptr, sb_row)
    _launch(device, problem, m_max, (a_ptr, a_strides[1], a_strides[0]),
            (b_ptr, b_row, num_groups * n), (d_ptr, d_strides[1], d_strides[0]),
            {"masked_m": mm_ptr}, scales=scales, expected_m=min(expected_m, m_max), **options)
