"""The MoE pass: a transformers experts module, traced by Dynamo, becomes one
``ptxforge.moe_experts_fp8`` call (``ops/moe.py``: permutation, grouped FP8 GEMMs,
combine).

transformers' MoE blocks (Mixtral, DeepSeek-V3, Qwen-MoE...) hold their experts in one
module with 3-D parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], called
as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. With
``experts_implementation="grouped_mm"`` its forward traces to one graph (sort, gather, two
``grouped_mm``, SwiGLU, weighted sum); the default per-expert loop breaks the graph at
every expert and is left to Inductor. The router before it (scores, group-limited top-k,
bias correction) and a shared expert after it (plain Linears, the other passes' work) stay
as they are.

The pass finds the module by its parameters, takes the nodes Dynamo traced inside it
(``nn_module_stack``), checks that they compute what the op computes (two grouped GEMMs on
the two weights, SwiGLU between them over ``chunk(2)``), and replaces them all with the
op, the weights quantized once here to 128x128 blocks. Compiled with ``ep_group``
(``expert_parallel.py``), each rank quantizes only its slice of the experts, and the op is
``moe_experts_fp8_ep``, which dispatches the tokens to the ranks holding their experts and
combines what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import precompile
from .rewriting import PTXFORGE, Graph, Replacement, ancestors, gpu_arch, kind

_F = torch.nn.functional
# The grouped GEMM as transformers calls it, by torch version and device.
_GROUPED_MM = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                                getattr(_F, "grouped_mm", None)) if f is not None)
_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass
class Experts:
    """An experts module the op can take: the nodes it reads (hidden [T, H], top-k indices
    and weights), the node its value leaves by, and its two weights' placeholders."""
    hidden: torch.fx.Node
    index: torch.fx.Node
    weights: torch.fx.Node
    output: torch.fx.Node
    params: dict


def rewrite_moe_experts(g: Graph, *, fp8: bool, arch_of, ep=None) -> list[Replacement]:
    """Each experts module of the graph -> ``ptxforge.moe_experts_fp8`` (with ``ep``, an
    ``expert_parallel.ExpertParallel``: ``moe_experts_fp8_ep`` on this rank's experts), or
    the reason it stays with Inductor."""
    plan = []
    for module, weights in _experts_modules(g).items():
        nodes = [n for n in g.graph.nodes if n.op not in ("placeholder", "output")
                 and any(path == module for path, _ in n.meta.get("nn_module_stack", {}).values())]
        if not nodes:
            continue
        found, why = _match(g, module, nodes, weights)
        if why is None:
            _keep_router(g, found)
            why = _why_not_taken(g, found, fp8, arch_of, ep)
        if why is not None:
            plan.append(Replacement("moe experts", module, None, why))
            continue
        plan.append(_rewrite(g, module, nodes, found, ep))
    return plan


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """path -> module, for ``model``'s experts modules: both weights 3-D."""
    return {path: module for path, module in model.named_modules()
            if all(getattr(getattr(module, w, None), "dim", lambda: 0)() == 3 for w in _WEIGHTS)}


def looping_experts(model: torch.nn.Module) -> list[str]:
    """The paths of ``model``'s experts modules that run transformers' per-expert loop:
    that breaks Dynamo's graph at every expert, and no graph then holds the module for this
    pass (``ptxforge.compile`` warns with these)."""
    return [path for path, module in experts_modules(model).items()
            if getattr(getattr(module, "config", None), "_experts_implementation",
                       None) != "grouped_mm"]


def _experts_modules(g: Graph) -> dict:
    """module path -> {weight name: placeholder} for the modules holding both weights."""
    modules: dict[str, dict] = {}
    for node, value in g.static.items():
        stack = node.meta.get("nn_module_stack")
        name = next((w for w in _WEIGHTS if node.name.endswith(f"_{w}_")), None)
        if stack and name and isinstance(value, torch.Tensor) and value.dim() == 3:
            path = list(stack.values())[-1][0]
            modules.setdefault(path, {})[name] = node
    return {path: found for path, found in modules.items() if len(found) == len(_WEIGHTS)}


