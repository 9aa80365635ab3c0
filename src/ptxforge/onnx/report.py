"""Which ONNX nodes became which kernels: the compile report (``compiler/report.py``) of
an ONNX model loaded on the meta device (shapes, no weights read), with each rewrite's
Dynamo nodes traced back to the ONNX nodes they were lowered from.

    ptxforge onnx-report model.onnx [--bf16] [--arch sm_90a]
"""

from __future__ import annotations

import os

import torch

from ..models import Case
from .builder import load
from .common import DTYPES

# ONNX nodes of a match shown by name up to this many; more: the first and the last.
SHOWN = 3


def onnx_case(model, *, dtype=torch.bfloat16, device="meta"):
    """The ONNX model as a ``models.Case``: loaded with ``dtype`` on ``device``,
    called on inputs whose named (dynamic) dimensions are the token count."""
    module = load(model, dtype=dtype, device=device)

    def inputs(tokens, device):
        tensors = []
        for _, info in module.onnx_inputs:
            shape = [d.dim_value if d.HasField("dim_value") else tokens for d in info.shape.dim]
            tensors.append(torch.zeros(shape, dtype=DTYPES[info.elem_type], device=device))
        return tuple(tensors), {}

    name = os.path.basename(os.fspath(model)) if not hasattr(model, "graph") else model.graph.name
    return Case(name, module, inputs, hidden=0)


def onnx_nodes(module, graph, names: str) -> list[str]:
    """The ONNX nodes behind a plan entry's Dynamo nodes (comma-separated names)."""
    found = []
    for name in names.split(", "):
        origin = module.onnx_origin.get(graph.sources.get(name, ""), "")
        found += [n for n in origin.split(", ") if n and n not in found]
    return found


def shown(nodes: list[str]) -> str:
    if len(nodes) <= SHOWN:
        return ", ".join(nodes) or "-"
    return f"{nodes[0]} .. {nodes[-1]} ({len(nodes)} nodes)"


def onnx_report(model, arch, *, fp8: bool = True, tokens: int = 64):
    """(title, rows [rewrite, ONNX nodes, runs on, detail], summary, kernel rows) for a
    table printer: ``compiler.report``'s tables for the model loaded in bf16 on the meta
    device, the plan's nodes as the ONNX nodes they came from."""
    from ..compiler import report

    case = onnx_case(model)
    graphs = report.trace(case, arch, fp8=fp8, tokens=tokens)
    title, _, summary, kernel_rows = report.report_tables(case, graphs, arch)
    rows, lowered = [], set()
    for graph in graphs:
        for item in graph.plan:
            nodes = onnx_nodes(case.model, graph, item.node)
            if (item.operator or "").startswith("ptxforge."):
                lowered.update(nodes)
            rows.append([item.rewrite, shown(nodes), item.operator or "Inductor", item.reason])
    total = len({n for origin in case.model.onnx_origin.values() for n in origin.split(", ") if n})
    summary += (f"; {len(lowered)} of the {total} ONNX nodes computed at run time are in "
                f"ptxforge kernels, the rest with Inductor")
    return title, rows, summary, kernel_rows
