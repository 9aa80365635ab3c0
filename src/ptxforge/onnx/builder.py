"""An ONNX model -> a ``torch.fx.GraphModule`` computing what the graph computes.

Each ONNX value becomes one of three things while the graph is built:

    a tensor      an FX node, computed when the module runs (its dtype is tracked)
    a constant    a CPU tensor known now: a small initializer, a Constant, or what an op
                  computed from constants alone (folded here)
    Sizes         integers known now up to tensor sizes: Shape's output and what Gather,
                  Slice, Concat, Unsqueeze, Squeeze, Reshape, Cast and integer arithmetic
                  make of it; each item a Python int or an FX node computing one
                  (``x.size(1)``, ``operator.add``), which Dynamo traces as a SymInt

so Reshape, Expand, Range and Slice take Python ints and SymInts, the dynamic axes stay
dynamic, and Dynamo traces the module without graph breaks. Float initializers with more
than one element become parameters of the module, the larger integer ones buffers; names
are the ONNX ones made identifiers (``module.onnx_names``), and every FX node records
the ONNX nodes it came from (``module.onnx_origin``, for the report).

Nothing runs before every node has been checked against the op table (``ops.py``): an
op, version, attribute or dtype the table does not take is a ValueError naming the node.
"""

from __future__ import annotations

import os
import re

import torch

from . import ops, subgraphs
from .common import DTYPES, Sizes, domain, node_name, opsets

# Integer and bool initializers up to this many elements are constants of the graph
# (shapes, axes, indices); larger ones are buffers.
SMALL = 1024