def _keep_router(g: Graph, found: Experts) -> None:
    """The router's Linears (those the top-k indices and weights are computed from) stay
    in the model's precision: FP8 scores pick other experts for the tokens near a tie
    (Mixtral's bf16 router in FP8: calc_diff 1.2e-2 at 2048 tokens against the f32
    block, measured on the H200, where the experts alone are at ~1e-3)."""
    for node in {*ancestors(found.index), *ancestors(found.weights)}:
        if kind(node) == "linear":
            g.kept[node] = ("the MoE router's scores: kept in the model's precision (FP8 "
                            "scores would route tokens near a tie to other experts)")


def _match(g: Graph, module: str, nodes: list, weights: dict):
    """(``Experts``, None) if ``nodes`` compute the experts as the op does, else (None,
    why)."""
    inside = set(nodes)
    mms = [n for n in nodes if n.target in _GROUPED_MM
           or str(n.target).startswith("transformers.grouped_mm_fallback")]
    if len(mms) != 2:
        return None, (f"{len(mms)} grouped GEMMs traced in the experts, not 2: "
                      f"experts_implementation='grouped_mm' (the default per-expert loop "
                      f"breaks the graph at every expert)")
    for mm, name in zip(mms, _WEIGHTS):
        w = mm.args[1]
        if not (_method(w) == "transpose" and w.args[0] is weights[name]):
            return None, f"the grouped GEMM {mm.name} does not read {name} transposed"
    if not _swiglu_between(mms, inside):
        return None, "no silu(gate) * up over chunk(2) between the two grouped GEMMs"
    outside = [n for n in nodes if any(user not in inside for user in n.users)]
    if len(outside) != 1:
        return None, f"{len(outside)} values leave the experts, not 1"
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside} - set(weights.values())
    tensors = [a for a in inputs if isinstance(g.value(a), torch.Tensor)]
    by_role = {}
    for a in tensors:
        value = g.value(a)
        role = ("index" if not value.is_floating_point()
                else "hidden" if value.dtype == torch.bfloat16 and value.dim() == 2
                and value.shape[-1] == g.tensor(weights["gate_up_proj"]).shape[-1]
                else "weights")
        by_role.setdefault(role, []).append(a)
    if sorted(by_role) != ["hidden", "index", "weights"] or any(len(v) != 1 for v in by_role.values()):
        return None, (f"the experts read {len(tensors)} tensors, not hidden [T, H] bf16, "
                      f"top_k_index and top_k_weights")
    return Experts(by_role["hidden"][0], by_role["index"][0], by_role["weights"][0],
                   outside[0], weights), None


def _method(node) -> str | None:
    """The method a call_method node calls (None: another kind of node)."""
    return node.target if isinstance(node, torch.fx.Node) and node.op == "call_method" else None


def _swiglu_between(mms, inside) -> bool:
    """silu(chunk(h, 2, -1)[0]) * chunk(h, 2, -1)[1], with h made from the first grouped
    GEMM and the product feeding the second."""
    first, second = mms
    for node in inside:
        if kind(node) != "mul":
            continue
        a, b = node.args[:2]
        if kind(b) == "silu":
            a, b = b, a
        if kind(a) != "silu":
            continue
        gate, up = a.args[0], b
        chunk = getattr(gate, "args", (None,))[0]
        if not (isinstance(chunk, torch.fx.Node) and _method(chunk) == "chunk"
                and gate.args[1:] == (0,) and getattr(up, "args", ())[:2] == (chunk, 1)
                and chunk.args[1:2] == (2,) and chunk.kwargs.get("dim", -1) in (-1, 1)):
            continue
        if first in ancestors(chunk) and node in ancestors(second):
            return True
    return False


