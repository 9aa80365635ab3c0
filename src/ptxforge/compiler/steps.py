"""Whole calls of a compiled model as CUDA graphs: the decode runner. A call whose
tensors are small (few tokens: a decode step) is captured the second time its key (the
shapes of its arguments, the objects it holds) comes, with the model's Python, Dynamo's
guards and every kernel launch inside, and later calls with that key only copy their
tensors in, replay and clone the outputs: no Dynamo, no model code on the hot path.

    call(*args, **kwargs) --few tokens, key captured---> copy the argument tensors into the
                                                         graph's own, replay, clone its
                                                         output tensors
                          --few tokens, key seen once--> run once (warm-up), capture
                          --a new key, many tokens,
                            or refused----------------> the compiled function as it is

Why the second time: a generate's prompt comes once for its cache, and capturing it would
cost a capture that is never replayed; its decode steps come again and again.

What a graph holds in place, not copied: every argument that is not a tensor (a
transformers cache object, and through it its key and value tensors, which the call
updates where they are) is part of the graph's key by identity, and the graph keeps it
alive, so another object (the next ``generate``'s cache) gets a graph of its own. The
arguments that are tensors (positional, or keyword: the top level only, so that nothing
inside an object is ever copied) go in by copy: a graph reads its own. The outputs'
tensors (in lists, tuples and dicts: a transformers ModelOutput's fields) are cloned;
any other object comes back as the capture returned it (the cache object).

A call's tokens: the fewest any argument tensor holds (the product of its token
dimensions): the token ids of a decode step hold one a sequence, where a mask over the
whole static cache holds its length.

At most MAX_GRAPHS graphs are kept, the least recently replayed dropped first: each
``generate`` makes a new static cache, so its graphs are never replayed after it ends. A
call that cannot be captured (a copy from the host, a synchronisation, a shape that
changes every step as a dynamic cache's does) runs as it is from then on, with one
logged reason.
"""

from __future__ import annotations

import collections
import logging
import math

import torch

from . import graphs
from .rewriting import token_dims

log = logging.getLogger("ptxforge")

MAX_TOKENS = 256     # a call is captured when its tensors' token dimensions hold at most this
MAX_GRAPHS = 16      # graphs kept per runner, the least recently replayed dropped first
GROWING = 8          # new keys in a row: the shapes change every call
SEEN = 64            # keys remembered as seen once


class StepGraphs:
    """``fn`` (the compiled model or forward) with its small calls replayed as whole CUDA
    graphs (the module's docstring). ``refused``: why calls no longer capture (None while
    they do)."""

    def __init__(self, fn, *, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS):
        self.fn, self.max_tokens, self.max_graphs = fn, max_tokens, max_graphs
        self.graphs: collections.OrderedDict[tuple, _Step] = collections.OrderedDict()
        self.refused: str | None = None
        self.pool = None
        self.seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._new_in_a_row = 0

    def __call__(self, *args, **kwargs):
        if self.refused or torch.compiler.is_dynamo_compiling() or not torch.cuda.is_available():
            return self.fn(*args, **kwargs)
        names = tuple(kwargs)
        leaves = [*args, *kwargs.values()]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors or _tokens(tensors) > self.max_tokens:
            return self.fn(*args, **kwargs)
        spec = (len(args), names)
        key = (spec, tuple(map(_leaf_key, leaves)))
        step = self.graphs.get(key)
        if step is not None:
            self._new_in_a_row = 0
            self.graphs.move_to_end(key)
            return step.replay(leaves)
        if key not in self.seen:
            self._new_in_a_row += 1
            if self._new_in_a_row > GROWING:
                return self._refuse(f"{GROWING} calls in a row each with new shapes (a "
                                    f"cache that grows every step?)", args, kwargs)
            self.seen[key] = None
            if len(self.seen) > SEEN:
                self.seen.popitem(last=False)
            return self.fn(*args, **kwargs)
        del self.seen[key]
        try:
            step, outputs = _Step.capture(self.fn, leaves, spec, self.pool)
        except Exception as error:  # a capture the call's code forbids: run it as it is
            torch.cuda.synchronize()
            return self._refuse(f"the call could not be captured: {type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else ''}",
                                args, kwargs)
        self.pool = step.pool
        self.graphs[key] = step
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return outputs

    def _refuse(self, reason: str, args, kwargs):
        self.refused = reason
        log.warning("ptxforge runs this model's calls without CUDA graphs from now on: %s",
                    reason)
        return self.fn(*args, **kwargs)


class _Step:
    """One captured call: its graph, its own copies of the argument tensors (by position
    among the leaves), the leaves it holds (objects, kept alive) and its outputs."""

    def __init__(self, graph, copies: dict, held: list, outputs, pool):
        self.graph, self.copies, self.held, self.outputs, self.pool = (
            graph, copies, held, outputs, pool)

    @classmethod
    def capture(cls, fn, leaves: list, spec, pool):
        """(the step, the warm-up call's outputs): a warm-up call on a side stream (kernels
        assembled, workspaces allocated, lazy state such as a static cache's made), then
        the capture on the same argument copies."""
        copies = {i: x.clone() for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        own = [copies.get(i, x) for i, x in enumerate(leaves)]
        positional, names = spec
        args, kwargs = own[:positional], dict(zip(names, own[positional:]))
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        graph, warm, outputs = graphs.warm_and_capture(lambda: fn(*args, **kwargs), pool)
        held = [x for x in leaves if not isinstance(x, torch.Tensor)]
        return cls(graph, copies, held, outputs, pool), warm

    def replay(self, leaves: list):
        for i, copy in self.copies.items():
            copy.copy_(leaves[i])
        self.graph.replay()
        return graphs.map_tensors(self.outputs, torch.Tensor.clone)


def _leaf_key(x):
    """What a graph captured for argument leaf ``x`` depends on: a tensor's shape, strides,
    dtype and device (its data is copied in); a number, string or None itself; any other
    object by identity (the graph reads and writes its tensors in place)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return ("value", x)
    return ("object", id(x))


def _tokens(tensors: list) -> int:
    """The fewest tokens an argument tensor holds: the product of its token dimensions
    (``token_dims``: every dimension longer than 1 but a float tensor's features)."""
    return min(math.prod(x.shape[d] for d in token_dims(x)) for x in tensors)


class StepModule(torch.nn.Module):
    """A compiled module whose calls go through StepGraphs; its parameters and buffers are
    the module's (``compiled``, a submodule)."""

    def __init__(self, compiled: torch.nn.Module):
        super().__init__()
        self.compiled = compiled
        self.steps = StepGraphs(compiled)

    def forward(self, *args, **kwargs):
        return self.steps(*args, **kwargs)
