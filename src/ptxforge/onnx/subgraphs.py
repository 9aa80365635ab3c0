"""Subgraphs of the ONNX graph lowered as a whole, to the torch calls the backend's passes
match (``compiler/passes.py``), so that an exported model gets the same kernels as the
model it was exported from:

    MatMul(x, B), B a float initializer [K, N]       -> F.linear(x, W), W = B^T [N, K] a
                                                        parameter (a Linear)
    Add(MatMul(x, B), b), b a float initializer [N]  -> F.linear(x, W, b) (a Linear with
                                                        bias: Qwen's q, k, v)
    Gemm(A, B, C), B a float initializer             -> F.linear(A', W, C) (transA, transB;
                                                        alpha and beta as Gemm applies them)
    Mul(w, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps)))))
      (or x / Sqrt(...); w a 1-D initializer, or none;  -> torch.rms_norm(x, (H,), w, eps)
      a bf16 model's: x cast to float32 and back)
    Mul(x, Sigmoid(x))                               -> F.silu(x)
    MatMul(Where(IsNaN(p), 0, p), v), p = Softmax(MatMul(q * a, kT * b) + Where(m, 0, -inf))
                                                     -> F.scaled_dot_product_attention(q, k,
                                                        v, attn_mask=m, scale=a * b)

(what torch.onnx.export writes for transformers' Linear, LlamaRMSNorm, SiLU and SDPA at
opset 18). The nodes inside a match are lowered too, as they come, and dropped with the
graph's dead code when nothing else reads them. One difference: a row the mask hides
entirely, which the exporter's graph makes 0 (``Where(IsNaN)``) or the mean of v (a
finite mask), is NaN in SDPA; causal and padding masks hide no row entirely.
"""

from __future__ import annotations

import torch

from . import ops
from .common import DTYPES

_F = torch.nn.functional