class Builder:
    """The FX graph under construction, the ONNX values it holds so far and what the op
    lowerings need of them (``ops.py`` and ``subgraphs.py`` call these methods)."""

    def __init__(self, model, value_info, *, dtype, device, base_dir):
        self.onnx_graph = model.graph
        self.compute_dtype, self.device, self.base_dir = dtype, device, base_dir
        self.opsets = opsets(model)
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.values: dict = {}
        self.dtypes: dict = {}          # tensor node -> torch dtype
        self.origin: dict = {}          # FX node name -> names of the ONNX nodes it lowers
        self.onnx_names: dict = {}      # attribute of the module -> ONNX initializer name
        self.initializers = {t.name: t for t in self.onnx_graph.initializer}
        graph = self.onnx_graph
        self.infos = {v.name: v.type.tensor_type for v in
                      [*value_info, *graph.input, *graph.output, *graph.value_info]
                      if v.type.HasField("tensor_type")}
        self.producers = {out: n for n in self.onnx_graph.node for out in n.output}
        self.position = {id(n): i for i, n in enumerate(self.onnx_graph.node)}
        self.consumers: dict = {}
        for n in self.onnx_graph.node:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.params: dict = {}          # (ONNX name, dtype, transposed) -> get_attr node
        self.sizes: dict = {}           # (node, dim) -> int or x.size(dim) node
        self.made: dict = {}            # id of a constant or Sizes -> (it, its node)
        self.current: list = []         # the ONNX nodes being lowered
        self._device_node = None

    def fail(self, node, what: str):
        opset = self.opsets.get(domain(node.domain), 0)
        raise ValueError(f"ptxforge.onnx: node {node_name(node)!r} ({node.op_type}, opset "
                         f"{opset}): {what}")

    # --- FX nodes ------------------------------------------------------------------------
    def call(self, target, *args, result=None, name=None, **kwargs):
        """``target(*args, **kwargs)``: computed now when no argument is an FX node (a
        constant folded), else an FX node (``node``)."""
        if not _holds_node((args, kwargs)):
            if isinstance(target, str):
                return getattr(args[0], target)(*args[1:], **kwargs)
            return target(*args, **kwargs)
        return self.node(target, args, kwargs, result=result, name=name)

    def node(self, target, args, kwargs=None, *, result=None, name=None):
        """An FX node calling ``target`` (a method for a string) on ``args`` (constant
        tensors among them made nodes), named after the ONNX node being lowered (or
        ``name``), its dtype ``result``, else the ``dtype`` it is given, else its first
        tensor argument's."""
        op = "call_method" if isinstance(target, str) else "call_function"
        args, kwargs = torch.fx.node.map_aggregate(
            (tuple(args), kwargs or {}),
            lambda a: self.as_node(a) if isinstance(a, torch.Tensor) else a)
        node = self.graph.create_node(op, target, args, kwargs, name=name or self._name())
        self.origin[node.name] = ", ".join(node_name(n) for n in self.current)
        dtype = result or (kwargs or {}).get("dtype") or next(
            (self.dtypes[a] for a in _nodes((args, kwargs)) if a in self.dtypes), None)
        if isinstance(dtype, torch.dtype):
            self.dtypes[node] = dtype
        return node

    def _name(self) -> str:
        return identifier(self.current[-1].output[0]) if self.current else "value"

    def device_node(self):
        """The device the module runs on, read off its first input (a constant to Dynamo);
        None (the default device) for a graph without inputs."""
        first = next((n for n in self.graph.nodes if n.op == "placeholder"), None)
        if self._device_node is None and first is not None:
            self._device_node = self.graph.create_node("call_function", getattr,
                                                       (first, "device"), name="device")
        return self._device_node

    # --- values --------------------------------------------------------------------------
    def value(self, name: str):
        """The value ``name`` holds: an FX node, a constant tensor, Sizes, or None (an
        omitted optional input)."""
        if not name:
            return None
        if name not in self.values:
            self.values[name] = self._initializer(name)
        return self.values[name]

    def _initializer(self, name: str):
        proto = self.initializers[name]
        dtype = DTYPES[proto.data_type]
        count = _count(proto.dims)
        if count <= 1 or (not dtype.is_floating_point and count <= SMALL):
            return self.read(proto)
        if dtype.is_floating_point:
            return self.parameter(name)
        attr = self._attribute(name)
        self.root.register_buffer(attr, self.read(proto, self.device))
        return self._get_attr(attr, dtype)

    def read(self, proto, device="cpu") -> torch.Tensor:
        """An initializer's (or a tensor attribute's) tensor on ``device``; on the meta
        device, only its shape and dtype. External data is read from ``base_dir`` alone, and
        never by a module built on the meta device (the report's), which reads no tensor
        data: a constant it needs whose data is in a file is an error."""
        dtype = DTYPES[proto.data_type]
        if torch.device(device).type == "meta":
            return torch.empty(tuple(proto.dims), dtype=dtype, device="meta")
        import numpy as np
        from onnx import checker, external_data_helper, numpy_helper

        if external_data_helper.uses_external_data(proto):
            where = f"ptxforge.onnx: tensor {proto.name!r} has its data in an external file"
            if torch.device(self.device).type == "meta":
                raise ValueError(f"{where}, which a load on the meta device does not read; the "
                                 f"graph needs its value when it is built")
            if self.base_dir is None:
                raise ValueError(f"{where}, and the model was given as a ModelProto without "
                                 f"base_dir, the folder that file is in")
            try:
                array = numpy_helper.to_array(proto, self.base_dir)
            except (OSError, checker.ValidationError) as exc:   # absent, outside base_dir
                raise ValueError(f"{where} that cannot be read: {exc}") from None
        else:
            array = numpy_helper.to_array(proto)
        if dtype == torch.bfloat16:   # numpy has no bfloat16: its bits
            return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16).copy()) \
                .view(torch.bfloat16).reshape(tuple(proto.dims)).to(device)
        return torch.from_numpy(np.array(array)).reshape(tuple(proto.dims)).to(device)

    def parameter(self, name: str, *, weight: bool = False, transposed: bool = False):
        """The float initializer ``name`` as a parameter of the module (a get_attr node):
        in the load's dtype where it is a ``weight`` (of a Linear, an embedding table, a
        norm's scale), else in its own; ``transposed``: its transpose, stored contiguous
        (a MatMul's B [K, N] as a Linear's weight [N, K])."""
        proto = self.initializers[name]
        dtype = DTYPES[proto.data_type]
        if weight and self.compute_dtype is not None and dtype == torch.float32:
            dtype = self.compute_dtype
        key = (name, dtype, transposed)
        if key not in self.params:
            tensor = self.read(proto, self.device)
            if transposed:
                tensor = tensor.t()
            tensor = tensor.to(dtype).contiguous()
            attr = self._attribute(name + ("_t" if transposed else ""))
            self.root.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
            self.params[key] = self._get_attr(attr, dtype)
            self.onnx_names[attr] = name
        return self.params[key]

    def is_parameter(self, name: str) -> bool:
        """Whether ``name`` is a float initializer that ``parameter`` takes."""
        proto = self.initializers.get(name)
        return (proto is not None and DTYPES.get(proto.data_type, torch.int64).is_floating_point
                and _count(proto.dims) > 1)

    def _attribute(self, name: str) -> str:
        """A new attribute name for the module, after ``name``: none a GraphModule or the
        loaded module (``onnx_*``) has already."""
        attr = identifier(name)
        while hasattr(self.root, attr) or hasattr(torch.fx.GraphModule, attr) \
                or attr in ("onnx_names", "onnx_origin", "onnx_inputs"):
            attr += "_"
        return attr

    def _get_attr(self, attr: str, dtype):
        node = self.graph.get_attr(attr)
        self.dtypes[node] = dtype
        return node

    def tensor(self, name: str):
        """``name`` as an FX node (a constant or Sizes made a tensor on the module's
        device)."""
        return self.as_node(self.value(name))

    def data(self, name: str):
        """``name`` as a tensor: a constant as it is (what it takes part in is folded), else
        a node."""
        value = self.value(name)
        return value if isinstance(value, torch.Tensor) else self.as_node(value)

    def as_node(self, value):
        """A value as an FX node: a constant or Sizes made a tensor on the module's device
        (``torch.full`` where every element is one value, else ``torch.tensor(...).to``:
        Dynamo cannot trace ``torch.tensor(..., device=)`` onto the meta device)."""
        if isinstance(value, torch.fx.Node):
            return value
        if id(value) not in self.made:   # (the value kept beside its node: ids stay unique)
            self.made[id(value)] = value, self._made(value)
        return self.made[id(value)][1]

    def _made(self, value):
        device = self.device_node()
        if isinstance(value, Sizes):
            items = value.items[0] if value.scalar else list(value.items)
        elif value.numel() > 0 and bool((value == value.reshape(-1)[0]).all()):
            return self.node(torch.full, (tuple(value.shape), value.reshape(-1)[0].item()),
                             {"dtype": value.dtype, "device": device}, name="constant")
        else:
            items = value.tolist()
        made = self.node(torch.tensor, (items,), {"dtype": value.dtype}, name="constant")
        return made if device is None else self.node("to", (made, device), name="constant")

    def operand(self, name: str):
        """``name`` for an elementwise op: a 0-D constant as a Python number, else a node."""
        value = self.value(name)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return value.item()
        if isinstance(value, Sizes) and value.scalar:
            return value.items[0]
        return self.as_node(value)

    def constant(self, name: str):
        """The constant ``name`` holds, or None (a tensor of the run, or Sizes)."""
        value = self.value(name)
        return value if isinstance(value, torch.Tensor) else None

    def ints(self, node, index: int, what: str) -> tuple:
        """Input ``index`` of ``node`` as a tuple of ints and int nodes (a 0-D value as a
        1-tuple): it must be known when the graph is built."""
        value = self.value(node.input[index])
        if isinstance(value, Sizes):
            return value.items
        if isinstance(value, torch.Tensor):
            return tuple(int(v) for v in value.reshape(-1).tolist())
        self.fail(node, f"input {index} ({what}, {node.input[index]!r}) must be known when the "
                        f"graph is built (a constant, or computed from shapes), got a tensor "
                        f"computed at run time")

    def dtype(self, value):
        """The torch dtype of a value (a Python number: None)."""
        if isinstance(value, torch.fx.Node):
            return self.dtypes.get(value)
        if isinstance(value, (torch.Tensor, Sizes)):
            return value.dtype
        return None

    def rank(self, node, name: str) -> int:
        value = self.value(name)
        if isinstance(value, torch.Tensor):
            return value.dim()
        if isinstance(value, Sizes):
            return 0 if value.scalar else 1
        if value.op == "get_attr":
            return getattr(self.root, value.target).dim()
        info = self.infos.get(name)
        if info is None or not info.HasField("shape"):
            self.fail(node, f"needs the rank of {name!r}, which the model's value_info and "
                            f"ONNX shape inference do not give")
        return len(info.shape.dim)

    def size(self, name: str, dim: int):
        """Dimension ``dim`` of tensor ``name``: an int where the graph fixes it, else an
        ``x.size(dim)`` node (made once per dimension)."""
        value = self.value(name)
        if isinstance(value, torch.Tensor):
            return value.shape[dim]
        if isinstance(value, torch.fx.Node) and value.op == "get_attr":
            return getattr(self.root, value.target).shape[dim]
        info = self.infos.get(name)
        if info is not None and info.HasField("shape"):
            dim %= len(info.shape.dim)
            if info.shape.dim[dim].HasField("dim_value"):
                return info.shape.dim[dim].dim_value
        node = self.as_node(value)
        if (node, dim) not in self.sizes:
            self.sizes[(node, dim)] = self.call("size", node, dim, name="size")
        return self.sizes[(node, dim)]

    def common(self, *values):
        """``values`` with one float type: float32 ones beside another float type take
        it (with ``dtype=bf16``, what stayed float32, a rotary embedding's angles, meets
        the bf16 activations as transformers' ``cos.to(x.dtype)``)."""
        floats = {self.dtype(v) for v in values} - {None}
        floats = {d for d in floats if d.is_floating_point}
        if len(floats) < 2:
            return values
        target = next(d for d in floats if d != torch.float32)
        return tuple(self.call("to", v, target, result=target, name="cast")
                     if isinstance(v, torch.fx.Node) and self.dtypes.get(v) == torch.float32
                     else v for v in values)

    @staticmethod
    def attributes(node) -> dict:
        from onnx import helper

        return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def identifier(name: str) -> str:
    """An ONNX name as a Python identifier (the module's attribute, the FX node's name)."""
    name = re.sub(r"\W", "_", name)
    return name if name and not name[0].isdigit() else "v_" + name


