"""Every public op checks its arguments on the CPU and names what is wrong: the argument,
what it got and what it needs. All of it runs before the op asks for a CUDA device, so a
call on a machine without a GPU reports its real mistake first."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import ptxforge
from ptxforge.public import PUBLIC

E4M3, F32, BF16, I32, I64 = (torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32,
                             torch.int64)


# --------------------------------------------------------------------------- op input checks (CPU tensors)
WEIGHT = torch.ones(128, dtype=torch.bfloat16)

OPS = {  # op name -> (call with the checked tensor, the name its errors use)
    "rms_norm": (lambda x: ptxforge.rms_norm(x, WEIGHT), "x"),
    "quantize_fp8_per_token": (lambda x: ptxforge.quantize_fp8_per_token(x), "x"),
    "quantize_fp8_per_block": (lambda w: ptxforge.quantize_fp8_per_block(w), "w"),
    "rms_norm_quantize_fp8": (lambda x: ptxforge.rms_norm_quantize_fp8(x, WEIGHT), "x"),
    "silu_mul_quantize_fp8": (lambda g: ptxforge.silu_mul_quantize_fp8(g, g), "gate"),
}
ops = pytest.mark.parametrize("op", list(OPS))


@ops
def test_wrong_dtype_names_the_argument_and_the_dtype(op):
    call, name = OPS[op]
    with pytest.raises(TypeError) as info:
        call(torch.zeros(4, 128, dtype=torch.float32))
    assert str(info.value) == f"{name} must have dtype torch.bfloat16, got torch.float32"


@ops
def test_cpu_tensor_needs_cuda(op):
    call, name = OPS[op]
    with pytest.raises(ValueError, match="CUDA") as info:
        call(torch.zeros(4, 128, dtype=torch.bfloat16))
    assert str(info.value).startswith(f"{name} ") and "cpu" in str(info.value)


@pytest.mark.parametrize("op, shape", [
    ("rms_norm", ()),
    ("quantize_fp8_per_token", (2, 4, 128)),
    ("quantize_fp8_per_block", (128,)),
    ("rms_norm_quantize_fp8", (2, 4, 128)),
    ("silu_mul_quantize_fp8", (2, 4, 128)),
])
def test_wrong_ndim_reports_the_shape(op, shape):
    call, name = OPS[op]
    with pytest.raises(ValueError, match="dimensions") as info:
        call(torch.zeros(shape, dtype=torch.bfloat16))
    assert str(info.value).startswith(f"{name} must have ")
    assert f"got shape {shape}" in str(info.value)


@ops
def test_non_tensor(op):
    call, name = OPS[op]
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got list$"):
        call([[1.0] * 128] * 4)


# --------------------------------------------------------------------------- every op, every argument
def zeros(dtype, *shape):
    return torch.zeros(shape, dtype=dtype)


def scaled(*shape):
    """An activation's ``(data, scales)``: e4m3 of ``shape``, one f32 scale per row per 128
    of the last dimension."""
    *lead, k = shape
    return zeros(E4M3, *shape), zeros(F32, *lead, -(-k // 128))


def weight_scaled(*shape):
    """A weight's ``(data, scales)``: e4m3 of ``shape``, one f32 scale per 128x128 block."""
    *lead, n, k = shape
    return zeros(E4M3, *shape), zeros(F32, *lead, -(-n // 128), -(-k // 128))


K, N, G = 128, 128, 2
CASES = {  # case -> (op, well-formed CPU arguments for M rows (each group's M_max when masked))
    "rms_norm": (ptxforge.rms_norm, lambda m: ((zeros(BF16, m, K), zeros(BF16, K)), {})),
    "rms_norm(out=)": (ptxforge.rms_norm, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, K)), {"out": zeros(BF16, m, K)})),
    "quantize_fp8_per_token": (ptxforge.quantize_fp8_per_token,
                               lambda m: ((zeros(BF16, m, K),), {})),
    "quantize_fp8_per_token(out=)": (ptxforge.quantize_fp8_per_token, lambda m: (
        (zeros(BF16, m, K),), {"out": scaled(m, K)})),
    "quantize_fp8_per_block": (ptxforge.quantize_fp8_per_block,
                               lambda m: ((zeros(BF16, m, K),), {})),
    "quantize_fp8_per_block(out=)": (ptxforge.quantize_fp8_per_block, lambda m: (
        (zeros(BF16, m, K),), {"out": weight_scaled(m, K)})),
    "rms_norm_quantize_fp8": (ptxforge.rms_norm_quantize_fp8,
                              lambda m: ((zeros(BF16, m, K), zeros(BF16, K)), {})),
    "rms_norm_quantize_fp8(out=)": (ptxforge.rms_norm_quantize_fp8, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, K)), {"out": scaled(m, K)})),
    "silu_mul_quantize_fp8": (ptxforge.silu_mul_quantize_fp8,
                              lambda m: ((zeros(BF16, m, K), zeros(BF16, m, K)), {})),
    "silu_mul_quantize_fp8(out=)": (ptxforge.silu_mul_quantize_fp8, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, m, K)), {"out": scaled(m, K)})),
    "fp8_gemm_nt": (ptxforge.fp8_gemm_nt, lambda m: (
        (scaled(m, K), weight_scaled(N, K), zeros(BF16, m, N)), {})),
    "fp8_gemm_nt(c=)": (ptxforge.fp8_gemm_nt, lambda m: (
        (scaled(m, K), weight_scaled(N, K), zeros(F32, m, N), zeros(F32, m, N)), {})),
    "fp8_gemm_nt(bias=)": (ptxforge.fp8_gemm_nt, lambda m: (
        (scaled(m, K), weight_scaled(N, K), zeros(BF16, m, N)), {"bias": zeros(BF16, N)})),
    "fp8_gemm_nt(residual=)": (ptxforge.fp8_gemm_nt, lambda m: (
        (scaled(m, K), weight_scaled(N, K), zeros(BF16, m, N)), {"residual": zeros(BF16, m, N)})),
    "bf16_gemm_nt": (ptxforge.bf16_gemm_nt, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, N, K), zeros(BF16, m, N)), {})),
    "bf16_gemm_nt(c=)": (ptxforge.bf16_gemm_nt, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, N, K), zeros(F32, m, N), zeros(F32, m, N)), {})),
    "bf16_gemm_nt(bias=)": (ptxforge.bf16_gemm_nt, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, N, K), zeros(BF16, m, N)), {"bias": zeros(BF16, N)})),
    "bf16_gemm_nt(bias=, residual=)": (ptxforge.bf16_gemm_nt, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, N, K), zeros(BF16, m, N)),
        {"bias": zeros(BF16, N), "residual": zeros(BF16, m, N)})),
    "m_grouped_fp8_gemm_nt_contiguous": (ptxforge.m_grouped_fp8_gemm_nt_contiguous, lambda m: (
        (scaled(m, K), weight_scaled(G, N, K), zeros(BF16, m, N), zeros(I32, m)), {})),
    "m_grouped_bf16_gemm_nt_contiguous": (ptxforge.m_grouped_bf16_gemm_nt_contiguous, lambda m: (
        (zeros(BF16, m, K), zeros(BF16, G, N, K), zeros(BF16, m, N), zeros(I32, m)), {})),
    "m_grouped_fp8_gemm_nt_masked": (ptxforge.m_grouped_fp8_gemm_nt_masked, lambda m: (
        (scaled(G, m, K), weight_scaled(G, N, K), zeros(BF16, G, m, N), zeros(I32, G), 4), {})),
    "m_grouped_bf16_gemm_nt_masked": (ptxforge.m_grouped_bf16_gemm_nt_masked, lambda m: (
        (zeros(BF16, G, m, K), zeros(BF16, G, N, K), zeros(BF16, G, m, N), zeros(I32, G), 4),
        {})),
    "moe_permute_quantize_fp8": (ptxforge.moe_permute_quantize_fp8, lambda m: (
        (zeros(BF16, m, K), zeros(I32, m, 8), [64]), {})),
    "moe_permute_quantize_fp8(out=)": (ptxforge.moe_permute_quantize_fp8, lambda m: (
        (zeros(BF16, m, K), zeros(I32, m, 8), [G, 16]), {"out": scaled(G, 16, K)})),
    "moe_silu_mul_quantize_fp8": (ptxforge.moe_silu_mul_quantize_fp8, lambda m: (
        (zeros(BF16, 64, 2 * K), zeros(I32, m, 8)), {})),
    "moe_silu_mul_quantize_fp8(out=)": (ptxforge.moe_silu_mul_quantize_fp8, lambda m: (
        (zeros(BF16, 64, 2 * K), zeros(I32, m, 8)), {"out": scaled(64, K)})),
    "moe_combine": (ptxforge.moe_combine, lambda m: (
        (zeros(BF16, 16, K), zeros(I32, m, 8), zeros(F32, m, 8)), {})),
    "moe_combine(out=)": (ptxforge.moe_combine, lambda m: (
        (zeros(BF16, 16, K), zeros(I32, m, 8), zeros(F32, m, 8)), {"out": zeros(BF16, m, K)})),
    "attention_with_kvcache": (ptxforge.attention_with_kvcache, lambda m: (
        (zeros(BF16, m, 1, 8, 64), zeros(BF16, m, 32, 2, 64), zeros(BF16, m, 32, 2, 64),
         zeros(I32, m)), {})),
    "moe_routing_layout": (ptxforge.moe_routing_layout, lambda m: ((zeros(I64, m, 8), 8), {})),
    "moe_routing_layout(masked)": (ptxforge.moe_routing_layout, lambda m: (
        (zeros(I64, m, 8), 8), {"layout": "masked", "rows_per_expert": 4})),
}
KERNEL_OPS = {entry.name for entry in PUBLIC if entry.kernels and entry.in_ptxforge}


