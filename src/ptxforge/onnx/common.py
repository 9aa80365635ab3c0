"""What the builder (``builder.py``), the op table (``ops.py``) and the subgraph lowerings
(``subgraphs.py``) share: the element types the front end takes, ``Sizes`` (integers known
when the graph is built up to tensor sizes), and the names of an ONNX model's domains,
opsets, nodes and types. It imports none of them: the builder looks the lowerings up, and
they get the builder as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ONNX element types the front end takes, as torch dtypes.
DTYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 7: torch.int64,
          6: torch.int32, 9: torch.bool}


def opsets(model) -> dict:
    """Domain -> the model's opset for it; the default domain as "" however it is spelled."""
    return {domain(entry.domain): entry.version for entry in model.opset_import}


def domain(name: str) -> str:
    return "" if name in ("", "ai.onnx") else name


def node_name(node) -> str:
    """A node's name, or (ONNX names are optional) its first output's."""
    return node.name or node.output[0]


def type_name(elem_type: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type)


@dataclass(frozen=True)
class Sizes:
    """An integer value known when the graph is built up to tensor sizes: 0-D (``scalar``)
    or 1-D, its items Python ints or FX nodes computing ints."""
    items: tuple
    scalar: bool = False
    dtype: torch.dtype = torch.int64