def _count(dims) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def _nodes(tree):
    if isinstance(tree, torch.fx.Node):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _nodes(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _nodes(item)
    elif isinstance(tree, slice):
        yield from _nodes((tree.start, tree.stop, tree.step))


def _holds_node(tree) -> bool:
    return next(_nodes(tree), None) is not None


# --- the model ---------------------------------------------------------------------------

def _read_model(model, base_dir):
    """(ModelProto without its external data read, the directory external data is read
    from: ``base_dir``, else a file's own folder, else None: none is read)."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(model, onnx.ModelProto):
        return model, base_dir
    path = os.fspath(model)
    try:
        proto = onnx.load(path, load_external_data=False)
    except OSError as exc:
        raise ValueError(f"ptxforge.onnx: cannot read {path}: {exc.strerror}") from None
    except DecodeError as exc:
        raise ValueError(f"ptxforge.onnx: {path} is not an ONNX model ({exc})") from None
    if not proto.HasField("graph") or not proto.opset_import:
        raise ValueError(f"ptxforge.onnx: {path} is not an ONNX model (no graph or no opset)")
    return proto, base_dir if base_dir is not None else os.path.dirname(os.path.abspath(path))


def _with_shapes(model):
    """The value_info ONNX shape inference finds for ``model`` (ranks, static sizes). It
    gets the graph without the large initializers' data, those as typed graph inputs (a
    proto stays far below 2 GB whatever the model's size); a graph inference cannot take
    keeps the value_info it has."""
    import onnx

    graph = model.graph
    small = [t for t in graph.initializer if _count(t.dims) <= SMALL]
    large = [onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
             for t in graph.initializer if _count(t.dims) > SMALL]
    structure = onnx.helper.make_model(
        onnx.helper.make_graph(graph.node, graph.name, [*graph.input, *large], graph.output,
                               small, value_info=graph.value_info),
        opset_imports=model.opset_import, functions=model.functions,
        ir_version=model.ir_version)
    try:
        return onnx.shape_inference.infer_shapes(structure).graph.value_info
    except Exception:   # a help (ranks, static sizes), not a requirement
        return graph.value_info


def load(model, *, dtype: torch.dtype | None = None, device="cpu",
         base_dir=None) -> torch.fx.GraphModule:
    """``model`` (a path to an .onnx file, or a ModelProto) as a ``torch.fx.GraphModule``
    whose forward takes the graph's inputs in order and returns its output (a tuple if
    several). External data (weights, or any tensor of the graph) is read from
    ``base_dir``: by default the file's own folder; a ModelProto's only where given (a
    ModelProto that ``onnx.load`` read whole holds its data already).

    ``dtype`` (e.g. torch.bfloat16): the type the graph's float32 computes in: weights
    (Linears', embedding tables, norms' scales) are stored in it and float inputs cast to
    it; values computed in float32 from integers and from float initializers that are no
    weights (a rotary embedding's inverse frequencies, hence its angles) stay float32
    until they meet a value of ``dtype``, which they are cast to. ``device``:
    where the parameters are made ("meta": shapes only, no data read, for a report)."""
    model, base_dir = _read_model(model, None if base_dir is None else os.fspath(base_dir))
    inferred = _with_shapes(model)
    ops.validate(model, inferred)
    builder = Builder(model, inferred, dtype=dtype, device=device, base_dir=base_dir)
    initializer_names = set(builder.initializers)
    for graph_input in model.graph.input:
        if graph_input.name in initializer_names:
            continue
        node = builder.graph.placeholder(identifier(graph_input.name))
        elem = DTYPES[graph_input.type.tensor_type.elem_type]
        builder.dtypes[node] = elem
        if dtype is not None and elem == torch.float32:
            builder.current = []
            node = builder.call("to", node, dtype, result=dtype)
        builder.values[graph_input.name] = node
    lowered = subgraphs.Lowerings(builder)
    for node in model.graph.node:
        builder.current = [node]
        outputs = lowered.emit(node) or ops.emit(builder, node)
        for name, value in zip(node.output, outputs):
            if name:
                builder.values[name] = value
    builder.current = []
    results = [builder.tensor(out.name) for out in model.graph.output]
    builder.graph.output(results[0] if len(results) == 1 else tuple(results))
    builder.graph.eliminate_dead_code()
    module = torch.fx.GraphModule(builder.root, builder.graph, class_name="OnnxModule")
    module.onnx_names = builder.onnx_names
    module.onnx_origin = {n.name: builder.origin[n.name] for n in module.graph.nodes
                          if n.name in builder.origin}
    module.onnx_inputs = [(i.name, i.type.tensor_type) for i in model.graph.input
                          if i.name not in initializer_names]
    return module
