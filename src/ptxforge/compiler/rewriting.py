"""What every pass of the graph compiler works with: the graph under rewrite (``Graph``: node
values, the model's static tensors, the making of nodes and constants), the operation a
node performs whatever the model's spelling (``kind``), and the plan's record of each
rewrite (``Replacement``). ``passes.py`` and ``moe.py`` build on it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .. import ops  # noqa: F401  registers torch.ops.ptxforge

_F = torch.nn.functional
PTXFORGE = torch.ops.ptxforge

# What the model may have written for each operation: functions and method names.
_SPELLINGS = {
    "linear": (torch._C._nn.linear, _F.linear),
    "rms_norm": (torch.rms_norm, _F.rms_norm),
    "add": (operator.add, torch.add, "add"),
    "mul": (operator.mul, torch.mul, "mul"),
    "silu": (_F.silu, "silu"),
    "rsqrt": (torch.rsqrt, "rsqrt"),
    "pow": (operator.pow, torch.pow, "pow"),
    "mean": (torch.mean, "mean"),
    "to": ("to", "float"),
    "expand": ("expand",),
    "reshape": ("reshape", "view"),
    "item": ("item",),
    "sdpa": (torch._C._nn.scaled_dot_product_attention, _F.scaled_dot_product_attention),
}
_KIND = {(spelling if isinstance(spelling, str) else id(spelling)): kind
         for kind, spellings in _SPELLINGS.items() for spelling in spellings}


@dataclass(frozen=True)
class Replacement:
    """One rewrite a pass made or left undone: which (``rewrite``: "linear", "residual
    add", "causal attention", ...), the nodes it covers, what runs instead (the ptxforge
    operator, or None where they stay with Inductor) and why."""
    rewrite: str
    node: str
    operator: str | None
    reason: str


def kind(node) -> str | None:
    """The operation a node performs, by the table above (None: another one)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function":
        return _KIND.get(id(node.target))
    if node.op == "call_method":
        return _KIND.get(node.target)
    return None


def traced_size(size) -> int:
    """A size of the traced example: a symbolic one (the token count) by its value then."""
    return size if isinstance(size, int) else int(size.node.hint)


def token_dims(x: torch.Tensor) -> list[int]:
    """The dimensions of a model's input tensor that change with the tokens: every one
    longer than 1 (a dimension of 1, a batch of one, stays static), but a floating-point
    tensor's last (its features: hidden states [tokens, hidden], [batch, tokens, hidden];
    token ids and masks [batch, tokens] have no feature dimension)."""
    features = 1 if x.is_floating_point() else 0
    return [d for d in range(x.dim() - features) if x.shape[d] > 1]


def is_static(node, example) -> bool:
    """Dynamo lifts parameters and buffers to placeholders it marks static."""
    marked = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None
    return isinstance(example, torch.nn.Parameter) or marked


class Graph:
    """The graph module under rewrite: node values, the model's static tensors (its
    parameters and buffers, by placeholder), and the making of nodes and constants."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs):
        self.gm, self.graph = gm, gm.graph
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.inputs = dict(zip(placeholders, example_inputs))
        self.static = {n: e for n, e in self.inputs.items() if is_static(n, e)}
        fakes = (n.meta.get("example_value") for n in gm.graph.nodes)
        self.fake_mode = next((v.fake_mode for v in fakes if hasattr(v, "fake_mode")), None)
        self.folded: list[torch.Tensor] = []   # parameters copied into the graph's constants
        # Linears kept as the model wrote them, with the reason (a MoE router's: moe.py)
        self.kept: dict[torch.fx.Node, str] = {}

    @staticmethod
    def value(node):
        """What the node computes, as traced (a fake tensor), or the argument itself."""
        return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node

    def tensor(self, node):
        """The real tensor behind a static placeholder, or None."""
        return self.static.get(node)

    def number(self, node):
        """A Python number: the argument itself, or ``t.item()`` of a one-element input
        tensor (some torch versions lift a module's float attributes, an RMSNorm's eps, to
        such inputs), read when the graph is compiled like the weights."""
        if isinstance(node, (int, float)):
            return node
        if kind(node) == "item":
            value = self.inputs.get(node.args[0])
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return value.item()
        return None

    def constant(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        """A tensor the pass made, as a buffer of the module read by a get_attr node.
        AOTAutograd asks Dynamo where every buffer came from (``_param_name_to_source``):
        a pass's own buffers get a source of their own, a constant's."""
        from torch._dynamo.source import ConstantSource

        self.gm.register_buffer(name, value)
        sources = getattr(self.gm, "_param_name_to_source", None)
        if sources is not None:
            sources[name] = ConstantSource(name)
        node = self.graph.get_attr(name)
        node.meta["example_value"] = self._fake(value)
        return node

    def call(self, target, args, kwargs=None) -> torch.fx.Node:
        """A call_function node (at the graph's insertion point) with its example value."""
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        fake = lambda a: self.value(a) if isinstance(a, torch.fx.Node) else a
        with self.fake_mode or torch._subclasses.fake_tensor.FakeTensorMode():
            node.meta["example_value"] = target(*map(fake, args),
                                                **{k: fake(v) for k, v in (kwargs or {}).items()})
        return node

    def _fake(self, value: torch.Tensor):
        if self.fake_mode is None or isinstance(value, torch._subclasses.FakeTensor):
            return value
        return self.fake_mode.from_tensor(value, static_shapes=True)


def gpu_arch(weight: torch.Tensor, arch_of) -> tuple:
    """(the description of the GPU ``weight`` is on, None), or (None, why the kernels cannot
    run there: a CPU weight, a GPU without a description)."""
    if weight.device.type not in ("cuda", "meta"):
        return None, f"the weight is on {weight.device}"
    arch = arch_of(weight.device)
    return (None, arch) if isinstance(arch, str) else (arch, None)


def ancestors(node) -> list:
    """The nodes ``node`` is computed from, and itself, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]
