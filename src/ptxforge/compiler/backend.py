"""The ``ptxforge`` torch.compile backend. Dynamo hands it the model's FX graph with the
parameters as placeholders and their real tensors among the example inputs; the passes
(``passes.py``) rewrite the graph in place, and Inductor compiles what is left.

    graph from Dynamo --passes.rewrite--> Linears -> ptxforge.fp8_linear (weights quantized
                                          here, once); their producers (RMSNorm, SwiGLU)
                                          fused with the FP8 quantization; residual adds
                                          into the GEMM's epilogue
                      --Inductor--------> everything else (attention, elementwise, ...)

The plan (``Replacement`` records) is logged (logger ``ptxforge.compiler``) and kept on
the compiled graph module (``ptxforge_plan``). Weights are read when the graph is
compiled: changing them afterwards needs a new compile (as with any constant folded by a
compiler).
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch

from .. import jit
from ..ops import common
from . import expert_parallel, graphs, moe, passes, precompile, steps
from .rewriting import Replacement, is_static, token_dims, traced_size

log = logging.getLogger("ptxforge.compiler")

# Inductor's settings for what the passes leave to it, under the user's own options.
# Inductor inlines a pointwise buffer into each of its readers unless the buffer's
# computation reads more than 4 buffers; it then recomputed transformers' rotary
# embedding (a K=1 matmul, then sin and cos of each angle) in every kernel that rotates q
# or k, once per element of q and k: those kernels took 112-122 us of Llama-3-8B's 2
# layers at 2048 tokens, and 27 us with each buffer read twice stored once (H200).
INDUCTOR_DEFAULTS = {"realize_reads_threshold": 0}


def inductor_settings(mode: str | None, options: dict | None) -> dict:
    """Inductor's settings for torch.compile's ``mode`` and ``options``: INDUCTOR_DEFAULTS,
    under the mode's, under the options. ``"triton.cudagraphs"`` among them: the compiled
    graphs run as CUDA graphs (``mode="reduce-overhead"`` or ``"max-autotune"``)."""
    import torch._inductor

    # (list_mode_options(None) lists every mode on some torch versions)
    return {**INDUCTOR_DEFAULTS, **(torch._inductor.list_mode_options(mode) if mode else {}),
            **(options or {})}


def _device_arch(device):
    """The description of ``device``, or the reason there is none (a string)."""
    try:
        return common.device_arch(device.index or 0)
    except (RuntimeError, ValueError) as error:   # no driver, or a GPU not described
        return str(error)


def rewrite(gm: torch.fx.GraphModule, example_inputs, *, fp8: bool = True,
            arch_of=_device_arch, ep=None) -> list[Replacement]:
    """Run the passes on ``gm`` (in place); log and return the plan. ``arch_of``: a
    device's description, or why there is none; ``ep``: the experts sharded over a group
    (``expert_parallel.ExpertParallel``), or None."""
    plan = passes.rewrite(gm, example_inputs, fp8=fp8, arch_of=arch_of, ep=ep)
    gm.ptxforge_plan = plan
    for item in plan:
        log.info("%s %s -> %s (%s)", item.rewrite, item.node, item.operator or "Inductor",
                 item.reason)
    linears = [item for item in plan if "linear" in item.rewrite]
    reasons = {item.reason for item in linears}
    if linears and not any(item.operator for item in plan) and len(reasons) == 1:
        log.warning("ptxforge leaves every Linear to Inductor: %s", reasons.pop())
    return plan


def backend(gm: torch.fx.GraphModule, example_inputs, *, fp8: bool = True,
            precompile: int | None = None, mode: str | None = None,
            options: dict | None = None, ep=None):
    """The torch.compile backend: the passes, the kernels of the graph assembled in
    parallel (for the example inputs' token count, and every token count up to
    ``precompile`` if given), then Inductor, with torch.compile's ``mode`` and ``options`` as
    Inductor takes them, except that CUDA graphs (``mode="reduce-overhead"``) are
    ptxforge's runner (``graphs.py``), not Inductor's. Seconds spent in the passes and in
    assembly are left in ``gm.ptxforge_seconds``. ``ep``: the experts sharded over a group
    (``compile``'s ep_group)."""
    from torch._inductor.compile_fx import compile_fx

    start = time.perf_counter()
    rewrite(gm, example_inputs, fp8=fp8, ep=ep)
    seconds = {"passes": time.perf_counter() - start}
    start = time.perf_counter()
    assemble(gm, precompile)
    seconds["assembly"] = time.perf_counter() - start
    gm.ptxforge_seconds = seconds
    patches = inductor_settings(mode, options)
    replay = patches.pop("triton.cudagraphs", False)
    compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if replay:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # Parameters keep their addresses; inputs the rewritten graph no longer reads (the
        # original weights, an eps the passes took as a constant) need no copy.
        changing = [i for i, (node, value) in enumerate(zip(placeholders, example_inputs))
                    if node.users and not is_static(node, value)]
        held = [i for i, (node, value) in enumerate(zip(placeholders, example_inputs))
                if node.users and is_static(node, value)
                and not isinstance(value, torch.nn.Parameter)]
        compiled = graphs.GraphRunner(compiled, changing, held)
    # Outside the graphs: a replay runs no Python, the check must run before it.
    return FoldedWeights(compiled, gm.ptxforge_folded)


def assemble(gm: torch.fx.GraphModule, up_to: int | None = None) -> int:
    """Assemble, in parallel, every kernel the rewritten graph launches at the token count
    it was traced with (and at every count up to ``up_to``, with a progress bar): the first
    call then finds them built. Returns how many."""
    nodes = precompile.kernels_of(gm.graph)
    if not nodes:
        return 0
    # Each ptxforge operator's first argument is its input rows.
    values = [n.args[0].meta["example_value"] for n in gm.graph.nodes if n.name in nodes]
    arch = _device_arch(values[0].device)
    if isinstance(arch, str):
        return 0
    rows = {traced_size(math.prod(v.shape[:-1])) for v in values}
    tokens = sorted(rows | set(precompile.every_token_count(arch, up_to) if up_to else ()))
    kernels = [kernel for found in nodes.values() for kernel in found]
    return len(jit.precompile(precompile.builders(kernels, arch, tokens),
                              progress=up_to is not None))


class FoldedWeights:
    """The compiled function, refusing to run once a weight the passes copied into it (to
    quantize or join) has changed in place since (its version counter moved, as
    ``load_state_dict`` and ``param.copy_`` move it): a stale result otherwise. Costs about
    a microsecond a call; changes through ``param.data`` are not seen. A whole call captured
    by the decode runner runs the check before each replay (``steps.check_on_replay``)."""

    def __init__(self, fn, weights):
        self.fn, self.weights = fn, tuple(weights)
        self.versions = tuple(w._version for w in self.weights)

    def check(self) -> None:
        if tuple(w._version for w in self.weights) != self.versions:
            raise RuntimeError("ptxforge: a weight changed after the model was compiled (the "
                               "compiled graph holds its quantized copy); compile the model "
                               "again after loading weights")

    def __call__(self, *args):
        self.check()
        steps.check_on_replay(self.check)
        return self.fn(*args)


def compile(model, *, fp8: bool = True, precompile: int | None = None,
            dynamic: bool | None = None, ep_group=None, step_graphs: bool | None = None,
            **options):
    """``torch.compile(model, backend=ptxforge's, **options)``, its token dimensions dynamic:
    one compile for every token count (M is a run-time argument of every kernel).
    ``fp8=False`` keeps bf16 numerics (ptxforge's BF16 GEMM); ``precompile=16384``: assemble
    the kernels of every token count up to that when the model compiles (else each on first
    use); ``mode="reduce-overhead"``: CUDA graphs. ``ep_group`` (a torch.distributed
    process group; every rank of it calls ``compile``): the experts of each transformers
    MoE block sharded over the group, E/ranks a rank, run by ``ptxforge.ep``
    (``expert_parallel.py``: its normal path, or with ``mode="reduce-overhead"`` its decode
    path); the router and a shared expert stay whole on every rank.

    ``step_graphs`` (the decode runner, ``steps.py``): calls on the GPU of few tokens (at
    most 256: a decode step) replayed as whole CUDA graphs, Dynamo and the model's Python
    inside, while autograd is not recording (under ``torch.no_grad`` or
    ``torch.inference_mode``, as transformers' generate runs; other calls run as they are).
    None (the default) turns it on, except where the compiled graphs are CUDA graphs
    themselves (``mode="reduce-overhead"`` or ``"max-autotune"``: a graph inside a captured
    call) and with ``ep_group`` (the expert-parallel normal path synchronises with the host,
    which a capture cannot hold); True turns it on (an error with CUDA graphs inside or
    with ``ep_group``), False off. When on, the runner is the result's ``steps``
    (``max_tokens``, ``max_graphs``).

    ``dynamic=None`` (the default): the first call's tensors have their token dimensions
    marked dynamic before Dynamo traces them (``token_dims``), and no others; True or False
    go to torch.compile as they are (True makes every dimension dynamic: more guards, whose
    host time every call pays: Dynamo alone took 102.7 us a call of Llama-3-8B's 2 layers at
    64 tokens with True, 62.0 with the token dimensions alone, measured on the H200)."""
    inner_graphs = inductor_settings(options.get("mode"),
                                     options.get("options")).get("triton.cudagraphs", False)
    if step_graphs and inner_graphs:
        given = (f"mode={options['mode']!r}" if options.get("mode")
                 else "options={'triton.cudagraphs': True}")
        raise ValueError(f"step_graphs=True captures whole calls, and {given} captures the "
                         f"compiled graphs inside them: pass one or the other")
    if step_graphs and ep_group is not None:
        raise ValueError("step_graphs=True captures whole calls, and ep_group's normal path "
                         "synchronises with the host, which a capture cannot hold: pass one "
                         "or the other")
    if step_graphs is None:
        step_graphs = not inner_graphs and ep_group is None
    ep = None if ep_group is None else expert_parallel.expert_parallel(
        model, ep_group, fp8=fp8, decode=options.get("mode") == "reduce-overhead")
    if isinstance(model, torch.nn.Module) and (looping := moe.looping_experts(model)):
        log.warning("ptxforge leaves the experts of %s to Inductor: transformers' per-expert "
                    "loop breaks the graph at every expert; load the model with "
                    "experts_implementation='grouped_mm' for ptxforge's MoE kernels",
                    ", ".join(looping))
    compiled = torch.compile(model, backend=functools.partial(backend, fp8=fp8,
                                                              precompile=precompile, ep=ep),
                             dynamic=dynamic, **options)
    if dynamic is not None and not step_graphs:
        return compiled
    if isinstance(compiled, torch.nn.Module):
        if dynamic is None:
            # A pre-hook of the compiled module runs before Dynamo's frame, in Python; it
            # removes itself after the first call, which leaves later calls no hook to run.
            def mark_once(module, args, kwargs):
                mark_token_dims(args, kwargs)
                handle.remove()

            handle = compiled.register_forward_pre_hook(mark_once, with_kwargs=True)
        return steps.StepModule(compiled) if step_graphs else compiled

    _generate_with_this_forward(model)

    def traced(*args, **kwargs):
        # Under another torch.compile, Dynamo traces this call: no marking there.
        if dynamic is None and not torch.compiler.is_dynamo_compiling():
            mark_token_dims(args, kwargs)
        return compiled(*args, **kwargs)

    run = steps.StepGraphs(traced) if step_graphs else traced

    @functools.wraps(model)
    def call(*args, **kwargs):
        return run(*args, **kwargs)
    call.steps = run if step_graphs else None   # the runner, to look at its graphs
    return call


def _generate_with_this_forward(forward) -> None:
    """``model.forward = ptxforge.compile(model.forward)`` on a transformers model: its
    generate would compile each decode step again (``get_compiled_call``: torch.compile of
    the model's ``__call__`` with transformers' own backend), tracing through this forward,
    whose ptxforge graphs would then never run (a torch.compile inside another is ignored).
    The model's compiled call becomes its plain call, which reaches the compiled forward."""
    model = getattr(forward, "__self__", None)
    if getattr(forward, "__name__", None) == "forward" and callable(
            getattr(model, "get_compiled_call", None)):
        model.get_compiled_call = lambda compile_config=None: model.__call__


def mark_token_dims(args, kwargs) -> None:
    """Mark the token dimensions of the tensors among a call's arguments dynamic for
    Dynamo (maybe: a model whose code needs one static specializes it, and recompiles for
    another count, instead of failing)."""
    for x in (*args, *kwargs.values()):
        dims = token_dims(x) if isinstance(x, torch.Tensor) else None
        if dims:
            torch._dynamo.maybe_mark_dynamic(x, dims)


def _register() -> None:
    """``backend="ptxforge"`` for torch.compile. An installed ptxforge declares it as a
    ``torch_dynamo_backends`` entry point, which torch loads when the name is first asked
    for (no import of ptxforge needed); from a source tree, importing this module
    registers it."""
    from importlib.metadata import entry_points

    try:
        from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    except ImportError:   # a torch without the registry
        return
    declared = any(ep.name == "ptxforge" for ep in entry_points(group="torch_dynamo_backends"))
    if not declared and "ptxforge" not in _COMPILER_FNS:
        register_backend(name="ptxforge")(backend)


_register()
