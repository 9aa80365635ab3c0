"""The backend's passes over Dynamo's FX graph (torch-level: ``torch._C._nn.linear``,
``operator.mul``, ``x.pow(2)`` as the model wrote them, parameters as placeholders).

    moe           a transformers experts module (grouped_mm) -> ptxforge.moe_experts_fp8
                  (``moe.py``: permutation, grouped FP8 GEMMs, combine); compiled with
                  ep_group, moe_experts_fp8_ep on this rank's experts (expert_parallel.py)
    upcast        F.linear(x.float(), w.float()) of bf16 x and w -> ptxforge.bf16_linear_f32
                  (the bf16 GEMM accumulating into f32: the same exact products)
    linears       Linear -> ptxforge.fp8_linear / bf16_linear, the weight (quantized, 128x128
                  blocks) a constant of the graph; Linears reading the same x with bias-free
                  weights become one GEMM over their concatenated weights (q/k/v, gate/up),
                  each reading its columns of the output
    producers     (FP8) the Linear's x made by an RMSNorm -> ptxforge.rms_norm_fp8
                  writes the Linear's FP8 input (once for all the Linears it feeds); made by
                  silu(g) * u -> ptxforge.silu_mul_fp8 (the fused row kernels)
    residual      r + Linear(...) -> the GEMM adds r in its epilogue
    attention     SDPA with transformers' causal mask (built from the sequence length alone)
                  -> SDPA with is_causal=True: the same result, half the work and no mask
    kv            keys and values repeated for grouped-query attention (expand + reshape)
                  -> SDPA's enable_gqa=True on the unrepeated ones (no copies), without
                  a mask or with a short one's (a decode step's over a static cache)
    decode        SDPA of one query token a sequence over a KV cache, under a mask that
                  admits a prefix of it computed from the cache's length alone (a decode
                  step's over transformers' static cache) -> ptxforge.attention_with_kvcache
                  on the mask's counts

Each pass reads a node's value from its ``example_value`` (the fake tensor Dynamo traced),
and each node it makes gets one, computed by the operator's fake, so the passes after it
read the graph the same way. What a pass does, or why it leaves a match alone, is one
``Replacement`` in the plan. The graph, ``kind`` and ``Replacement`` are ``rewriting.py``'s,
which the MoE pass builds on too; ``rewrite`` (the end of this file) runs the passes in
order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import bf16_row_rmsnorm_fp8quant as row_kernel
from ..kernels.gemm import GemmProblem
from .moe import rewrite_moe_experts
from .rewriting import PTXFORGE, Graph, Replacement, ancestors, gpu_arch, kind, traced_size


# --- Linear ---------------------------------------------------------------------------------

@dataclass
class Linear:
    """A Linear of the graph the GEMM can take: its node, x, the weight and the bias node."""
    node: torch.fx.Node
    x: torch.fx.Node
    weight: torch.Tensor
    bias: torch.fx.Node | None


def why_not_gemm(weight: torch.Tensor, arch_of) -> str | None:
    """Why the GEMM cannot take ``weight`` [N, K] where it is (``gpu_arch``, or N and K), or
    None."""
    arch, why = gpu_arch(weight, arch_of)
    if why is not None:
        return why
    try:
        kernels.gemm_generation(arch).require_problem(arch, GemmProblem(*weight.shape))
    except ValueError as error:
        return str(error)
    return None


def why_not_linear(g: Graph, node, arch_of) -> tuple[Linear | None, str | None]:
    """The Linear ``node`` as the GEMM would take it, or why it cannot (its weight is not a
    bf16 [N, K] parameter on a GPU whose GEMM takes N and K, x not bf16 there, or a bias
    that is not a parameter)."""
    x, w, bias = (list(node.args) + [node.kwargs.get("bias")])[:3]
    weight, x_value = g.tensor(w), g.value(x)
    if weight is None:
        return None, "the weight is not a parameter of the model"
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None, f"the weight is {weight.dtype} {tuple(weight.shape)}, not a bf16 matrix"
    why = why_not_gemm(weight, arch_of)
    if why is not None:
        return None, why
    if x_value is None or x_value.dtype != torch.bfloat16 or x_value.device != weight.device:
        return None, (f"x is {getattr(x_value, 'dtype', None)} on "
                      f"{getattr(x_value, 'device', None)}, not bf16 there")
    if bias is not None and g.tensor(bias) is None:
        return None, "the bias is not a parameter of the model"
    return Linear(node, x, weight, bias), None


def rewrite_linears(g: Graph, *, fp8: bool, arch_of) -> tuple[list, list[Replacement]]:
    """Put ptxforge's Linear operators in place of every Linear the GEMM takes. Returns the
    operator nodes (made here, and the model's own FP8 Linears, ``modules.Fp8Linear``),
    each with its x as the first argument, and the plan."""
    plan, taken, made = [], [], []   # plan: (position, Replacement), in graph order at the end
    for position, node in enumerate(g.graph.nodes):
        if node.target in (PTXFORGE.fp8_linear, PTXFORGE.fp8_linear.default):
            _as_made(node)
            made.append(node)   # FP8 weights the model holds: taken as they are
            plan.append((position, Replacement(
                "fp8 linear of the model", node.name, _operator_name(node),
                "its FP8 weights as the model holds them, not quantized again")))
            continue
        if kind(node) != "linear":
            continue
        linear, why = why_not_linear(g, node, arch_of)
        why = g.kept.get(node, why)
        if why is not None:
            plan.append((position, Replacement("linear", node.name, None, why)))
        else:
            taken.append((position, linear))
    for group in _parallel_groups(taken, fp8):
        position = group[0][0]
        group = [linear for _, linear in group]
        made.append(_rewrite(g, group, fp8))
        names = ", ".join(linear.node.name for linear in group)
        shapes = " + ".join(f"[{l.weight.shape[0]}, {l.weight.shape[1]}]" for l in group)
        weights = "fp8 128x128 blocks" if fp8 else "bf16"
        rewrite = "linear" if len(group) == 1 else f"{len(group)} linears of one x"
        plan.append((position, Replacement(rewrite, names, _operator_name(made[-1]),
                                           f"{shapes} weight, {weights}")))
    return made, [item for _, item in sorted(plan, key=lambda pair: pair[0])]


def _upcast(g: Graph, node):
    """The bf16 value ``node`` casts to f32 (``x.float()``, ``x.to(torch.float32)``,
    ``x.type(torch.float32)``), or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or \
            node.target not in ("float", "to", "type"):
        return None
    target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target != "float" and target is not torch.float32:
        return None
    source = node.args[0]
    value = g.value(source)
    return source if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else None


def rewrite_upcast_linears(g: Graph, arch_of) -> list[Replacement]:
    """``F.linear(x.float(), w.float())`` of a bf16 x and a bf16 weight parameter (a MoE
    router's scores, as DeepSeek-V3 computes them): products of bf16 values are exact in
    f32, so the bf16 GEMM accumulating into f32 computes the same sums as the f32 GEMM
    (in another order), on the tensor cores instead of FFMA (DeepSeek-V3's router at 4096
    tokens: 314 us -> 29.5 us, H200)."""
    plan = []
    for node in list(g.graph.nodes):
        if kind(node) != "linear" or len(node.args) < 2 or node.kwargs.get("bias") is not None \
                or (len(node.args) > 2 and node.args[2] is not None):
            continue
        x, w = _upcast(g, node.args[0]), _upcast(g, node.args[1])
        weight = g.tensor(w) if w is not None else None
        if x is None or weight is None or weight.dim() != 2:
            continue
        why = why_not_gemm(weight, arch_of)
        if why is not None:
            plan.append(Replacement("f32 linear of bf16 values", node.name, None, why))
            continue
        with g.graph.inserting_before(node):
            out = g.call(PTXFORGE.bf16_linear_f32.default, (x, w))
        node.replace_all_uses_with(out)
        g.graph.erase_node(node)
        plan.append(Replacement("f32 linear of bf16 values", node.name, "ptxforge.bf16_linear_f32",
                                f"[{weight.shape[0]}, {weight.shape[1]}] weight, bf16 products "
                                f"accumulated in f32"))
    return plan


def _as_made(node) -> None:
    """A ptxforge.fp8_linear call the model made itself (``modules.Fp8Linear``), in the
    form the passes make theirs: the overload, (x, x_scales, wq, ws) and bias by keyword."""
    schema = PTXFORGE.fp8_linear.default._schema
    bound = dict(zip((a.name for a in schema.arguments), node.args))
    bound.update(node.kwargs)
    node.target = PTXFORGE.fp8_linear.default
    node.args = tuple(bound.get(name) for name in ("x", "x_scales", "wq", "ws"))
    node.kwargs = {name: bound[name] for name in ("bias", "residual") if name in bound}


def _parallel_groups(linears: list, fp8: bool) -> list[list]:
    """(position, Linear) pairs grouped: Linears reading the same x, without bias, as one
    group (one GEMM over their concatenated weights); the rest alone; groups in graph
    order. FP8 weights join only at multiples of 128 rows, where the 128x128 scale blocks of
    the parts are those of the whole."""
    by_x: dict[torch.fx.Node, list] = {}
    for pair in linears:
        by_x.setdefault(pair[1].x, []).append(pair)
    groups = []
    for members in by_x.values():
        joinable = [(p, l) for p, l in members if l.bias is None
                    and (not fp8 or l.weight.shape[0] % 128 == 0)]
        if len(joinable) < 2:
            joinable = []
        else:
            groups.append(joinable)
        groups.extend([pair] for pair in members if pair not in joinable)
    return sorted(groups, key=lambda group: group[0][0])


def _rewrite(g: Graph, group: list[Linear], fp8: bool) -> torch.fx.Node:
    first = group[0]
    x = first.node.args[0]   # now: an earlier rewrite may have replaced the node first.x was
    weight = torch.cat([l.weight.detach() for l in group]) if len(group) > 1 else first.weight
    name = f"_ptxforge_{first.node.name}"
    if fp8 or len(group) > 1:
        g.folded.extend(linear.weight for linear in group)
    with g.graph.inserting_before(first.node):
        if fp8:
            wq, ws = PTXFORGE.quantize_fp8_per_block(weight.detach())
            args = (x, None, g.constant(name + "_w", wq), g.constant(name + "_ws", ws))
            target = PTXFORGE.fp8_linear.default
        else:
            args = (x, g.constant(name + "_w", weight.detach().contiguous()))
            target = PTXFORGE.bf16_linear.default
        out = g.call(target, args, {"bias": first.bias})
        start = 0
        for linear in group:
            n = linear.weight.shape[0]
            part = out if len(group) == 1 else g.call(
                operator.getitem, (out, (Ellipsis, slice(start, start + n))))
            start += n
            part.meta.update({k: v for k, v in linear.node.meta.items() if k != "example_value"})
            linear.node.replace_all_uses_with(part)
    for linear in group:   # after the inserts: they are placed before the first of them
        g.graph.erase_node(linear.node)
    return out


def _operator_name(node) -> str:
    return str(node.target).rsplit(".", 1)[0]


# --- what makes a Linear's x: RMSNorm, SwiGLU -----------------------------------------------

def _args(node):
    """The two operands of a binary node (either order matters to the caller)."""
    return node.args[0], node.args[1]


def match_rms_norm(g: Graph, node):
    """(x, weight node, eps) if ``node`` computes RMSNorm(x) * weight over the last
    dimension of a bf16 x, as ``torch.rms_norm`` / ``F.rms_norm`` or as transformers'
    modules write it: ``w * (x.to(f32) * rsqrt(x.to(f32).pow(2).mean(-1, keepdim=True) +
    eps)).to(bf16)``; else None."""
    if kind(node) == "rms_norm":
        x, shape, weight = (list(node.args) + [node.kwargs.get("weight")])[:3]
        eps = node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
        eps = torch.finfo(torch.bfloat16).eps if eps is None else g.number(eps)
        x_value = g.value(x)
        if (x_value is None or weight is None or eps is None
                or tuple(shape) != (x_value.shape[-1],)):
            return None
        return x, weight, eps
    if kind(node) != "mul":
        return None
    for weight, normed in (_args(node), reversed(_args(node))):
        if g.tensor(weight) is None or g.tensor(weight).dim() != 1:
            continue
        if kind(normed) == "to":
            normed = normed.args[0]
        if kind(normed) != "mul":
            continue
        for a, r in (_args(normed), reversed(_args(normed))):
            if kind(r) != "rsqrt" or kind(r.args[0]) != "add":
                continue
            variance, eps = r.args[0].args
            eps = g.number(eps)
            if eps is None or kind(variance) != "mean" or not _is_square_mean(variance, a):
                continue
            x = a.args[0] if kind(a) == "to" else a
            return x, weight, eps
    return None


def _is_square_mean(mean, a) -> bool:
    """mean(a.pow(2), -1, keepdim=True)."""
    square = mean.args[0]
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    return (kind(square) == "pow" and square.args[0] is a and square.args[1] == 2
            and dims in (-1, [-1], (-1,)) and keepdim)


def match_swiglu(g: Graph, node):
    """(gate, up) if ``node`` is silu(gate) * up; else None."""
    if kind(node) != "mul":
        return None
    for silu, up in (_args(node), reversed(_args(node))):
        if kind(silu) == "silu" and not silu.kwargs.get("inplace", False):
            gate = silu.args[0]
            if isinstance(up, torch.fx.Node) and g.value(gate).shape == g.value(up).shape:
                return gate, up
    return None


def _row_kernel_takes(variant: str, hidden: int, arch_of, device) -> str | None:
    """Why the row kernel ``variant`` cannot take rows of ``hidden``, or None."""
    arch = arch_of(device)
    if isinstance(arch, str):
        return arch
    try:
        row_kernel.choose_config(arch, row_kernel.VARIANTS[variant], hidden)
    except ValueError as error:
        return str(error)
    return None


def fuse_producers(g: Graph, made: list, arch_of) -> list[Replacement]:
    """For each FP8 Linear whose x an RMSNorm or a SwiGLU makes: that kernel, fused with
    the per-token quantization, writes the Linear's FP8 input (and its scales); the
    ptxforge node is made once for all the Linears that read it."""
    plan, quantized = [], {}
    for linear in made:
        if linear.target is not PTXFORGE.fp8_linear.default or linear.args[1] is not None:
            continue   # bf16, or an x the model quantized itself
        x = linear.args[0]
        if x not in quantized:
            quantized[x] = _fused_quantizer(g, x, arch_of, plan)
        if quantized[x] is not None:
            q, scales = quantized[x]
            linear.args = (q, scales, *linear.args[2:])
    return plan


def _fused_quantizer(g: Graph, x, arch_of, plan):
    """(q, scales) nodes of the fused kernel that makes x, or None (x made otherwise)."""
    value = g.value(x)
    norm, swiglu = match_rms_norm(g, x), match_swiglu(g, x)
    if norm is None and swiglu is None:
        return None
    rewrite = "rms_norm -> fp8" if norm else "silu(gate) * up -> fp8"
    variant = "rms_norm_quantize_fp8" if norm else "silu_mul_quantize_fp8"
    hidden = int(value.shape[-1])   # static: it matches a weight's
    why = _row_kernel_takes(variant, hidden, arch_of, value.device)
    if norm and (g.tensor(norm[1]) is None or g.value(norm[0]).dtype != torch.bfloat16):
        why = "x is not bf16 or the norm's weight is not a parameter"
    if why is not None:
        plan.append(Replacement(rewrite, x.name, None, why))
        return None
    with g.graph.inserting_after(x):
        if norm:
            source, weight, eps = norm
            both = g.call(PTXFORGE.rms_norm_fp8.default, (source, weight, eps))
        else:
            both = g.call(PTXFORGE.silu_mul_fp8.default, swiglu)
    with g.graph.inserting_after(both):
        scales = g.call(operator.getitem, (both, 1))
        q = g.call(operator.getitem, (both, 0))
    plan.append(Replacement(rewrite, x.name, _operator_name(both),
                            f"hidden {hidden}, 1x128 per-token scales"))
    return q, scales


# --- residual --------------------------------------------------------------------------------

def fuse_residuals(g: Graph, made: list) -> list[Replacement]:
    """``r + Linear(x)`` (or ``Linear(x) + r``), r bf16 of the output's shape and the add
    the Linear's only reader -> the GEMM's epilogue adds r."""
    plan = []
    for linear in made:
        if len(linear.users) != 1:
            continue
        (add,) = linear.users
        if kind(add) != "add" or len(add.args) != 2 or add.kwargs:
            continue
        residual = add.args[1] if add.args[0] is linear else add.args[0]
        value, out = g.value(residual), g.value(linear)
        if (residual is linear or not isinstance(residual, torch.fx.Node)
                or value.dtype != torch.bfloat16 or value.shape != out.shape):
            continue
        add.prepend(linear)   # after r: the add was after both
        linear.kwargs = {**linear.kwargs, "residual": residual}
        linear.meta["example_value"] = g.value(add)
        add.replace_all_uses_with(linear)
        g.graph.erase_node(add)
        plan.append(Replacement("residual add", add.name, _operator_name(linear),
                                "added in the GEMM's epilogue"))
    return plan


# --- causal attention -------------------------------------------------------------------------

# Sequence lengths at which a mask is checked to be causal; with the traced one and a
# length past the common sliding windows (4096), so that a window is not mistaken for none.
CHECKED_LENGTHS = (1, 2, 7, 64, 300, 4097)


def use_causal_attention(g: Graph) -> list[Replacement]:
    """SDPA given a boolean mask over [T, T] that is the causal mask (transformers builds it
    in the graph, under torch.compile, instead of asking for is_causal): is_causal=True.
    The mask must be made from sequence lengths alone (no input tensor: no padding mask,
    no position ids from the caller), by no sliding-window or chunked mask function, and
    equal ``tril`` at every length of CHECKED_LENGTHS and the traced one, evaluated here."""
    plan = []
    for node in list(g.graph.nodes):
        if kind(node) != "sdpa":
            continue
        mask, causal = _sdpa_argument(node, 3, "attn_mask"), _sdpa_argument(node, 5, "is_causal")
        if mask is None or causal:
            continue
        why = _why_not_causal(g, node, mask)
        if why is None:
            args = list(node.args[:3])
            kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
            node.args, node.kwargs = tuple(args), {**kwargs, "is_causal": True}
        if why is None and g.value(mask).device.type == "meta":
            why_not = "a mask of sequence lengths alone (checked causal when compiled for a GPU)"
        else:
            why_not = "the mask is causal: checked at lengths " + ", ".join(map(str, CHECKED_LENGTHS))
        plan.append(Replacement("causal attention", node.name,
                                None if why else "SDPA is_causal=True", why or why_not))
    return plan


def _sdpa_argument(sdpa, position: int, name: str):
    """An SDPA call's argument, given by position or by name (None where not given: no
    attn_mask, is_causal False)."""
    return sdpa.args[position] if len(sdpa.args) > position else sdpa.kwargs.get(name)


def _unrepeat_kv(g: Graph, sdpa) -> list[Replacement]:
    """k and v as transformers' repeat_kv hands them to SDPA, ``x[:, :, None].expand(b, h,
    n, t, d).reshape(b, h * n, t, d)`` with the same n: SDPA reads the unrepeated ones
    with enable_gqa=True instead (the repeat is a copy per call)."""
    q, k, v = sdpa.args[:3]
    unrepeated = [_repeated(g, x) for x in (k, v)]
    if None in unrepeated or unrepeated[0][1] != unrepeated[1][1]:
        return []
    sdpa.args = (q, unrepeated[0][0], unrepeated[1][0])
    sdpa.kwargs = {**sdpa.kwargs, "enable_gqa": True}
    return [Replacement("grouped-query attention", sdpa.name, "SDPA enable_gqa=True",
                        f"keys and values not repeated {unrepeated[0][1]} times")]


MASKED_GQA_ROWS = 64   # query rows up to which a masked SDPA reads keys and values unrepeated


def read_kv_once(g: Graph) -> list[Replacement]:
    """SDPA over keys and values repeated for grouped-query attention (transformers'
    repeat_kv: a copy of them n times a call, of the whole static cache in a decode step):
    enable_gqa=True on the unrepeated ones. Without a mask (the causal rewrite's) always;
    with one (a decode step's covers the cache's length) for a query length known when
    the graph compiles of at most MASKED_GQA_ROWS: torch's cuDNN attention takes the
    group and the mask together (H200, a decode step's one query a sequence, 8 key-value
    heads of 32: 1 x 641 keys 26.0 -> 11.3 us, 32 x 4225 keys 2818 -> 140 us), but its
    memory-efficient one does not, and SDPA's math fallback would hold a queries x keys
    score matrix: a long masked query (a padded prompt) keeps the repeat."""
    plan = []
    for node in list(g.graph.nodes):
        if kind(node) != "sdpa" or node.kwargs.get("enable_gqa"):
            continue
        mask = _sdpa_argument(node, 3, "attn_mask")
        query = g.value(node.args[0])
        rows = query.shape[-2] if isinstance(query, torch.Tensor) else None
        if mask is not None and not (isinstance(rows, int) and rows <= MASKED_GQA_ROWS):
            if _repeated(g, node.args[1]) is not None:
                plan.append(Replacement(
                    "grouped-query attention", node.name, None,
                    f"a mask over more than {MASKED_GQA_ROWS} query rows, or a dynamic "
                    f"count: the repeat kept (SDPA's masked enable_gqa may fall back to math)"))
            continue
        plan += _unrepeat_kv(g, node)
    return plan


def _repeated(g: Graph, node):
    """(x, n) if ``node`` is ``x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)``
    of a 4-D x; else None."""
    if kind(node) != "reshape" or kind(node.args[0]) != "expand":
        return None
    expand = node.args[0]
    index = expand.args[0]
    full = slice(None, None, None)
    if (not isinstance(index, torch.fx.Node) or index.op != "call_function"
            or index.target is not operator.getitem or index.args[1] != (full, full, None, full, full)):
        return None
    x, sizes = index.args[0], expand.args[1:]
    repeats = sizes[2] if len(sizes) == 5 else None
    value, out = g.value(x), g.value(node)
    if not isinstance(repeats, int) or value is None or value.dim() != 4 or out.dim() != 4:
        return None
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(out.shape[1] == value.shape[1] * repeats):
        return None
    return x, repeats


# --- decode attention -------------------------------------------------------------------------

# Values of a decode mask's inputs (the cache's length or the query's position) at which it
# is checked to admit a prefix of the cache.
CHECKED_POSITIONS = (0, 1, 15, 16, 63, 64, 1000)


def use_decode_attention(g: Graph, arch_of) -> list[Replacement]:
    """SDPA of one query token a sequence, q [B, Hq, 1, D], over keys and values [B, Hkv,
    S, D] read unrepeated (a decode step's over transformers' static cache, after the kv
    pass), under a boolean mask [B, 1, 1, S] that admits the cache's tokens [0, L) and is
    computed from one-element integer inputs alone (the cache's length, the query's
    position; checked a prefix at CHECKED_POSITIONS): ptxforge.attention_with_kvcache,
    with each sequence's L the mask's count of admitted tokens (one small reduction, shared
    by every layer reading the mask). A padding mask (an input) keeps SDPA."""
    plan, lengths = [], {}
    for node in list(g.graph.nodes):
        if kind(node) != "sdpa" or not _one_query_token(g, node):
            continue
        why = _why_not_decode_attention(g, node, arch_of)
        if why is not None:
            plan.append(Replacement("decode attention", node.name, None, why))
            continue
        q, k, v = node.args[:3]
        mask = _sdpa_argument(node, 3, "attn_mask")
        if mask not in lengths:
            with g.graph.inserting_after(mask):
                rows = g.call(operator.getitem, (mask, (slice(None), 0, 0)))
            with g.graph.inserting_after(rows):
                lengths[mask] = g.call(torch.sum, (rows,), {"dim": -1, "dtype": torch.int32})
        with g.graph.inserting_before(node):
            q_tokens, k_tokens, v_tokens = (g.call(torch.transpose, (x, 1, 2)) for x in (q, k, v))
            out = g.call(PTXFORGE.attention_with_kvcache.default,
                         (q_tokens, k_tokens, v_tokens, lengths[mask]),
                         {"softmax_scale": node.kwargs.get("scale")})
            heads = g.call(torch.transpose, (out, 1, 2))
        node.replace_all_uses_with(heads)
        g.graph.erase_node(node)
        plan.append(Replacement("decode attention", node.name, _operator_name(out),
                                "one query token over the cache's first L tokens, L from "
                                "the mask"))
    return plan


def _one_query_token(g: Graph, sdpa) -> bool:
    q = g.value(sdpa.args[0])
    return isinstance(q, torch.Tensor) and q.dim() == 4 and isinstance(q.shape[2], int) \
        and q.shape[2] == 1


def _why_not_decode_attention(g: Graph, sdpa, arch_of) -> str | None:
    from ..kernels import bf16_decode_attention as attention

    q, k, v = (g.value(x) for x in sdpa.args[:3])
    mask = _sdpa_argument(sdpa, 3, "attn_mask")
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype == torch.bfloat16
               for x in (q, k, v)):
        return "q, k and v are not bf16 [B, H, T, D]"
    if _sdpa_argument(sdpa, 5, "is_causal") or _sdpa_argument(sdpa, 4, "dropout_p"):
        return "causal or with dropout"
    _, why = gpu_arch(q, arch_of)
    if why is not None:
        return why
    batch, heads, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        return f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit q {tuple(q.shape)}"
    if k.shape[1] != heads and not sdpa.kwargs.get("enable_gqa"):
        return "keys and values repeated for grouped-query attention"
    if heads % k.shape[1]:
        return f"{heads} query heads over {k.shape[1]} key-value heads"
    try:
        attention.check_problem(head_dim, heads // k.shape[1])
    except ValueError as error:
        return str(error)
    if mask is None:
        return "no mask: every key, not a cache's first L"
    return _why_not_prefix(g, mask, k.shape[2])


def _why_not_prefix(g: Graph, mask, capacity) -> str | None:
    """Why ``mask`` may admit other than a prefix of the cache's ``capacity`` tokens for
    each sequence, or None: it must be boolean [B or 1, 1, 1, S], computed from integer
    inputs of one element alone, and admit a prefix at every value of CHECKED_POSITIONS
    below S (evaluated here; in the report's trace on the meta device, when compiled)."""
    value = g.value(mask)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        return "the mask is not boolean"
    if value.dim() != 4 or tuple(value.shape[1:3]) != (1, 1) or value.shape[3] != capacity:
        return f"the mask is {tuple(value.shape)}, not [B, 1, 1, S]"
    computed_from = ancestors(mask)
    placeholders = [n for n in computed_from if n.op == "placeholder"]
    for node in computed_from:
        held = g.value(node)
        if node.op == "placeholder" and isinstance(held, torch.Tensor):
            if held.numel() != 1 or held.is_floating_point() or held.dtype == torch.bool:
                return f"the mask depends on the input {node.name}"
        elif node.op not in ("placeholder", "call_function", "call_method"):
            return f"the mask depends on {node.op} {node.name}"
    if not any(isinstance(g.value(n), torch.Tensor) for n in placeholders):
        return "the mask does not depend on the cache's length"
    if value.device.type == "meta":
        return None   # the report's trace: checked when compiled for a GPU
    evaluate = _subgraph(computed_from, placeholders, mask)
    for position in (p for p in CHECKED_POSITIONS if p < capacity):
        inputs = [_filled(g.value(n), position) if isinstance(g.value(n), torch.Tensor)
                  else traced_size(g.value(n)) for n in placeholders]   # sizes as traced
        try:
            got = evaluate(inputs)
        except Exception as error:   # a mask this check cannot run: left as it is
            return f"the mask could not be evaluated at position {position}: {error}"
        admitted = got[:, 0, 0, :]
        prefix = torch.arange(capacity, device=got.device) < admitted.sum(-1, keepdim=True)
        if not bool((admitted == prefix).all()):
            return f"the mask admits other than a prefix of the cache at position {position}"
    return None


def _filled(like: torch.Tensor, value: int) -> torch.Tensor:
    """A real tensor of ``like``'s shape, dtype and device (``like`` a fake) holding ``value``."""
    return torch.full(tuple(like.shape), value, dtype=like.dtype, device=like.device)


def _why_not_causal(g: Graph, sdpa, mask) -> str | None:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    q, k = g.value(sdpa.args[0]), g.value(sdpa.args[1])
    value = g.value(mask)
    if value is None or value.dtype != torch.bool:
        return "the mask is not boolean"
    if not statically_known_true(q.shape[-2] == k.shape[-2]):
        return "queries and keys may differ in length (a cache)"
    computed_from = ancestors(mask)
    for node in computed_from:
        if node.op == "placeholder" and isinstance(g.value(node), torch.Tensor):
            return f"the mask depends on the input {node.name}"
        if node.op not in ("placeholder", "call_function", "call_method"):
            return f"the mask depends on {node.op} {node.name}"
        frames = node.meta.get("stack_trace", "")
        if "sliding" in frames or "chunk" in frames:
            return "the mask comes from a sliding-window or chunked mask function"
    if value.device.type == "meta":
        return None   # the report's trace: checked when compiled for a GPU
    sizes = [n for n in computed_from if n.op == "placeholder"]
    if len(sizes) != 1:
        return f"the mask depends on {len(sizes)} sizes, not the sequence length alone"
    evaluate = _subgraph(computed_from, sizes, mask)
    traced = traced_size(q.shape[-2])
    for length in sorted({*CHECKED_LENGTHS, traced}):
        try:
            got = evaluate([length])
        except Exception as error:   # a mask this check cannot run: left as it is
            return f"the mask could not be evaluated at length {length}: {error}"
        causal = torch.ones(length, length, dtype=torch.bool, device=got.device).tril()
        if got.shape[-2:] != (length, length) or not bool((got == causal).all()):
            return f"the mask is not causal at length {length}"
    return None


def _subgraph(nodes, inputs, output):
    """A function of the values of ``nodes``' placeholders ``inputs`` (a list, in order)
    computing ``output``."""
    graph, copied = torch.fx.Graph(), {}
    for n in nodes:
        copied[n] = (graph.placeholder(n.name) if n in inputs
                     else graph.node_copy(n, lambda arg: copied[arg]))
    graph.output(copied[output])
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return lambda values: module(*values)


def _kept_by_dce(node) -> bool:
    """FX's dead-code elimination takes every call_method for pure: an in-place method
    whose result goes unused (DeepSeek-V3's router: ``group_mask.scatter_(1, group_idx, 1)``)
    would be deleted and the graph compute something else. Methods named with torch's
    in-place underscore are kept, with what FX itself keeps."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return True
    return node.is_impure()


def rewrite(gm: torch.fx.GraphModule, example_inputs, *, fp8: bool, arch_of,
            ep=None) -> list[Replacement]:
    """Every pass, in order; returns the plan. The parameters whose values the graph now
    holds a copy of (quantized or joined) are left in ``gm.ptxforge_folded``. ``ep``: the
    experts sharded over a group (``expert_parallel.ExpertParallel``), or None."""
    g = Graph(gm, example_inputs)
    plan = rewrite_moe_experts(g, fp8=fp8, arch_of=arch_of, ep=ep)
    plan += rewrite_upcast_linears(g, arch_of)
    made, linear_plan = rewrite_linears(g, fp8=fp8, arch_of=arch_of)
    plan += linear_plan
    if fp8:
        plan += fuse_producers(g, made, arch_of)
    plan += fuse_residuals(g, made)
    plan += use_causal_attention(g)
    plan += read_kv_once(g)
    plan += use_decode_attention(g, arch_of)
    g.graph.eliminate_dead_code(is_impure_node=_kept_by_dce)
    g.graph.lint()
    gm.recompile()
    gm.ptxforge_folded = g.folded
    return plan
