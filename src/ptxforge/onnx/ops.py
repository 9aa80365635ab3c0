"""The op table: each ONNX op the front end takes, the versions of it whose semantics its
lowering implements, the attributes (and attribute values) it takes, and the lowering,
which emits torch calls through the ``Builder`` (``builder.py``).

A lowering gets the Builder and the ONNX node and returns the node's output values. The
lowerings of the ops shape arithmetic goes through (Shape, Gather, Slice, Concat,
Unsqueeze, Squeeze, Reshape, Cast, Add, Sub, Mul, Div, Max, Min) compute on the items of
``Sizes`` (Python ints and int nodes) when an input is Sizes and every input is known
when the graph is built, instead of making tensors of them; an op whose inputs are all
constants is computed when the graph is built.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from .common import DTYPES, Sizes, domain, node_name, opsets, type_name

_F = torch.nn.functional
# The model opsets whose op versions the table takes: the versions of each op in force
# from FIRST (or the op's own first) to LAST.
FIRST, LAST = 13, 23


@dataclass(frozen=True)
class Op:
    lower: Callable
    first: int = FIRST                 # the first opset whose version of the op is lowered
    attributes: dict = field(default_factory=dict)   # name -> allowed values, None: any
    inputs: int = 8                    # inputs taken (the rest must be omitted)
    outputs: int = 1


@functools.lru_cache(maxsize=None)
def versions(op_type: str) -> frozenset:
    """The versions of ``op_type`` in force at the opsets its lowering takes."""
    first = TABLE[op_type].first
    return frozenset(_since(op_type, opset) for opset in range(first, LAST + 1)) - {None}


def _since(op_type: str, opset: int) -> int | None:
    import onnx

    try:
        return onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:   # the op does not exist yet at that opset
        return None


# --- shared helpers --------------------------------------------------------------------

def _known(value) -> bool:
    """Known when the graph is built: a constant or Sizes."""
    return isinstance(value, (torch.Tensor, Sizes))


def _items(value) -> tuple:
    if isinstance(value, Sizes):
        return value.items
    return tuple(value.reshape(-1).tolist())


def _scalar(value) -> bool:
    return value.scalar if isinstance(value, Sizes) else value.dim() == 0


def sizes(items, *, scalar: bool = False, dtype=torch.int64):
    """Integers known when the graph is built: a constant if every item is an int, else
    Sizes."""
    items = tuple(items)
    if any(isinstance(i, torch.fx.Node) for i in items):
        return Sizes(items, scalar, dtype)
    return torch.tensor(items[0] if scalar else list(items), dtype=dtype)


def _sizes_form(b, node) -> bool:
    """Whether ``node`` computes on Sizes: one input is, every input is known now, and the
    known ones are 0-D or 1-D integers."""
    values = [b.value(name) for name in node.input if name]
    return (any(isinstance(v, Sizes) for v in values) and all(_known(v) for v in values)
            and all(isinstance(v, Sizes) or (v.dim() <= 1 and not v.is_floating_point())
                    for v in values))


def _axis(axis: int, rank: int) -> int:
    return axis % rank if rank else 0


# --- elementwise -------------------------------------------------------------------------

def _elementwise(fn, *, result=None, items=None, tensors=False):
    """A lowering of an elementwise op with numpy broadcasting (torch's): ``fn`` on the
    inputs (Python numbers for 0-D constants unless ``tensors``), its dtype ``result`` or
    the inputs' common one; ``items``: the op on Sizes' items."""
    def lower(b, node):
        values = [b.value(name) for name in node.input]
        if items is not None and _sizes_form(b, node):
            return [_on_items(b, items, values)]
        if all(isinstance(v, torch.Tensor) for v in values):
            return [functools.reduce(fn, values)]
        operands = [b.as_node(v) if tensors else b.operand(name)
                    for v, name in zip(values, node.input)]
        operands = b.common(*operands)
        out = operands[0]
        for other in operands[1:]:
            out = b.call(fn, out, other, result=result)
        return [out]
    return lower


def _on_items(b, fn, values):
    """``fn`` over the items of 0-D / 1-D known values, broadcast."""
    lists = [_items(v) for v in values]
    n = max(len(items) for items in lists)
    out = [functools.reduce(lambda acc, x: b.call(fn, acc, x),
                            [items[i if len(items) > 1 else 0] for items in lists])
           for i in range(n)]
    return sizes(out, scalar=all(_scalar(v) for v in values), dtype=values[0].dtype)


def _int_div(a, b):
    """ONNX Div of integers: the quotient truncated (toward zero)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.div(a, b, rounding_mode="trunc")
    return operator.floordiv(a, b)   # sizes: not negative


def lower_div(b, node):
    dtype = b.dtype(b.value(node.input[0]))
    if dtype is not None and not dtype.is_floating_point:
        return _elementwise(_int_div, items=_int_div, tensors=True)(b, node)
    return _elementwise(operator.truediv)(b, node)


def _unary(fn, result=None):
    return lambda b, node: [b.call(fn, b.data(node.input[0]), result=result)]


def lower_where(b, node):
    condition = b.as_node(b.value(node.input[0]))
    x, y = b.operand(node.input[1]), b.operand(node.input[2])
    if not isinstance(x, torch.fx.Node) and not isinstance(y, torch.fx.Node):
        x = b.tensor(node.input[1])    # a tensor of the graph's type, not a Python number
    x, y = b.common(x, y)
    dtype = b.dtype(x) or b.dtype(y)
    return [b.call(torch.where, condition, x, y, result=dtype)]


# --- shapes and data movement ------------------------------------------------------------

def lower_shape(b, node):
    a = b.attributes(node)
    rank = b.rank(node, node.input[0])
    dims = range(rank)[slice(a.get("start", 0), a.get("end", rank))]   # clamped, as ONNX
    return [sizes(b.size(node.input[0], d) for d in dims)]


def lower_identity(b, node):
    return [b.value(node.input[0])]


def lower_cast(b, node):
    dtype = DTYPES[b.attributes(node)["to"]]
    value = b.value(node.input[0])
    if isinstance(value, Sizes) and not dtype.is_floating_point and dtype != torch.bool:
        return [Sizes(value.items, value.scalar, dtype)]
    return [b.call("to", b.data(node.input[0]), dtype, result=dtype)]


def lower_reshape(b, node):
    value = b.value(node.input[0])
    shape = b.ints(node, 1, "shape")
    if _sizes_form(b, node):
        if len(shape) > 1:
            b.fail(node, f"reshapes shape values to {shape}: only to 0-D or 1-D")
        return [Sizes(value.items, not shape, value.dtype)]
    allow_zero = b.attributes(node).get("allowzero", 0)
    shape = tuple(b.size(node.input[0], d) if s == 0 and not allow_zero else s
                  for d, s in enumerate(shape))
    return [b.call("reshape", b.data(node.input[0]), shape)]


def lower_expand(b, node):
    """ONNX broadcasts both ways (a 1 in the shape keeps x's size): torch's -1."""
    x = b.data(node.input[0])
    shape = b.ints(node, 1, "shape")
    rank = b.rank(node, node.input[0])
    shape = (1,) * (rank - len(shape)) + tuple(shape)
    return [b.call("expand", x, *(-1 if s == 1 else s for s in shape))]


def lower_transpose(b, node):
    rank = b.rank(node, node.input[0])
    perm = b.attributes(node).get("perm", list(reversed(range(rank))))
    return [b.call("permute", b.data(node.input[0]), *perm)]


def lower_concat(b, node):
    axis = b.attributes(node)["axis"]
    if _sizes_form(b, node):
        return [sizes([i for name in node.input for i in _items(b.value(name))])]
    values = b.common(*(b.tensor(name) for name in node.input))
    return [b.call(torch.cat, list(values), axis)]


def lower_unsqueeze(b, node):
    axes = b.ints(node, 1, "axes")
    value = b.value(node.input[0])
    if _sizes_form(b, node):
        return [Sizes(value.items, False, value.dtype)]
    rank = b.rank(node, node.input[0]) + len(axes)
    axes = {_axis(a, rank) for a in axes}
    index = tuple(None if d in axes else slice(None) for d in range(rank))
    return [b.call(operator.getitem, b.data(node.input[0]), index)]


def lower_squeeze(b, node):
    value = b.value(node.input[0])
    if _sizes_form(b, node):
        return [Sizes(value.items, True, value.dtype)]
    if len(node.input) > 1 and node.input[1]:
        return [b.call("squeeze", b.data(node.input[0]), b.ints(node, 1, "axes"))]
    return [b.call("squeeze", b.data(node.input[0]))]


def lower_gather(b, node):
    axis = b.attributes(node).get("axis", 0)
    data, indices = b.value(node.input[0]), b.value(node.input[1])
    if _sizes_form(b, node):
        picked = [data.items[i] for i in _items(indices)]
        return [sizes(picked, scalar=_scalar(indices), dtype=data.dtype)]
    axis = _axis(axis, b.rank(node, node.input[0]))
    if axis == 0 and b.is_parameter(node.input[0]):   # an embedding table
        data = b.parameter(node.input[0], weight=True)
    else:
        data = b.data(node.input[0])
    # torch's indexing is ONNX's Gather: negative indices count from the end, a 0-D index
    # (a Python int here) drops the axis
    return [b.call(operator.getitem, data, (slice(None),) * axis + (b.operand(node.input[1]),))]


def lower_gather_nd(b, node):
    """batch_dims=0: ``data[indices[..., 0], indices[..., 1], ...]``."""
    data, indices = b.tensor(node.input[0]), b.tensor(node.input[1])
    parts = b.call(torch.unbind, indices, -1)
    return [b.call(operator.getitem, data, parts, result=b.dtype(data))]


# Slice bounds are clamped to +-this: ONNX writes INT64_MAX and INT64_MIN for "to the end",
# which torch's own clamping (start + size) would overflow.
_FAR = 1 << 62


def lower_slice(b, node):
    value = b.value(node.input[0])
    starts, ends = b.ints(node, 1, "starts"), b.ints(node, 2, "ends")
    has = lambda i: len(node.input) > i and node.input[i]
    axes = b.ints(node, 3, "axes") if has(3) else tuple(range(len(starts)))
    steps = b.ints(node, 4, "steps") if has(4) else (1,) * len(starts)
    if _sizes_form(b, node):
        if tuple(axes) not in ((0,), (-1,)):
            b.fail(node, f"slices a 1-D shape value on axes {axes}")
        return [sizes(value.items[_slice(starts[0], ends[0], steps[0])], dtype=value.dtype)]
    rank = b.rank(node, node.input[0])
    index, flipped = [slice(None)] * rank, []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, rank)
        if not isinstance(step, int) or step == 0:
            b.fail(node, f"needs a nonzero step known when the graph is built, got {step}")
        if step > 0:
            index[axis] = _slice(start, end, step)
            continue
        # torch slices forward only: flip the axis, then slice the same elements
        size = b.size(node.input[0], axis)
        if not isinstance(size, int) or not isinstance(start, int) or not isinstance(end, int):
            b.fail(node, f"slices axis {axis} with step {step}: a negative step needs the "
                         f"axis' size and the bounds known when the graph is built")
        picked = range(size)[slice(start, end, step)]
        first = size - 1 - picked.start if picked else 0
        index[axis] = slice(first, first + len(picked) * -step, -step)
        flipped.append(axis)
    x = b.data(node.input[0])
    if flipped:
        x = b.call(torch.flip, x, flipped)
    return [b.call(operator.getitem, x, tuple(index))]