def _why_not_taken(g: Graph, found: Experts, fp8: bool, arch_of, ep) -> str | None:
    """Why the op cannot run these experts (sizes the kernels do not take, no FP8), or None.
    With ``ep`` the grouped GEMMs run over this rank's experts."""
    if not fp8:
        return "the MoE lowering is FP8 (fp8=False keeps bf16 numerics: Inductor's)"
    gate_up = g.tensor(found.params["gate_up_proj"])
    down = g.tensor(found.params["down_proj"])
    experts, two_inner, hidden = gate_up.shape
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        return f"the expert weights are {gate_up.dtype}, not bf16"
    if tuple(down.shape) != (experts, hidden, two_inner // 2) or two_inner % 2:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                f"not [E, 2I, H] and [E, H, I]")
    arch, why = gpu_arch(gate_up, arch_of)
    if why is not None:
        return why
    local = experts if ep is None else len(ep.experts(experts))
    kernels = precompile.moe_kernels(local, hidden, two_inner // 2,
                                     g.value(found.index).shape[-1], g.value(found.weights).dtype)
    try:   # every kernel the op launches (the GEMMs' sizes first), for one token and many
        for kernel in sorted(kernels, key=lambda kernel: not isinstance(kernel, precompile.GemmKernel)):
            for tokens in (1, 1 << 14):   # (both layouts)
                kernel.config(arch, tokens)
    except ValueError as error:
        return str(error)
    if two_inner % 256 or hidden % 128:
        return (f"the 128x128 weight blocks need 2I and H multiples of 256 and 128, got "
                f"2I={two_inner}, H={hidden}")
    return None


def _rewrite(g: Graph, module: str, nodes: list, found: Experts, ep) -> Replacement:
    output = found.output
    gate_up, down = (g.tensor(found.params[name]) for name in _WEIGHTS)
    experts, two_inner, width = gate_up.shape
    g.folded.extend((gate_up, down))
    if ep is not None:   # this rank's experts alone are quantized, and kept
        gate_up, down = ep.shard(gate_up, down)
    name = "_ptxforge_" + module.replace("L['self'].", "").replace(".", "_")
    with g.graph.inserting_before(output):
        constants = []
        for label, w in (("gate_up", gate_up), ("down", down)):
            q, s = PTXFORGE.quantize_fp8_per_block(w.detach().reshape(-1, w.shape[-1]))
            blocks = s.shape[0] // w.shape[0]
            constants += [g.constant(f"{name}_{label}_w", q.view(w.shape)),
                          g.constant(f"{name}_{label}_ws", s.view(w.shape[0], blocks, s.shape[1]))]
        arguments = (found.hidden, found.index, found.weights, *constants)
        if ep is None:
            out = g.call(PTXFORGE.moe_experts_fp8.default, arguments)
        else:
            out = g.call(PTXFORGE.moe_experts_fp8_ep.default, (*arguments, ep.buffer, ep.layout))
    out.meta.update({k: v for k, v in output.meta.items() if k != "example_value"})
    output.replace_all_uses_with(out)
    for node in reversed(nodes):
        g.graph.erase_node(node)
    top_k = g.value(found.index).shape[-1]
    sizes = (f"gate_up [{two_inner}, {width}] and down [{width}, {two_inner // 2}], fp8 "
             f"128x128 blocks")
    if ep is None:
        return Replacement("moe experts", module, "ptxforge.moe_experts_fp8",
                           f"{experts} experts, top-{top_k}, {sizes}; masked or contiguous "
                           f"layout chosen per call from the token count")
    held = ep.experts(experts)
    return Replacement("moe experts", module, "ptxforge.moe_experts_fp8_ep",
                       f"experts [{held.start}, {held.stop}) of {experts} on rank {ep.rank} of "
                       f"{ep.ranks}, top-{top_k}, {sizes}; the tokens dispatched to their "
                       f"experts' ranks and combined back (ptxforge.ep: the "
                       f"{'decode' if ep.layout == 'masked' else 'normal'} path)")