class Lowerings:
    """The matchers, by the op type of the node a match ends at."""

    def __init__(self, b):
        self.b = b
        self.by_op = {"MatMul": (self.attention, self.linear), "Gemm": (self.gemm,),
                      "Add": (self.biased_linear,), "Mul": (self.rms_norm, self.silu),
                      "Div": (self.rms_norm,)}

    def emit(self, node) -> list | None:
        """The outputs of ``node`` lowered with the subgraph it ends, or None (no match)."""
        for matcher in self.by_op.get(node.op_type, ()):
            out = matcher(node)
            if out is not None:
                return out
        return None

    def producer(self, name: str, *op_types):
        node = self.b.producers.get(name)
        return node if node is not None and node.op_type in op_types else None

    def number(self, name: str):
        """The Python number a 0-D or one-element constant holds, or None."""
        value = self.b.constant(name) if name else None
        return value.reshape(-1)[0].item() if value is not None and value.numel() == 1 else None

    def cover(self, nodes) -> None:
        """The match's nodes: the origin of the FX nodes made for it from now on."""
        self.b.current = sorted(nodes, key=lambda n: self.b.position[id(n)])

    # --- Linear ----------------------------------------------------------------------------
    def matrix(self, name: str) -> bool:
        """Whether ``name`` is a float initializer [K, N] (a Linear's weight, transposed)."""
        return self.b.is_parameter(name) and len(self.b.initializers[name].dims) == 2

    def linear(self, node, bias: str | None = None):
        b = self.b
        x, weight = node.input
        if not self.matrix(weight):
            return None
        x, w = b.common(b.tensor(x), b.parameter(weight, weight=True, transposed=True))
        bias = [b.parameter(bias, weight=True)] if bias else []
        return [b.call(_F.linear, x, w, *bias)]

    def biased_linear(self, node):
        b = self.b
        for product, bias in (node.input, reversed(node.input)):
            matmul = self.producer(product, "MatMul")
            if matmul is None or not self.matrix(matmul.input[1]) or not b.is_parameter(bias):
                continue
            n = b.initializers[matmul.input[1]].dims[1]
            if len(b.consumers[product]) == 1 and tuple(b.initializers[bias].dims) == (n,):
                self.cover([matmul, node])
                return self.linear(matmul, bias)
        return None

    def gemm(self, node):
        b = self.b
        a = b.attributes(node)
        weight = node.input[1]
        if not self.matrix(weight):
            return None
        x = b.tensor(node.input[0])
        if a.get("transA", 0):
            x = b.call("t", x)
        x, w = b.common(x, b.parameter(weight, weight=True, transposed=not a.get("transB", 0)))
        bias = node.input[2] if len(node.input) > 2 else ""
        n = b.initializers[weight].dims[0 if a.get("transB", 0) else 1]
        if (bias and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0
                and b.is_parameter(bias) and tuple(b.initializers[bias].dims) == (n,)):
            return [b.call(_F.linear, x, w, b.parameter(bias, weight=True))]
        return [ops.gemm_epilogue(b, node, b.call(_F.linear, x, w))]

    # --- RMSNorm ---------------------------------------------------------------------------
    def rms_norm(self, node):
        b = self.b
        if node.op_type == "Mul":
            for weight, normed in (node.input, reversed(node.input)):
                if not b.is_parameter(weight) or len(b.initializers[weight].dims) != 1:
                    continue
                found = self.weighted(normed)
                if found is not None:
                    x, eps, nodes = found
                    self.cover([*nodes, node])
                    shape = tuple(b.initializers[weight].dims)
                    x, w = b.common(b.tensor(x), b.parameter(weight, weight=True))
                    return [b.call(torch.rms_norm, x, shape, w, eps)]
        found = self.normalization(node)
        if found is None:
            return None
        x, eps, nodes = found
        self.cover(nodes)
        return [b.call(torch.rms_norm, b.tensor(x), (b.size(x, -1),), None, eps)]

    def weighted(self, normed: str):
        """(x, eps, the nodes) if the scale multiplies ``normed``, a normalization of x, or
        a bf16 / f16 model's ``Cast(normalization of Cast(x, float32), x's type)``."""
        b = self.b
        down = self.producer(normed, "Cast")
        inner = self.producer(down.input[0] if down is not None else normed, "Mul", "Div")
        found = self.normalization(inner) if inner is not None else None
        if found is None or down is None:
            return found
        x, eps, nodes = found
        up = self.producer(x, "Cast")
        if up is None or b.dtype(b.value(up.input[0])) != DTYPES.get(b.attributes(down)["to"]):
            return None
        return up.input[0], eps, [up, *nodes, down]

    def normalization(self, node):
        """(x, eps, the nodes) if ``node`` is ``x * Reciprocal(Sqrt(mean + eps))`` or
        ``x / Sqrt(mean + eps)`` with mean = ReduceMean(Pow(x, 2), [-1], keepdims=1)."""
        if node.op_type == "Div":
            candidates = [(node.input[0], node.input[1], [])]
        else:
            candidates = [(x, reciprocal.input[0], [reciprocal])
                          for x, r in (node.input, reversed(node.input))
                          if (reciprocal := self.producer(r, "Reciprocal")) is not None]
        for x, root_name, reciprocal in candidates:
            root = self.producer(root_name, "Sqrt")
            add = self.producer(root.input[0], "Add") if root is not None else None
            if add is None:
                continue
            for mean_name, eps_name in (add.input, reversed(add.input)):
                eps, mean = self.number(eps_name), self.producer(mean_name, "ReduceMean")
                if eps is not None and mean is not None and self.square_mean(mean, x):
                    square = self.producer(mean.input[0], "Pow")
                    return x, eps, [square, mean, add, root, *reciprocal, node]
        return None

    def square_mean(self, mean, x) -> bool:
        """ReduceMean(Pow(x, 2), [-1], keepdims=1)."""
        b = self.b
        square = self.producer(mean.input[0], "Pow")
        if square is None or square.input[0] != x or self.number(square.input[1]) != 2:
            return False
        axes = b.constant(mean.input[1]) if len(mean.input) > 1 and mean.input[1] else None
        keepdims = b.attributes(mean).get("keepdims", 1)
        if axes is None or axes.numel() != 1 or not keepdims:
            return False
        return int(axes.item()) in (-1, b.rank(mean, x) - 1)

    # --- SiLU ------------------------------------------------------------------------------
    def silu(self, node):
        for x, other in (node.input, reversed(node.input)):
            sigmoid = self.producer(other, "Sigmoid")
            if sigmoid is not None and sigmoid.input[0] == x:
                self.cover([sigmoid, node])
                return [self.b.call(_F.silu, self.b.tensor(x))]
        return None

    # --- attention -------------------------------------------------------------------------
    def attention(self, node):
        b = self.b
        probs, v = node.input
        nodes = [node]
        softmax = self.producer(probs, "Softmax")
        zeroed = self.producer(probs, "Where")
        if zeroed is not None:
            isnan = self.producer(zeroed.input[0], "IsNaN")
            if (isnan is None or isnan.input[0] != zeroed.input[2]
                    or self.number(zeroed.input[1]) != 0):
                return None
            softmax = self.producer(zeroed.input[2], "Softmax")
            nodes += [isnan, zeroed]
        if softmax is None or b.attributes(softmax).get("axis", -1) not in (-1, 3):
            return None
        scores, mask = softmax.input[0], None
        add = self.producer(scores, "Add")
        if add is not None:
            for qk, other in (add.input, reversed(add.input)):
                if self.producer(qk, "MatMul") is not None:
                    scores, mask = qk, other
                    break
        matmul = self.producer(scores, "MatMul")
        if matmul is None or any(b.rank(node, name) != 4 for name in (*matmul.input, v)):
            return None
        nodes += [softmax, matmul] + ([add] if add is not None else [])
        (q, q_scale), (kt, k_scale) = (self.scaled(name, nodes) for name in matmul.input)
        mask = self.boolean_mask(mask, nodes) if mask is not None else None
        k = self.untransposed(kt, nodes)
        self.cover(nodes)
        kwargs = {"scale": q_scale * k_scale}
        q, k, v = b.common(b.tensor(q), self.as_node(k), b.tensor(v))
        if mask is not None:
            mask = b.tensor(mask)
            if b.dtype(mask) != torch.bool:
                q, mask = b.common(q, mask)
            kwargs["attn_mask"] = mask
        return [b.call(_F.scaled_dot_product_attention, q, k, v, **kwargs)]

    def scaled(self, name: str, nodes) -> tuple:
        """(x, a) if ``name`` is x * a with a constant number a, else (name, 1.0)."""
        mul = self.producer(name, "Mul")
        if mul is not None:
            for x, scale in (mul.input, reversed(mul.input)):
                if self.number(scale) is not None:
                    nodes.append(mul)
                    return x, float(self.number(scale))
        return name, 1.0

    def boolean_mask(self, name: str, nodes) -> str:
        """The boolean mask m of an additive ``Where(m, 0, -inf)`` (or the type's minimum
        for -inf), else the additive mask itself."""
        where = self.producer(name, "Where")
        if where is not None and self.number(where.input[1]) == 0:
            fill = self.b.constant(where.input[2])
            if (fill is not None and fill.numel() == 1 and fill.is_floating_point()
                    and fill.item() <= torch.finfo(fill.dtype).min):
                nodes.append(where)
                return where.input[0]
        return name

    def untransposed(self, kt: str, nodes):
        """k of kT = k transposed in its last two dimensions: as the exporter writes it
        (``Transpose(k, [0, 1, 3, 2])``, or a [B * H, T, D] view transposed and viewed as
        [B, H, D, T]), the name of k; else kT's node transposed."""
        b = self.b
        transpose = self.producer(kt, "Transpose")
        if transpose is not None and b.attributes(transpose).get("perm") == [0, 1, 3, 2]:
            nodes.append(transpose)
            return transpose.input[0]
        outer = self.producer(kt, "Reshape")
        transpose = self.producer(outer.input[0], "Transpose") if outer is not None else None
        inner = self.producer(transpose.input[0], "Reshape") if transpose is not None else None
        if inner is not None and b.attributes(transpose).get("perm") == [0, 2, 1]:
            k = inner.input[0]
            if b.rank(inner, k) == 4 and self.known(inner.input[1]) and self.known(outer.input[1]):
                size = [b.size(k, d) for d in range(4)]
                views = b.ints(inner, 1, "shape"), b.ints(outer, 1, "shape")
                if (_same(views[0], (-1, size[2], size[3]))
                        and _same(views[1], (size[0], size[1], size[3], size[2]))):
                    nodes += [inner, transpose, outer]
                    return k
        return b.call("transpose", b.tensor(kt), -2, -1)

    def as_node(self, value):
        return self.b.tensor(value) if isinstance(value, str) else value

    def known(self, name: str) -> bool:
        return not isinstance(self.b.value(name), torch.fx.Node)


def _same(items, expected) -> bool:
    """Item by item: the same int, or the same size node."""
    return len(items) == len(expected) and all(
        a is e or (isinstance(a, int) and isinstance(e, int) and a == e)
        for a, e in zip(items, expected))