def _slice(start, end, step) -> slice:
    clamp = lambda v: max(-_FAR, min(_FAR, v)) if isinstance(v, int) else v
    return slice(clamp(start), clamp(end), step)


def lower_constant(b, node):
    (name, value), = b.attributes(node).items()
    if name == "value":   # a tensor: made what an initializer of it would be
        b.initializers[node.output[0]] = value
        return [b.value(node.output[0])]
    dtype = torch.float32 if name.startswith("value_float") else torch.int64
    return [torch.tensor(value, dtype=dtype)]


def lower_constant_of_shape(b, node):
    proto = b.attributes(node).get("value")
    fill, dtype = 0.0, torch.float32
    if proto is not None:
        fill, dtype = b.read(proto).reshape(-1)[0].item(), DTYPES[proto.data_type]
    shape = b.ints(node, 0, "shape")
    return [b.call(torch.full, shape, fill, dtype=dtype, device=b.device_node())]


def lower_range(b, node):
    start, limit, delta = (b.value(name) for name in node.input)
    if not all(_known(v) for v in (start, limit, delta)):
        b.fail(node, "needs start, limit and delta known when the graph is built (constants "
                     "or computed from shapes), got a tensor computed at run time")
    args = [_items(v)[0] for v in (start, limit, delta)]
    return [b.call(torch.arange, *args, dtype=start.dtype, device=b.device_node())]