def test_the_cases_cover_every_public_op_that_launches_a_kernel():
    assert {op.__name__ for op, _ in CASES.values()} == KERNEL_OPS


def arguments(case: str, m: int = 4) -> dict:
    """The case's well-formed arguments by parameter name (an op's errors use these names)."""
    op, make = CASES[case]
    args, kwargs = make(m)
    return dict(inspect.signature(op).bind(*args, **kwargs).arguments)


def call(case: str, args: dict):
    op, _ = CASES[case]
    return op(**args)


def tensor_arguments(case: str) -> list[tuple[str, str, int | None]]:
    """(the name errors use, the parameter, the pair member or None) of each tensor."""
    found = []
    for name, value in arguments(case).items():
        if isinstance(value, torch.Tensor):
            found.append((name, name, None))
        elif isinstance(value, tuple):
            found += [(f"{name}[{i}]", name, i) for i in range(len(value))]
    return found


def replaced(case: str, parameter: str, member: int | None, make) -> dict:
    """The case's arguments with one tensor t replaced by make(t)."""
    args = arguments(case)
    if member is None:
        args[parameter] = make(args[parameter])
    else:
        pair = list(args[parameter])
        pair[member] = make(pair[member])
        args[parameter] = tuple(pair)
    return args


EVERY_TENSOR = [(case, *found) for case in CASES for found in tensor_arguments(case)]
every_tensor = pytest.mark.parametrize("case, name, parameter, member", EVERY_TENSOR)


