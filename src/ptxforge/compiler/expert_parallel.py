"""Expert parallelism in the graph compiler: ``ptxforge.compile(model, ep_group=group)``,
called on every rank of ``group``, runs each transformers experts module of ``model`` on
``ptxforge.ep``, each rank holding E/R of its experts.

    compile(model, ep_group=group)      on every rank (collective: the buffer)
      expert_parallel(model, group)     the checks (a ProcessGroup; experts modules, run by
                                        grouped_mm, whose E the ranks divide), then one
                                        ptxforge.ep.Buffer for the model and the group, for
                                        the path the model compiles for
      the MoE pass (moe.py)             rank r's experts [r*E/R, (r+1)*E/R) sliced from the
                                        module's weights (ep.shard_experts) and quantized;
                                        the experts' nodes -> moe_experts_fp8_ep(x, topk_idx,
                                        topk_weights, the slice's weights, buffer key,
                                        layout)

The operator takes the buffer by key (an int the graph holds as a constant; ``BUFFERS``
maps it to the Buffer in this process): a schema types its arguments, and a Buffer is no
tensor, number or string. It must be an operator, not a Python callable in the graph:
AOTAutograd traces the rewritten graph again, and would run a callable on fake tensors
(into the buffer's host code); an operator stays one node, its fake gives the shape, and
Inductor calls it as it is. An int keeps the graph free of Python objects, so
``fullgraph=True`` and CUDA graph capture see what they see for the one-GPU operator.

Every rank must take the same path in a call, and no rank knows the others' token counts
(they may differ) without a host synchronisation: the path is fixed when the model
compiles, the same on every rank. ``mode="reduce-overhead"`` (CUDA graphs: decoding) takes
the decode path (layout "masked": low-latency dispatch and combine, no host
synchronisation, capturable; at most ``DECODE_TOKENS`` tokens a rank a call), any other
mode the normal path (layout "contiguous": any token count; its dispatch exchanges the
counts on the host, so it is not captured). The buffer has room for that path alone.

The router and a shared expert are replicated: every rank computes them for its own
tokens, and the other passes treat them as they do on one GPU. A group of one rank needs
no communication: the one-GPU pass runs.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from .. import ep as ep_package
from .. import ops
from ..ep import Buffer, buffer_size
from .moe import experts_modules, looping_experts

log = logging.getLogger("ptxforge.compiler")

# The decode path's room: tokens a rank a call (the low-latency buffer grows with it:
# DeepSeek-V3's at 128 tokens, 272 MB a rank over 2 to 8 ranks).
DECODE_TOKENS = 128

# key -> Buffer, for the operator's implementation: one entry per compile with ep_group,
# kept for the process (freeing a Buffer is collective: ``BUFFERS[key].destroy()`` on
# every rank, once no compiled model uses it).
BUFFERS: dict[int, Buffer] = {}
_keys = itertools.count()


@dataclass(frozen=True)
class ExpertParallel:
    """What the MoE pass needs to shard a model's experts: this rank, the group's size, the
    key of the group's buffer in ``BUFFERS`` and the path's layout ("masked": the decode
    path, "contiguous": the normal one)."""
    rank: int
    ranks: int
    buffer: int
    layout: str = "contiguous"

    def experts(self, total: int) -> range:
        """The experts of ``total`` this rank holds."""
        per_rank = total // self.ranks
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def shard(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
        """This rank's experts of a module's weights [E, 2I, H] and [E, H, I]."""
        return ep_package.shard_experts(gate_up, down, self.rank, self.ranks)


def expert_parallel(model, group, *, fp8: bool, decode: bool = False) -> ExpertParallel | None:
    """The checks of ``compile(model, ep_group=group)``, each a one-line error, then the
    group's buffer for the normal path or, with ``decode``, the decode path (collective:
    every rank of the group calls this); None for a group of one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"ep_group must be a torch.distributed ProcessGroup (after "
                        f"init_process_group, e.g. dist.group.WORLD), got {type(group).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ep_group needs model to be a torch.nn.Module (its experts modules are "
                        f"sharded), got {type(model).__name__}")
    if not fp8:
        raise ValueError("ep_group needs fp8=True: the expert-parallel layer runs the experts "
                         "in FP8")
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"ep_group: {type(model).__name__} has no experts module to shard (3-D "
                         f"gate_up_proj [E, 2I, H] and down_proj [E, H, I], as transformers' MoE "
                         f"blocks hold them)")
    looping = looping_experts(model)
    if looping:
        raise ValueError(f"ep_group: the experts of {looping[0]} run transformers' per-expert "
                         f"loop, which no graph holds; load the model with "
                         f"experts_implementation='grouped_mm'")
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = []   # (hidden, top-k, experts) of each module
    for path, module in modules.items():
        experts, _, hidden = module.gate_up_proj.shape
        config = getattr(module, "config", None)
        if experts % ranks:
            raise ValueError(f"ep_group: the {experts} experts of {path} do not divide over the "
                             f"group's {ranks} ranks")
        top_k = getattr(config, "num_experts_per_tok", None)
        if not isinstance(top_k, int):
            raise ValueError(f"ep_group: the config of {path} has no num_experts_per_tok (the "
                             f"top-k the buffer is sized for), got {top_k!r}")
        sizes.append((hidden, top_k, experts))
    if ranks == 1:
        log.info("ep_group has one rank: the experts run whole on it, with no communication")
        return None
    key = next(_keys)
    if decode:
        size = max(Buffer.get_low_latency_rdma_size_hint(DECODE_TOKENS, hidden, ranks, experts)
                   for hidden, _, experts in sizes)
        BUFFERS[key] = Buffer(group, 0, size, low_latency_mode=True)
        path = f"the decode path, up to {DECODE_TOKENS} tokens a rank"
    else:   # the layer dispatches FP8 rows with their scales
        size = buffer_size(ranks, max(s[0] for s in sizes), max(s[1] for s in sizes), fp8=True)
        BUFFERS[key] = Buffer(group, size)
        path = "the normal path"
    log.info("ep_group: rank %d of %d, a ptxforge.ep.Buffer of %d bytes for %s", rank, ranks,
             size, path)
    return ExpertParallel(rank, ranks, key, "masked" if decode else "contiguous")


def _moe_experts_fp8_ep(x, topk_idx, topk_weights, w13, s13, w2, s2, buffer, layout):
    if buffer not in BUFFERS:
        raise ValueError(f"buffer must be the key of a ptxforge.ep.Buffer made in this process "
                         f"by compile(..., ep_group=), got {buffer} (made: {sorted(BUFFERS)})")
    return ops.moe_experts_fp8(x, topk_idx, topk_weights, (w13, s13), (w2, s2), layout=layout,
                               ep=BUFFERS[buffer])


# The experts across the group: x [T, H] and the router's top-k (global expert ids) of
# this rank's tokens, this rank's experts' FP8 weights, the path's layout; returns every
# expert's sum [T, H].
_library = torch.library.Library("ptxforge", "FRAGMENT")
_library.define("moe_experts_fp8_ep(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w13, "
                "Tensor s13, Tensor w2, Tensor s2, int buffer, str layout) -> Tensor")
_library.impl("moe_experts_fp8_ep", _moe_experts_fp8_ep, "CUDA")
torch.library.register_fake(
    "ptxforge::moe_experts_fp8_ep",
    lambda x, topk_idx, topk_weights, w13, s13, w2, s2, buffer, layout:
        torch.empty_like(x, memory_format=torch.contiguous_format),
    lib=_library)