# --- reductions, matmul ------------------------------------------------------------------

def lower_reduce_mean(b, node):
    a = b.attributes(node)
    x = b.tensor(node.input[0])
    axes = b.ints(node, 1, "axes") if len(node.input) > 1 and node.input[1] else ()
    if not axes and a.get("noop_with_empty_axes", 0):
        return [x]
    return [b.call(torch.mean, x, dim=tuple(axes) or None, keepdim=bool(a.get("keepdims", 1)))]


def lower_softmax(b, node):
    return [b.call(torch.softmax, b.tensor(node.input[0]), b.attributes(node).get("axis", -1))]


def lower_cumsum(b, node):
    a = b.attributes(node)
    x = b.tensor(node.input[0])
    (axis,) = b.ints(node, 1, "axis")
    dtype = b.dtype(x)
    if a.get("reverse", 0):
        x = b.call(torch.flip, x, [axis])
    out = b.call(torch.cumsum, x, axis, dtype=dtype)
    if a.get("exclusive", 0):
        out = b.call(operator.sub, out, x)
    if a.get("reverse", 0):
        out = b.call(torch.flip, out, [axis])
    return [out]


def lower_matmul(b, node):
    x, y = b.common(b.tensor(node.input[0]), b.tensor(node.input[1]))
    return [b.call(torch.matmul, x, y)]


