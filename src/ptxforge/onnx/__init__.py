"""The ONNX front end: an ONNX model as a ``torch.nn.Module`` (a ``torch.fx.GraphModule``
built from the graph with the ``onnx`` package), which ``ptxforge.compile`` and the
backend's passes take like any model.

    import ptxforge.onnx
    model = ptxforge.onnx.load("model.onnx")                        # as the graph computes
    model = ptxforge.onnx.load("model.onnx", dtype=torch.bfloat16)  # its float32 in bf16
    out = ptxforge.compile(model.cuda())(ids)

``builder.py`` builds the graph module (``load``: initializers as parameters, shape
arithmetic as Python ints and SymInts), ``ops.py`` holds the op table (ONNX op -> torch
calls, the versions and attributes each lowering takes), ``subgraphs.py`` the subgraphs
lowered as a whole to the calls the passes match (Linear, RMSNorm, SiLU, attention),
``common.py`` what those three share, ``report.py`` which ONNX nodes became which
kernels. docs/graph.md describes the front end.
"""

from .builder import load
from .report import onnx_report

__all__ = ["load", "onnx_report"]
