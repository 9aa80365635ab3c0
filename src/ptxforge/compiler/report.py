"""What the backend would do to a model, worked out without a GPU: the model is built on
the meta device (shapes, no data), Dynamo traces it, the passes run for a given target
(``sm_90a`` by default) and nothing is compiled or launched.

    ptxforge compile-report --model llama-8b --layers 2
    ptxforge precompile --model llama-8b --tokens 16384     # the same plan, then assembly
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from . import passes, precompile
from .backend import mark_token_dims
from .rewriting import Replacement


@dataclass
class GraphPlan:
    """One graph Dynamo made of the model: the plan, the kernels of its ptxforge nodes
    (node name -> Gemm / Row descriptors), and for each node Dynamo traced out of a
    ``torch.fx.GraphModule`` (an ONNX model's, ``ptxforge.onnx``) the name of the node of
    that module it comes from (``sources``)."""
    plan: list[Replacement]
    kernels: dict[str, tuple]
    sources: dict[str, str] = field(default_factory=dict)


# A frame of the code torch.fx generates for a GraphModule, and the line it runs there.
_FX_FRAME = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in forward\n\s*(\w+) = ')


def fx_sources(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Node name -> the variable the innermost frame of FX-generated code in its stack
    trace assigns: the name of the node of the traced GraphModule that made it."""
    sources = {}
    for node in gm.graph.nodes:
        frames = _FX_FRAME.findall(node.meta.get("stack_trace") or "")
        if frames:
            sources[node.name] = frames[-1]
    return sources


def trace(case, arch, *, fp8: bool = True, tokens: int = 64) -> list[GraphPlan]:
    """The passes' plan for ``case`` (a ``ptxforge.models.Case`` built on the meta device)
    on ``arch``: one GraphPlan per graph."""
    graphs = []

    def backend(gm, example_inputs):
        sources = fx_sources(gm)
        plan = passes.rewrite(gm, example_inputs, fp8=fp8, arch_of=lambda device: arch)
        graphs.append(GraphPlan(plan, precompile.kernels_of(gm.graph), sources))
        return gm.forward

    args, kwargs = case.inputs(tokens, "meta")
    with torch.no_grad():
        mark_token_dims(args, kwargs)    # as ptxforge.compile does
        torch.compile(case.model, backend=backend)(*args, **kwargs)
    return graphs


def kernels(graphs: list[GraphPlan]) -> list:
    """Every distinct kernel descriptor of the graphs, in graph order."""
    return list(dict.fromkeys(k for g in graphs for ks in g.kernels.values() for k in ks))


def report_tables(case, graphs: list[GraphPlan], arch, token_counts=(1, 64, 2048, 16384)):
    """(title, the plan's rows, a summary line, the kernels' rows: each GEMM's tile by token
    count, each row kernel's config) for a table printer."""
    plan = [[item.rewrite, item.node, item.operator or "Inductor", item.reason]
            for g in graphs for item in g.plan]
    linears = [item for g in graphs for item in g.plan if "linear" in item.rewrite]
    taken = sum(len(item.node.split(", ")) for item in linears if item.operator)
    total = sum(len(item.node.split(", ")) for item in linears)
    summary = f"{taken} of {total} Linears on ptxforge GEMMs"
    gemms = [k for g in graphs for found in g.kernels.values() for k in found
             if isinstance(k, precompile.GemmKernel)]
    if gemms:
        weights = sum(gemm.weight_bytes for gemm in gemms)
        summary += (f"; their weights: {weights / 1e6:.0f} MB a call, at least "
                    f"{weights / arch.device.memory_bandwidth_gbs / 1e3:.1f} us at "
                    f"{arch.device.name}'s nominal {arch.device.memory_bandwidth_gbs:.0f} GB/s")
    rows = []
    for kernel in kernels(graphs):
        configs = [kernel.config(arch, m) for m in token_counts]
        names = [cfg.name for cfg in configs]
        if isinstance(kernel, precompile.GemmKernel):   # the tile, after the problem's sizes
            names = [cfg.name.split(f"_k{cfg.k}_", 1)[-1] for cfg in configs]
        tiles = [name if i == 0 or name != names[i - 1] else "same"
                 for i, name in enumerate(names)]
        rows.append([str(kernel), *tiles])
    title = f"{case.name} on {arch.target}: {len(graphs)} graph(s)"
    return title, plan, summary, rows