def lower_gemm(b, node):
    """``alpha * A' @ B' + beta * C`` (A', B': A, B transposed where transA, transB)."""
    a = b.attributes(node)
    x, y = b.common(b.tensor(node.input[0]), b.tensor(node.input[1]))
    if a.get("transA", 0):
        x = b.call("t", x)
    if a.get("transB", 0):
        y = b.call("t", y)
    out = b.call(torch.matmul, x, y)
    return [gemm_epilogue(b, node, out)]


def gemm_epilogue(b, node, out):
    """Gemm's ``alpha * out + beta * C`` on ``out`` = A' @ B'."""
    a = b.attributes(node)
    if a.get("alpha", 1.0) != 1.0:
        out = b.call(operator.mul, out, a["alpha"])
    if len(node.input) > 2 and node.input[2]:
        c = b.operand(node.input[2])
        if a.get("beta", 1.0) != 1.0:
            c = b.call(operator.mul, c, a["beta"])
        out = b.call(operator.add, *b.common(out, c))
    return out


# --- opset 23: RMSNormalization, RotaryEmbedding, Attention --------------------------------

def lower_rms_normalization(b, node):
    a = b.attributes(node)
    x = b.tensor(node.input[0])
    rank = b.rank(node, node.input[0])
    shape = tuple(b.size(node.input[0], d) for d in range(_axis(a.get("axis", -1), rank), rank))
    eps = a.get("epsilon", 1e-5)
    scale = node.input[1]
    if b.is_parameter(scale) and tuple(b.initializers[scale].dims) == shape:
        return [b.call(torch.rms_norm, x, shape, b.parameter(scale, weight=True), eps)]
    normed = b.call(torch.rms_norm, x, shape, None, eps)
    return [b.call(operator.mul, *b.common(normed, b.operand(scale)))]