@every_tensor
def test_every_argument_s_dtype_is_checked_before_the_device(case, name, parameter, member):
    args = arguments(case)
    wanted = (args[parameter] if member is None else args[parameter][member]).dtype
    args = replaced(case, parameter, member, lambda t: zeros(torch.float64, *t.shape))
    with pytest.raises(TypeError) as info:
        call(case, args)
    message = str(info.value)  # d with c adds why: "... torch.float32 when accumulating into c, ..."
    assert message.startswith(f"{name} must have dtype {wanted}")
    assert message.endswith(", got torch.float64")


@every_tensor
def test_every_argument_must_be_a_tensor(case, name, parameter, member):
    with pytest.raises(TypeError, match=f"^{re.escape(name)} must be a torch.Tensor, got list$"):
        call(case, replaced(case, parameter, member, lambda t: [[0.0]]))


@every_tensor
def test_every_argument_s_rank_is_checked_before_the_device(case, name, parameter, member):
    with pytest.raises(ValueError) as info:
        call(case, replaced(case, parameter, member, lambda t: zeros(t.dtype)))
    assert str(info.value).startswith(f"{name} must have ")
    assert str(info.value).endswith(" dimensions, got shape ()")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [4, 0], ids=["rows", "no rows"])
def test_cpu_tensors_need_cuda_and_the_first_argument_is_named(case, m):
    first = tensor_arguments(case)[0][0]
    with pytest.raises(ValueError) as info:
        call(case, arguments(case, m))
    assert str(info.value) == f"{first} must be on a CUDA device, got cpu"


def test_a_pair_may_be_a_list():
    args = arguments("fp8_gemm_nt")
    args["a"], args["b"] = list(args["a"]), list(args["b"])
    with pytest.raises(ValueError, match=r"^a\[0\] must be on a CUDA device, got cpu$"):
        call("fp8_gemm_nt", args)


# --------------------------------------------------------------------------- pdl= (programmatic dependent launch)
def test_every_op_that_launches_a_kernel_takes_pdl():
    for op, _ in CASES.values():
        parameter = inspect.signature(op).parameters.get("pdl")
        assert parameter is not None and parameter.kind is parameter.KEYWORD_ONLY, op.__name__
        assert parameter.default is None, op.__name__


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pdl", ["yes", 1, 0.0, torch.tensor(True)], ids=repr)
def test_a_bad_pdl_is_refused_before_the_device(case, pdl):
    args = arguments(case)
    args["pdl"] = pdl
    with pytest.raises(TypeError) as info:
        call(case, args)
    assert str(info.value) == f"pdl must be True, False or None, got {pdl!r}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pdl", [True, False, None])
def test_pdl_true_false_or_none_passes_the_checks_that_need_no_gpu(case, pdl):
    args = arguments(case)
    args["pdl"] = pdl
    with pytest.raises(ValueError, match=" must be on a CUDA device, got cpu$"):
        call(case, args)


