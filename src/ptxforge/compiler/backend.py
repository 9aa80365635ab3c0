"""The ``ptxforge`` torch.compile backend. Dynamo hands it the model's FX graph with the
parameters as placeholders and their real tensors among the example inputs; each pass
rewrites the graph in place, and Inductor compiles what is left.

    graph from Dynamo --rewrite_linears--> Linear -> ptxforge.fp8_linear (weight quantized
                                           here, once, 128x128 blocks; x per token inside)
                      --Inductor-------->  everything else (attention, elementwise, ...)

A Linear stays with Inductor, with its reason in the plan, unless its weight is a
parameter (a placeholder Dynamo marks static) that is a bf16 [N, K] CUDA tensor of a
problem the GEMM takes on that GPU (its own ``require_problem``: wgmma, TMA, N a multiple
of 8 and K of 16), and x is bf16 on the same device. The
plan (``Replacement`` records) is logged (logger ``ptxforge.compiler``) and kept on the
compiled graph module (``ptxforge_plan``). Weights are read when the graph is compiled:
changing them afterwards needs a new compile (as with any constant folded by a compiler).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .. import ops  # noqa: F401  registers torch.ops.ptxforge
from ..kernels import sm90_gemm as gemm_kernel
from ..ops import _common

log = logging.getLogger("ptxforge.compiler")

LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass(frozen=True)
class Replacement:
    """One pattern instance: what it was (its node), what runs instead (the ptxforge
    operator, or None where it stays with Inductor) and why."""
    pattern: str
    node: str
    operator: str | None
    reason: str


def _static_input(node, example) -> bool:
    """Dynamo lifts parameters and buffers to placeholders it marks static."""
    marked = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None
    return isinstance(example, torch.nn.Parameter) or marked


def _device_arch(device):
    """The description of ``device``, or the reason there is none (a string)."""
    try:
        return _common.device_arch(device.index or 0)
    except (RuntimeError, ValueError) as error:   # no driver, or a GPU not described
        return str(error)


def _unsupported(x, weight, arch_of) -> str | None:
    """Why a Linear of x by weight stays with Inductor, or None. The GEMM's own check of
    the problem (``require_problem``: wgmma, TMA, N and K's alignment) decides for it."""
    if weight is None:
        return "the weight is not a parameter of the model"
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return f"the weight is {weight.dtype} {tuple(weight.shape)}, not a bf16 matrix"
    if weight.device.type != "cuda":
        return f"the weight is on {weight.device}"
    arch = arch_of(weight.device)
    if isinstance(arch, str):
        return arch
    try:
        gemm_kernel.require_problem(arch, *weight.shape)
    except ValueError as error:
        return str(error)
    if x is None or x.dtype != torch.bfloat16 or x.device != weight.device:
        return f"x is {getattr(x, 'dtype', None)} on {getattr(x, 'device', None)}, not bf16 there"
    return None


def _add_constant(gm, name: str, value) -> None:
    """A buffer of ``gm`` the pass made. AOTAutograd asks Dynamo where every buffer of its
    graph came from (``_param_name_to_source``): a pass's own buffers get a source of their
    own, a constant's."""
    from torch._dynamo.source import ConstantSource

    gm.register_buffer(name, value)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = ConstantSource(name)


def rewrite_linears(gm: torch.fx.GraphModule, example_inputs, *, fp8: bool = True,
                    arch_of=_device_arch) -> list[Replacement]:
    """Put ``ptxforge.fp8_linear`` (``fp8``) or ``ptxforge.bf16_linear`` in place of every
    Linear that can take it, its weight (quantized) now a buffer of ``gm``. Returns the
    plan, one record per Linear. ``arch_of``: a device's description (or why there is
    none)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {n: e for n, e in zip(placeholders, example_inputs) if _static_input(n, e)}
    plan = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in LINEARS:
            continue
        x, w, bias = (list(node.args) + [node.kwargs.get("bias")])[:3]
        weight = static.get(w)
        x_value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        why = _unsupported(x_value, weight, arch_of)
        if why is None and bias is not None and bias not in static:
            why = "the bias is not a parameter of the model"
        if why is not None:
            plan.append(Replacement("linear", node.name, None, why))
            continue
        n, k = weight.shape
        if fp8:
            wq, ws = torch.ops.ptxforge.quantize_fp8_per_block(weight.detach())
            constants, operator = (wq, ws), torch.ops.ptxforge.fp8_linear.default
        else:
            constants, operator = (weight.detach(),), torch.ops.ptxforge.bf16_linear.default
        with gm.graph.inserting_before(node):
            attributes = []
            for i, value in enumerate(constants):
                name = f"_ptxforge_{node.name}_{i}"
                _add_constant(gm, name, value)
                attributes.append(gm.graph.get_attr(name))
            new = gm.graph.call_function(operator, (x, *attributes, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        plan.append(Replacement("linear", node.name, str(operator).rsplit(".", 1)[0],
                                f"[{n}, {k}] weight, " + ("fp8 128x128 blocks" if fp8 else "bf16")))
    gm.graph.lint()
    gm.recompile()
    return plan


def backend(gm: torch.fx.GraphModule, example_inputs, *, fp8: bool = True,
            mode: str | None = None, options: dict | None = None):
    """The torch.compile backend: the passes, then Inductor, with torch.compile's ``mode``
    and ``options`` (as Inductor takes them: ``mode="reduce-overhead"`` is CUDA graphs)."""
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    plan = rewrite_linears(gm, example_inputs, fp8=fp8)
    gm.ptxforge_plan = plan
    for item in plan:
        log.info("%s %s -> %s (%s)", item.pattern, item.node, item.operator or "Inductor",
                 item.reason)
    # (list_mode_options(None) lists every mode on some torch versions)
    patches = {**(torch._inductor.list_mode_options(mode) if mode else {}), **(options or {})}
    return compile_fx(gm, example_inputs, config_patches=patches)


def compile(model, *, fp8: bool = True, **options):
    """``torch.compile(model, backend=ptxforge's, **options)``; ``fp8=False`` keeps bf16
    numerics (ptxforge's BF16 GEMM)."""
    return torch.compile(model, backend=functools.partial(backend, fp8=fp8), **options)


try:
    from torch._dynamo.backends.registry import register_backend

    register_backend(name="ptxforge")(backend)
except (ImportError, RuntimeError):  # a torch without it, or the name already taken
    pass