def rotary_embedding(x, cos, sin, position_ids=None, interleaved: int = 0,
                     rotary_dim: int = 0, num_heads: int = 0):
    """ONNX RotaryEmbedding-23: x [B, H, S, D] or [B, S, H * D] (``num_heads``), cos and
    sin [B, S, rotary_dim / 2] (or a cache indexed by ``position_ids`` [B, S]); the
    first ``rotary_dim`` (0: all) features of each head rotated as pairs (i, i + half),
    or (2i, 2i + 1) when ``interleaved``."""
    shape = x.shape
    x = x.transpose(1, 2) if x.dim() == 4 else x.reshape(shape[0], shape[1], num_heads, -1)
    rotary_dim = rotary_dim or x.shape[-1]
    half = rotary_dim // 2
    rotate, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    if interleaved:
        x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
    else:
        x1, x2 = rotate[..., :half], rotate[..., half:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rotated = (torch.stack((real, imag), -1).flatten(-2) if interleaved
               else torch.cat((real, imag), -1))
    out = torch.cat((rotated, keep), -1)
    return out.transpose(1, 2) if len(shape) == 4 else out.reshape(shape)


def lower_rotary_embedding(b, node):
    a = b.attributes(node)
    x, cos, sin = b.common(*(b.tensor(name) for name in node.input[:3]))
    if b.rank(node, node.input[0]) == 3 and not a.get("num_heads"):
        b.fail(node, "a 3-D input needs the num_heads attribute")
    positions = b.tensor(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    return [b.call(rotary_embedding, x, cos, sin, positions, a.get("interleaved", 0),
                   a.get("rotary_embedding_dim", 0), a.get("num_heads", 0), result=b.dtype(x))]


def lower_attention(b, node):
    """Attention-23 as ``F.scaled_dot_product_attention``: 4-D q, k, v [B, H, S, D], or
    3-D [B, S, H * D] with q_num_heads and kv_num_heads; fewer key/value heads than query
    heads: SDPA's enable_gqa (each key/value head serves consecutive query heads, as
    ONNX repeats them); a boolean mask (True: attends) or an additive one."""
    a = b.attributes(node)
    q_name, k_name, v_name = node.input[:3]
    rank = b.rank(node, q_name)
    q, k, v = (b.tensor(name) for name in (q_name, k_name, v_name))
    if rank == 3:
        if not a.get("q_num_heads") or not a.get("kv_num_heads"):
            b.fail(node, "3-D inputs need the q_num_heads and kv_num_heads attributes")
        batch, length = b.size(q_name, 0), b.size(q_name, 1)
        q, k, v = (_heads(b, t, name, heads) for t, name, heads in
                   ((q, q_name, a["q_num_heads"]), (k, k_name, a["kv_num_heads"]),
                    (v, v_name, a["kv_num_heads"])))
        q_heads, kv_heads = a["q_num_heads"], a["kv_num_heads"]
    else:
        q_heads, kv_heads = b.size(q_name, 1), b.size(k_name, 1)
    kwargs = {}
    mask = node.input[3] if len(node.input) > 3 and node.input[3] else None
    if mask is not None and a.get("is_causal", 0):
        b.fail(node, "is_causal=1 with an attn_mask is not supported (give one of them)")
    if mask is not None:
        mask = b.tensor(mask)
        if b.dtype(mask) != torch.bool:
            q, mask = b.common(q, mask)
        kwargs["attn_mask"] = mask
    if a.get("is_causal", 0):
        kwargs["is_causal"] = True
    if "scale" in a:
        kwargs["scale"] = a["scale"]
    if q_heads is not kv_heads and q_heads != kv_heads:
        kwargs["enable_gqa"] = True
    q, k, v = b.common(q, k, v)
    out = b.call(_F.scaled_dot_product_attention, q, k, v, **kwargs)
    if rank == 3:
        out = b.call("reshape", b.call("transpose", out, 1, 2), (batch, length, -1))
    return [out]


def _heads(b, x, name, heads):
    """[B, S, H * D] -> [B, H, S, D]."""
    shape = (b.size(name, 0), b.size(name, 1), heads, -1)
    return b.call("transpose", b.call("reshape", x, shape), 1, 2)


# --- the table ---------------------------------------------------------------------------

def _sym_max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_max(a, b)


def _sym_min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else torch.sym_min(a, b)


_BOOL = torch.bool
TABLE: dict[str, Op] = {
    # elementwise, numpy broadcasting
    "Add": Op(_elementwise(operator.add, items=operator.add)),
    "Sub": Op(_elementwise(operator.sub, items=operator.sub)),
    "Mul": Op(_elementwise(operator.mul, items=operator.mul)),
    "Div": Op(lower_div),
    "Pow": Op(_elementwise(operator.pow)),
    "Max": Op(_elementwise(torch.maximum, items=_sym_max, tensors=True)),
    "Min": Op(_elementwise(torch.minimum, items=_sym_min, tensors=True)),
    "Equal": Op(_elementwise(operator.eq, result=_BOOL)),
    "Less": Op(_elementwise(operator.lt, result=_BOOL)),
    "LessOrEqual": Op(_elementwise(operator.le, result=_BOOL)),
    "Greater": Op(_elementwise(operator.gt, result=_BOOL)),
    "GreaterOrEqual": Op(_elementwise(operator.ge, result=_BOOL)),
    "And": Op(_elementwise(operator.and_)),
    "Or": Op(_elementwise(operator.or_)),
    "Where": Op(lower_where),
    "Neg": Op(_unary(operator.neg)),
    "Not": Op(_unary(torch.logical_not)),
    "IsNaN": Op(_unary(torch.isnan, _BOOL)),
    "Sqrt": Op(_unary(torch.sqrt)),
    "Reciprocal": Op(_unary(torch.reciprocal)),
    "Exp": Op(_unary(torch.exp)),
    "Sigmoid": Op(_unary(torch.sigmoid)),
    "Sin": Op(_unary(torch.sin)),
    "Cos": Op(_unary(torch.cos)),
    "Cast": Op(lower_cast, attributes={"to": None, "saturate": None}),
    # shapes and data movement
    "Shape": Op(lower_shape, attributes={"start": None, "end": None}),
    "Identity": Op(lower_identity),
    "Constant": Op(lower_constant, attributes={"value": None, "value_float": None,
                                               "value_floats": None, "value_int": None,
                                               "value_ints": None}),
    "ConstantOfShape": Op(lower_constant_of_shape, attributes={"value": None}),
    "Range": Op(lower_range),
    "Reshape": Op(lower_reshape, attributes={"allowzero": None}),
    "Expand": Op(lower_expand),
    "Transpose": Op(lower_transpose, attributes={"perm": None}),
    "Concat": Op(lower_concat, attributes={"axis": None}),
    "Unsqueeze": Op(lower_unsqueeze),
    "Squeeze": Op(lower_squeeze),
    "Gather": Op(lower_gather, attributes={"axis": None}),
    "GatherND": Op(lower_gather_nd, attributes={"batch_dims": (0,)}),
    "Slice": Op(lower_slice),
    # reductions, matmul
    "ReduceMean": Op(lower_reduce_mean, first=18,
                     attributes={"keepdims": None, "noop_with_empty_axes": None}),
    "Softmax": Op(lower_softmax, attributes={"axis": None}),
    "CumSum": Op(lower_cumsum, attributes={"exclusive": None, "reverse": None}),
    "MatMul": Op(lower_matmul),
    "Gemm": Op(lower_gemm, attributes={"alpha": None, "beta": None, "transA": None,
                                       "transB": None}),
    # opset 23
    "RMSNormalization": Op(lower_rms_normalization, first=23,
                           attributes={"axis": None, "epsilon": None, "stash_type": (1,)}),
    "RotaryEmbedding": Op(lower_rotary_embedding, first=23,
                          attributes={"interleaved": None, "num_heads": None,
                                      "rotary_embedding_dim": None}),
    "Attention": Op(lower_attention, first=23, inputs=4,
                    attributes={"is_causal": None, "kv_num_heads": None, "q_num_heads": None,
                                "scale": None, "softcap": (0.0,), "qk_matmul_output_mode": (0,),
                                "softmax_precision": None}),
}


def emit(b, node) -> list:
    """The outputs of ``node``, lowered by its entry of the table."""
    return TABLE[node.op_type].lower(b, node)


# --- validation ------------------------------------------------------------------------------

def validate(model, value_info=()) -> None:
    """Every node's op, version, attributes and the dtypes it reads and writes against
    the table, before anything is built: the first one it does not take is a ValueError
    naming the node, its op type and opset."""
    import onnx

    model_opsets = opsets(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*model.graph.input, *model.graph.output, *model.graph.value_info,
                       *value_info] if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    taken = ", ".join(type_name(t) for t in DTYPES)
    for node in model.graph.node:
        opset = model_opsets.get(domain(node.domain), 0)
        where = f"ptxforge.onnx: node {node_name(node)!r} ({node.op_type}, opset {opset})"
        if domain(node.domain):
            raise ValueError(f"{where}: domain {node.domain!r} is not supported (only the "
                             f"default ONNX domain)")
        op = TABLE.get(node.op_type)
        if op is None:
            raise ValueError(f"{where}: the op is not supported; ptxforge.onnx takes "
                             f"{', '.join(sorted(TABLE))}")
        version = _since(node.op_type, opset)
        if version not in versions(node.op_type):
            supported = ", ".join(str(v) for v in sorted(versions(node.op_type)))
            raise ValueError(f"{where}: {node.op_type}-{version} is not supported (versions "
                             f"taken: {supported})")
        for attribute in node.attribute:
            value = onnx.helper.get_attribute_value(attribute)
            if attribute.name not in op.attributes:
                raise ValueError(f"{where}: attribute {attribute.name} is not supported (takes: "
                                 f"{', '.join(op.attributes) or 'none'})")
            allowed = op.attributes[attribute.name]
            if allowed is not None and value not in allowed:
                raise ValueError(f"{where}: attribute {attribute.name}={value!r} is not "
                                 f"supported (takes {' or '.join(map(repr, allowed))})")
            if attribute.name == "to" and value not in DTYPES:
                raise ValueError(f"{where}: to={type_name(value)} is not supported (takes "
                                 f"{taken})")
            if isinstance(value, onnx.TensorProto) and value.data_type not in DTYPES:
                raise ValueError(f"{where}: attribute {attribute.name} is "
                                 f"{type_name(value.data_type)}, not one of {taken}")
        extra = [name for name in node.input[op.inputs:] if name]
        extra += [name for name in node.output[op.outputs:] if name]
        if extra:
            raise ValueError(f"{where}: inputs or outputs {', '.join(map(repr, extra))} are not "
                             f"supported (takes {op.inputs} inputs, {op.outputs} output)")
        for name in (*node.input, *node.output):
            if name and types.get(name, 1) not in DTYPES:
                raise ValueError(f"{where}: {name!r} is {type_name(types[name])}, not one of "
                                 f"{taken}")