# --------------------------------------------------------------------------- (data, scales) pairs
MOE_ROWS = "e4m3 [R, H] or [E, M_max, H] and f32 scales of the same rows"
HOLDS = {  # (case, parameter) -> what the pair holds, as its error says
    ("quantize_fp8_per_token(out=)", "out"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("rms_norm_quantize_fp8(out=)", "out"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("silu_mul_quantize_fp8(out=)", "out"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("quantize_fp8_per_block(out=)", "out"): "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]",
    ("fp8_gemm_nt", "a"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("fp8_gemm_nt", "b"): "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]",
    ("fp8_gemm_nt(c=)", "a"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("fp8_gemm_nt(c=)", "b"): "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]",
    ("fp8_gemm_nt(bias=)", "a"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("fp8_gemm_nt(bias=)", "b"): "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]",
    ("fp8_gemm_nt(residual=)", "a"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("fp8_gemm_nt(residual=)", "b"): "e4m3 [N, K] and f32 [ceil(N/128), ceil(K/128)]",
    ("m_grouped_fp8_gemm_nt_contiguous", "a"): "e4m3 [M, K] and f32 [M, ceil(K/128)]",
    ("m_grouped_fp8_gemm_nt_contiguous", "b"):
        "e4m3 [G, N, K] and f32 [G, ceil(N/128), ceil(K/128)]",
    ("m_grouped_fp8_gemm_nt_masked", "a"): "e4m3 [G, M_max, K] and f32 [G, M_max, ceil(K/128)]",
    ("m_grouped_fp8_gemm_nt_masked", "b"): "e4m3 [G, N, K] and f32 [G, ceil(N/128), ceil(K/128)]",
    ("moe_permute_quantize_fp8(out=)", "out"): MOE_ROWS,
    ("moe_silu_mul_quantize_fp8(out=)", "out"): MOE_ROWS,
}


def test_every_pair_argument_is_listed():
    pairs = {(case, parameter) for case in CASES for _, parameter, member in tensor_arguments(case)
             if member is not None}
    assert pairs == set(HOLDS)


NOT_A_PAIR = {  # what is given -> (how it is made from the pair, what the error says it got)
    "a bare tensor": (lambda pair: pair[0], "Tensor"),
    "None": (lambda pair: None, "NoneType"),
    "a 3-tuple": (lambda pair: (*pair, pair[1]), "tuple of length 3"),
    "a 1-list": (lambda pair: [pair[0]], "list of length 1"),
}


@pytest.mark.parametrize("case, parameter, given", [
    (case, parameter, given) for case, parameter in HOLDS for given in NOT_A_PAIR
    if not (parameter == "out" and given == "None")])  # out=None asks the op to allocate
def test_a_pair_argument_must_be_a_pair(case, parameter, given):
    make, got = NOT_A_PAIR[given]
    args = arguments(case)
    args[parameter] = make(args[parameter])
    with pytest.raises(TypeError) as info:
        call(case, args)
    assert str(info.value) == (f"{parameter} must be a pair (data, scales): "
                               f"{HOLDS[case, parameter]}, got {got}")


def test_a_bare_two_row_tensor_is_not_taken_for_a_pair():
    """A 2-row A unpacks into two rows; it must be refused as what it is."""
    args = arguments("fp8_gemm_nt", m=2)
    args["a"] = args["a"][0]
    with pytest.raises(TypeError, match=r"^a must be a pair \(data, scales\): .*, got Tensor$"):
        call("fp8_gemm_nt", args)


@pytest.mark.parametrize("case, name, parameter, member", [
    found for found in EVERY_TENSOR if found[3] is not None])
def test_a_pair_member_of_the_wrong_rank_is_named(case, name, parameter, member):
    args = arguments(case)
    wrong = args[parameter][member][0]  # one dimension fewer
    rank = wrong.dim() + 1
    with pytest.raises(ValueError) as info:
        call(case, replaced(case, parameter, member, lambda t: t[0]))
    assert str(info.value) == f"{name} must have {rank} dimensions, got shape {tuple(wrong.shape)}"


# --------------------------------------------------------------------------- what runs before the device check
def with_args(**changes):
    """A change to a case's arguments: each value a function of the arguments."""
    def change(args):
        args.update({name: make(args) for name, make in changes.items()})
    return change


def misaligned(dtype, *shape):
    """A CPU tensor of ``shape`` that starts 2 bytes past a 16-byte boundary."""
    flat = torch.zeros(shape[0] * shape[1] * 2 + 16, dtype=dtype)
    return flat[1:1 + shape[0] * shape[1]].view(*shape)


def overlapping_residual(args):
    """d and a residual one row after it in the same memory."""
    rows, n = args["d"].shape
    flat = torch.zeros((rows + 1) * n, dtype=args["d"].dtype)
    args["d"], args["residual"] = flat[:rows * n].view(rows, n), flat[n:].view(rows, n)


BEFORE_THE_DEVICE = {  # (case, change to its CPU arguments) -> the error instead of the device's
    "K mismatch, fp8": ("fp8_gemm_nt", with_args(b=lambda a: weight_scaled(N, 256)),
                        ValueError, "a[0] and b[0] must share K, got a[0] (4, 128) and b[0] (128, 256)"),
    "K mismatch, bf16": ("bf16_gemm_nt", with_args(b=lambda a: zeros(BF16, N, 256)),
                         ValueError, "a and b must share K, got a (4, 128) and b (128, 256)"),
    "K mismatch, grouped": ("m_grouped_fp8_gemm_nt_contiguous",
                            with_args(b=lambda a: weight_scaled(G, N, 256)), ValueError,
                            "a and b must share K, got a (4, 128) and b[0] (2, 128, 256)"),
    "a's scales' shape": ("fp8_gemm_nt", with_args(a=lambda a: (a["a"][0], zeros(F32, 4, 2))),
                          ValueError, "a[1] must have shape (4, 1), got (4, 2)"),
    "d's shape": ("fp8_gemm_nt", with_args(d=lambda a: zeros(BF16, 4, 64)),
                  ValueError, "d must have shape (4, 128), got (4, 64)"),
    "c's shape": ("fp8_gemm_nt(c=)", with_args(c=lambda a: zeros(F32, 2, 128)),
                  ValueError, "c must have shape (4, 128), got (2, 128)"),
    "bias's length": ("fp8_gemm_nt(bias=)", with_args(bias=lambda a: zeros(BF16, 64)),
                      ValueError, "bias must have shape (128,), got (64,)"),
    "bias with c": ("fp8_gemm_nt(c=)", with_args(bias=lambda a: zeros(BF16, N)),
                    ValueError, "bias is added to a bf16 d; it cannot be combined with c"),
    "bias overlaps d": ("bf16_gemm_nt(bias=)", with_args(bias=lambda a: a["d"][0]),
                        ValueError, "d overlaps an input; outputs must not alias inputs"),
    "d overlaps an input": ("bf16_gemm_nt", with_args(d=lambda a: a["a"]),
                            ValueError, "d overlaps an input; outputs must not alias inputs"),
    "residual's shape": ("fp8_gemm_nt(residual=)", with_args(residual=lambda a: zeros(BF16, 4, 64)),
                         ValueError, "residual must have shape (4, 128), got (4, 64)"),
    "residual with c": ("fp8_gemm_nt(c=)", with_args(residual=lambda a: zeros(BF16, 4, N)),
                        ValueError, "residual is added to a bf16 d; it cannot be combined with c"),
    "residual overlaps d": ("bf16_gemm_nt(bias=, residual=)", overlapping_residual,
                            ValueError, "d overlaps an input; outputs must not alias inputs"),
    "residual's row stride": ("bf16_gemm_nt(bias=, residual=)",
                              with_args(residual=lambda a: zeros(BF16, 4, 129)[:, :128]),
                              ValueError, "residual's row stride must be a multiple of 4 bytes, "
                                          "got 129 elements of 2 bytes"),
    "residual's column stride": ("fp8_gemm_nt(residual=)",
                                 with_args(residual=lambda a: zeros(BF16, 128, 4).t()),
                                 ValueError, "residual must have unit stride in its last "
                                             "dimension, got strides (1, 4)"),
    "residual's alignment": ("fp8_gemm_nt(residual=)",
                             with_args(residual=lambda a: misaligned(BF16, 4, 128)),
                             ValueError, "residual must start at a 4-byte aligned address"),
    "alpha with c": ("fp8_gemm_nt(c=)", with_args(alpha=lambda a: 0.5), ValueError,
                     "alpha scales a bf16 d = a @ b.T alone; it cannot be combined with c"),
    "alpha with bias and residual": ("bf16_gemm_nt(bias=, residual=)",
                                     with_args(alpha=lambda a: 2), ValueError,
                                     "alpha scales a bf16 d = a @ b.T alone; it cannot be "
                                     "combined with bias, residual"),
    "alpha not a number": ("fp8_gemm_nt", with_args(alpha=lambda a: "0.5"), TypeError,
                           "alpha must be a finite real number, got '0.5'"),
    "alpha not finite": ("bf16_gemm_nt", with_args(alpha=lambda a: float("nan")), TypeError,
                         "alpha must be a finite real number, got nan"),
    "alpha a bool": ("bf16_gemm_nt", with_args(alpha=lambda a: True), TypeError,
                     "alpha must be a finite real number, got True"),
    "m_indices' length": ("m_grouped_bf16_gemm_nt_contiguous",
                          with_args(m_indices=lambda a: zeros(I32, 3)),
                          ValueError, "m_indices must have one entry per row of a (4), got 3"),
    "groups differ": ("m_grouped_fp8_gemm_nt_masked",
                      with_args(b=lambda a: weight_scaled(1, N, K)), ValueError,
                      "a [G, M_max, K] and b [G, N, K] must share G, got a (2, 4, 128) and b with "
                      "1 groups"),
    "expected_m": ("m_grouped_bf16_gemm_nt_masked", with_args(expected_m=lambda a: 0),
                   ValueError, "expected_m must be a positive int, got 0"),
    "scale_layout": ("quantize_fp8_per_token", with_args(scale_layout=lambda a: "column"),
                     ValueError, "scale_layout must be one of ('mn_major', 'row_major'), "
                                 "got 'column'"),
    "out's shape": ("quantize_fp8_per_token(out=)",
                    with_args(out=lambda a: (zeros(E4M3, 4, 64), a["out"][1])),
                    ValueError, "out[0] must have shape (4, 128), got (4, 64)"),
    "out overlaps x": ("rms_norm(out=)", with_args(out=lambda a: a["x"]),
                       ValueError, "out overlaps an input; outputs must not alias inputs"),
    "weight's length": ("rms_norm_quantize_fp8", with_args(weight=lambda a: zeros(BF16, 64)),
                        ValueError, "weight must have shape (128,) to match x's last dimension, "
                                    "got (64,)"),
    "w's alignment": ("quantize_fp8_per_block", with_args(w=lambda a: misaligned(BF16, 128, 128)),
                      ValueError, "w must start at a 16-byte aligned address, got "),
    "up's shape": ("silu_mul_quantize_fp8", with_args(up=lambda a: zeros(BF16, 4, 64)),
                   ValueError, "up must have shape (4, 128), got (4, 64)"),
    "up's rows": ("silu_mul_quantize_fp8", with_args(up=lambda a: zeros(BF16, 5, 128)),
                  ValueError, "up must have shape (4, 128), got (5, 128)"),
    "up's alignment": ("silu_mul_quantize_fp8", with_args(up=lambda a: misaligned(BF16, 4, 128)),
                       ValueError, "up must start at a 16-byte aligned address, got "),
    "out overlaps up": ("silu_mul_quantize_fp8(out=)", with_args(
        out=lambda a: (a["up"].view(E4M3).view(-1)[:4 * K].view(4, K), a["out"][1])),
        ValueError, "out[0] overlaps an input; outputs must not alias inputs"),
    "combine weights' shape": ("moe_combine", with_args(weights=lambda a: zeros(F32, 4, 4)),
                               ValueError, "weights must have shape (4, 8), got (4, 4)"),
    "combine weights' dtype": ("moe_combine", with_args(weights=lambda a: zeros(torch.float16, 4, 8)),
                               TypeError, "weights must have dtype torch.float32 or "
                                          "torch.bfloat16, got torch.float16"),
    "combine rows' strides": ("moe_combine", with_args(rows=lambda a: zeros(I32, 8, 4).t()),
                              ValueError, "rows must be contiguous, got strides (1, 4)"),
    "combine hidden size": ("moe_combine", with_args(y=lambda a: zeros(BF16, 16, 136)[:, :100]),
                            ValueError, "hidden size (y.shape[1]) must be a positive multiple "
                                        "of 8, got 100"),
    "combine experts per token": ("moe_combine", with_args(rows=lambda a: zeros(I32, 4, 33),
                                                           weights=lambda a: zeros(F32, 4, 33)),
                                  ValueError, "experts per token (rows.shape[1]) must be from 1 "
                                              "to 32, got 33"),
    "combine out's shape": ("moe_combine(out=)", with_args(out=lambda a: zeros(BF16, 4, 64)),
                            ValueError, "out must have shape (4, 128), got (4, 64)"),
    "combine out's strides": ("moe_combine(out=)",
                              with_args(out=lambda a: zeros(BF16, 4, 256)[:, :K]),
                              ValueError, "out must be contiguous, got strides (256, 1)"),
    "combine out overlaps y": ("moe_combine(out=)", with_args(out=lambda a: a["y"][4:8]),
                               ValueError, "out overlaps an input; outputs must not alias inputs"),
    "combine out overlaps weights": ("moe_combine(out=)", with_args(
        weights=lambda a: a["out"].view(F32).view(-1)[:32].view(4, 8)),
        ValueError, "out overlaps an input; outputs must not alias inputs"),
    "no experts": ("moe_routing_layout", with_args(num_experts=lambda a: 0),
                   ValueError, "num_experts must be an int in [1, 1024], got 0"),
    "too many experts": ("moe_routing_layout", with_args(num_experts=lambda a: 1025),
                         ValueError, "num_experts must be an int in [1, 1024], got 1025"),
    "experts as a bool": ("moe_routing_layout(masked)", with_args(num_experts=lambda a: True),
                          ValueError, "num_experts must be an int in [1, 1024], got True"),
    "routing layout": ("moe_routing_layout", with_args(layout=lambda a: "dense"), ValueError,
                       "layout must be one of ('contiguous', 'masked'), got 'dense'"),
    "rows_per_expert, contiguous": ("moe_routing_layout",
                                    with_args(rows_per_expert=lambda a: 4), ValueError,
                                    "rows_per_expert is the masked layout's, got 4 with "
                                    "layout 'contiguous'"),
    "no rows_per_expert": ("moe_routing_layout(masked)", with_args(rows_per_expert=lambda a: 0),
                           ValueError, "rows_per_expert must be a positive int, got 0"),
    "rows past int32": ("moe_routing_layout(masked)",
                        with_args(rows_per_expert=lambda a: 2**28), ValueError,
                        "rows_per_expert must keep num_experts * rows_per_expert at most "
                        "2147483647 (rows are int32), got 268435456 with 8 experts"),
    "topk_idx transposed": ("moe_routing_layout",
                            with_args(topk_idx=lambda a: zeros(I64, 8, 4).t()), ValueError,
                            "topk_idx must have unit stride in its last dimension, got strides "
                            "(1, 4)"),
    "topk_idx's rows apart": ("moe_routing_layout(masked)",
                              with_args(topk_idx=lambda a: zeros(I64, 4, 16)[:, :8]), ValueError,
                              "topk_idx must be contiguous, got strides (16, 1)"),
}


@pytest.mark.parametrize("residual", ["d", "a"])
def test_a_residual_may_be_d_itself_or_an_input(residual):
    """d itself is read in place (each element before it is written); an input is only read,
    like the residual: both pass the checks that need no GPU."""
    args = arguments("bf16_gemm_nt(bias=, residual=)")
    args["residual"] = args[residual]  # a is bf16 [4, 128]: K = N
    with pytest.raises(ValueError, match=r"^a must be on a CUDA device, got cpu$"):
        call("bf16_gemm_nt(bias=, residual=)", args)


@pytest.mark.parametrize("what", BEFORE_THE_DEVICE)
def test_checks_that_need_no_gpu_run_before_the_device_check(what):
    case, change, error, message = BEFORE_THE_DEVICE[what]
    args = arguments(case)
    change(args)
    with pytest.raises(error) as info:
        call(case, args)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("weights", [F32, BF16])
def test_combine_weights_may_be_f32_or_bf16_and_y_a_masked_layout_s_rows(weights):
    """A masked layout [G, M_max, H] is combined as its G * M_max rows; no tokens is fine."""
    y = zeros(BF16, G, 8, K).view(G * 8, K)
    for tokens in (4, 0):
        with pytest.raises(ValueError, match="^y must be on a CUDA device, got cpu$"):
            ptxforge.moe_combine(y, zeros(I32, tokens, 2), zeros(weights, tokens, 2))


def test_the_halves_of_one_gate_up_tensor_pass_the_checks_that_need_no_gpu():
    """gate and up may be the two halves of the gate/up projection's [M, 2I] output: strided
    rows, up 2I bytes past gate's start."""
    gate_up = zeros(BF16, 4, 2 * K)
    with pytest.raises(ValueError, match="^gate must be on a CUDA device, got cpu$"):
        ptxforge.silu_mul_quantize_fp8(gate_up[:, :K], gate_up[:, K:])


# --------------------------------------------------------------------------- get_mn_major_tma_aligned_tensor
def test_mn_major_layout_names_what_is_wrong():
    with pytest.raises(TypeError, match=r"^scales must have dtype torch.float32, got torch.bfloat16$"):
        ptxforge.get_mn_major_tma_aligned_tensor(zeros(BF16, 4, 2))
    with pytest.raises(TypeError, match="^scales must be a torch.Tensor, got list$"):
        ptxforge.get_mn_major_tma_aligned_tensor([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"^scales must have 2 or 3 dimensions, got shape \(4,\)$"):
        ptxforge.get_mn_major_tma_aligned_tensor(zeros(F32, 4))


@pytest.mark.parametrize("shape", [(5, 3), (2, 5, 3)])
def test_mn_major_layout_works_on_the_cpu(shape):
    """A layout, not a kernel: it needs no GPU."""
    s = torch.arange(torch.Size(shape).numel(), dtype=F32).view(shape)
    out = ptxforge.get_mn_major_tma_aligned_tensor(s)
    assert torch.equal(out, s) and out.stride()[-2] == 1 and out.stride()[-1] == 8


# --------------------------------------------------------------------------- config= (a forced tile)
def forced(case: str, **changes):
    """A GEMM tile for the case's problem (N = K = 128), with ``changes`` to the problem's
    fields."""
    from ptxforge import arch
    from ptxforge.kernels import sm90_gemm as gemm
    from ptxforge.kernels.gemm import GemmProblem

    terms = tuple(term for term, argument in (("accumulate", "c="), ("bias", "bias="),
                                              ("residual", "residual=")) if argument in case)
    layout = ("masked" if "masked" in case else "contiguous") if "grouped" in case else "dense"
    problem = GemmProblem(N, K, "bf16" if "bf16" in case else "e4m3", layout,
                          G if "grouped" in case else 0, terms)
    return gemm.make_config(arch.get("sm_90a"), problem._replace(**changes), 64, 16)


GEMM_CASES = [case for case in CASES if "gemm" in case]


@pytest.mark.parametrize("case", GEMM_CASES)
def test_a_fitting_config_passes_the_checks_that_need_no_gpu(case):
    args = arguments(case)
    args["config"] = forced(case)
    with pytest.raises(ValueError, match=" must be on a CUDA device, got cpu$"):
        call(case, args)


@pytest.mark.parametrize("case", GEMM_CASES)
def test_a_config_for_another_problem_is_refused_before_the_device(case):
    args = arguments(case)
    args["config"] = forced(case, n=256)
    with pytest.raises(ValueError) as info:
        call(case, args)
    assert str(info.value) == "config does not fit the call: it has n=256, the call needs n=128"


@pytest.mark.parametrize("case, changes, given, needed", [
    ("fp8_gemm_nt", {"dtype": "bf16"}, "dtype='bf16'", "dtype='e4m3'"),
    ("fp8_gemm_nt(c=)", {"epilogue": ()}, "epilogue=()", "epilogue=('accumulate',)"),
    ("m_grouped_fp8_gemm_nt_contiguous", {"groups": 4}, "groups=4", "groups=2"),
    ("m_grouped_bf16_gemm_nt_masked", {"layout": "contiguous"}, "layout='contiguous'",
     "layout='masked'"),
    ("bf16_gemm_nt", {"k": 256, "dtype": "e4m3"}, "k=256, dtype='e4m3'", "k=128, dtype='bf16'"),
    ("fp8_gemm_nt(bias=)", {"epilogue": ()}, "epilogue=()", "epilogue=('bias',)"),
    ("fp8_gemm_nt(residual=)", {"epilogue": ()}, "epilogue=()", "epilogue=('residual',)"),
    ("bf16_gemm_nt", {"epilogue": ("residual",)}, "epilogue=('residual',)", "epilogue=()"),
])
def test_a_config_names_every_field_that_does_not_fit(case, changes, given, needed):
    args = arguments(case)
    args["config"] = forced(case, **changes)
    with pytest.raises(ValueError) as info:
        call(case, args)
    assert str(info.value) == f"config does not fit the call: it has {given}, the call needs {needed}"


def test_a_config_must_be_a_gemm_config():
    args = arguments("fp8_gemm_nt")
    args["config"] = {"block_m": 64}
    with pytest.raises(TypeError, match="^config must be a GEMM config .*, got dict$"):
        call("fp8_gemm_nt", args)


# --------------------------------------------------------------------------- the MoE experts
def experts_arguments():
    return {"x": zeros(BF16, 4, 256), "topk_idx": zeros(I64, 4, 2),
            "topk_weights": zeros(F32, 4, 2), "gate_up": weight_scaled(8, 512, 256),
            "down": weight_scaled(8, 256, 256)}


@pytest.mark.parametrize("change, error, message", [
    ({"topk_idx": zeros(I64, 5, 2)}, ValueError,
     "topk_idx must have a row per token of x (4), got shape (5, 2)"),
    ({"topk_idx": zeros(I32, 4, 2)}, TypeError,
     "topk_idx must have dtype torch.int64, got torch.int32"),
    ({"topk_weights": zeros(F32, 4, 3)}, ValueError,
     "topk_weights must have topk_idx's shape (4, 2), got (4, 3)"),
    ({"gate_up": weight_scaled(8, 512, 128)}, ValueError,
     "gate_up[0] must be [E, 2I, H] with H = 256 (x's), got shape (8, 512, 128)"),
    ({"down": weight_scaled(4, 256, 256)}, ValueError,
     "down[0] must be [E, H, I] = (8, 256, 256) (gate_up's E and I, x's H), got shape "
     "(4, 256, 256)"),
    ({"layout": "dense"}, ValueError,
     "layout must be one of ('masked', 'contiguous') or None, got 'dense'"),
])
def test_the_experts_check_their_arguments_against_each_other(change, error, message):
    with pytest.raises(error) as info:
        ptxforge.moe_experts_fp8(**{**experts_arguments(), **change})
    assert str(info.value) == message


def test_the_experts_on_the_cpu_need_cuda():
    with pytest.raises(ValueError, match="^x must be on a CUDA device, got cpu$"):
        ptxforge.moe_experts_fp8(**experts_arguments())
