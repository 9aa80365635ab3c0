"""Whole calls of a compiled model as CUDA graphs: the decode runner, on by default for a
model on a GPU (``ptxforge.compile``'s ``step_graphs``). A call whose tensors are on the GPU
and small (few tokens: a decode step) is captured the second time its key (the shapes of
its arguments, the objects it holds) comes, with the model's Python, Dynamo's guards and
every kernel launch inside, and later calls with that key only copy their tensors in,
replay and clone the outputs: no Dynamo, no model code on the hot path.

    call(*args, **kwargs) --autograd recording, a CPU
                            tensor, many tokens, a new
                            key, or refused-----------> the compiled function as it is
                          --few tokens, key seen once--> run once on the caller's
                            (or captured before on       tensors (warm-up), capture on
                            another object)              the graph's own copies
                          --few tokens, key captured---> the captured call's weight checks,
                                                         copy the argument tensors into the
                                                         graph's own, replay, clone its
                                                         output tensors

Why the second time: a generate's prompt comes once for its cache, and capturing it would
cost a capture that is never replayed; its decode steps come again and again. A call like
one captured before but on another object (the next generate's decode steps, on its new
cache) is captured the first time: it will come again too.

Why not while autograd records (``torch.is_grad_enabled()``: a training step, or a call
outside ``torch.no_grad``/``torch.inference_mode``): a replay's cloned outputs carry no
autograd history, or the capture's, so a backward through them would be wrong. Such a
call runs as it is and changes nothing: the next call under ``no_grad`` may capture.
transformers' ``generate`` runs under ``torch.no_grad``, so its decode steps capture.

What a graph holds in place, not copied: every argument that is not a tensor (a
transformers cache object, and through it its key and value tensors, which the call
updates where they are) is part of the graph's key by identity, so another object (the
next ``generate``'s cache) gets a graph of its own. The graph does not keep the object
alive: it goes when the object does (each ``generate`` makes a new static cache, 17 GB
of keys and values at batch 32 and 4096 tokens, which graphs holding them would keep
to the end); an object that takes no weak reference is held instead. The
arguments that are tensors (positional, or keyword: the top level only, so that nothing
inside an object is ever copied) go in by copy: a graph reads its own. The outputs'
tensors (in lists, tuples and dicts: a transformers ModelOutput's fields) are cloned;
an argument object among them (the cache object) comes back as the caller's argument.

A replay runs none of the call's Python: the checks the compiled call makes on itself
(``backend.FoldedWeights``: a weight changed since the compile) register with the capture
(``check_on_replay``) and run before each replay instead.

A call that writes an argument tensor in place (found after its warm-up: the tensor's
version counter moved, or an inference tensor's values changed) would write the graph's
copy instead on a replay: it stops the captures, with its reason. Every call runs the
model once, captured or not (a capture records the kernels, it runs none): the ranks of
an expert-parallel model pair each call's communication with each other's.

A call's tokens: the fewest any argument tensor with dimensions holds (the product of its
token dimensions): the token ids of a decode step hold one a sequence, where a mask over
the whole static cache holds its length; a 0-d tensor (a scale, a step) holds none.

At most MAX_GRAPHS graphs are kept, the least recently replayed dropped first. A
call that cannot be captured (a copy from the host, a synchronisation, a shape that
changes every step as a dynamic cache's does) runs as it is from then on, with one
logged reason. ``max_tokens`` and ``max_graphs`` are the runner's attributes (``.steps``
of what ``ptxforge.compile`` returns), read at every call.
"""

from __future__ import annotations

import collections
import logging
import math
import weakref

import torch

from . import graphs
from .rewriting import token_dims

log = logging.getLogger("ptxforge")

MAX_TOKENS = 256     # a call is captured when its tensors' token dimensions hold at most this
MAX_GRAPHS = 16      # graphs kept per runner, the least recently replayed dropped first
GROWING = 8          # new keys in a row: the shapes change every call
SEEN = 64            # keys remembered as seen once

_capturing: list[list] = []   # a list per capture in progress: the checks its call made


def check_on_replay(check) -> None:
    """Called by a check the compiled call makes on itself (``backend.FoldedWeights``): the
    capture in progress, if any, keeps ``check`` to run before each replay of its graph."""
    if _capturing:
        _capturing[-1].append(check)


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
        self.captured: set[tuple] = set()   # the keys captured, objects by their type
        self._new_in_a_row = 0

    def __call__(self, *args, **kwargs):
        if self.refused or torch.is_grad_enabled() or torch.compiler.is_dynamo_compiling():
            return self.fn(*args, **kwargs)
        names = tuple(kwargs)
        leaves = [*args, *kwargs.values()]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors or not _on_gpu(tensors) or _tokens(tensors) > self.max_tokens:
            return self.fn(*args, **kwargs)
        spec = (len(args), names)
        key = (spec, tuple(map(_leaf_key, leaves)))
        step = self.graphs.get(key)
        if step is not None:
            for check in step.checks:
                check()
            self._new_in_a_row = 0
            self.graphs.move_to_end(key)
            return step.replay(leaves)
        if key not in self.seen and _kinds(key) not in self.captured:
            self._new_in_a_row += 1
            if self._new_in_a_row > GROWING:
                self._refuse(f"{GROWING} calls in a row each with new shapes (a cache that "
                             f"grows every step?)")
                return self.fn(*args, **kwargs)
            self.seen[key] = None
            if len(self.seen) > SEEN:
                self.seen.popitem(last=False)
            return self.fn(*args, **kwargs)
        self.seen.pop(key, None)
        _capturing.append([])
        try:
            # The call runs once, here, on the caller's tensors; the capture records it on
            # the graph's own copies and runs nothing, so a refusal after it runs nothing
            # twice.
            copies = own_copies(leaves)
            versions = {i: leaves[i]._version for i in copies if not leaves[i].is_inference()}
            outputs = _Step.warm_up(self.fn, args, kwargs)
            written = _written(leaves, copies, versions, spec)
            if written:
                self._refuse(f"the call writes its argument {written} in place, where a "
                             f"graph would write its own copy")
                return outputs
            try:
                step = _Step.capture(self.fn, leaves, copies, spec, self.pool)
            except Exception as error:  # a capture the call's code forbids: run it as it is
                torch.cuda.synchronize()
                self._refuse(f"the call could not be captured: {type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}")
                return outputs
        finally:
            checks = _capturing.pop()
        step.checks = tuple(dict.fromkeys(checks))   # each made twice: warm-up, capture
        step.objects = [_watch(x, lambda _, key=key: self._drop(key))
                        for _, x in _objects(leaves)]
        self.pool = step.pool
        self.graphs[key] = step
        self.captured.add(_kinds(key))
        if len(self.graphs) > self.max_graphs:
            self._drop(next(iter(self.graphs)))
        return outputs

    def _drop(self, key) -> None:
        """Drop a graph. The graphs share a memory pool, which goes with the last of them:
        the next capture then starts a new one (a capture into a pool that has gone fails
        inside torch's allocator)."""
        self.graphs.pop(key, None)
        if not self.graphs:
            self.pool = None

    def _refuse(self, reason: str) -> None:
        """Stop capturing, with one logged reason."""
        self.refused = reason
        log.warning("ptxforge runs this model's calls without CUDA graphs from now on: %s",
                    reason)


def _watch(x, gone):
    """A weak reference to ``x`` that calls ``gone`` when x goes; x itself where it takes
    none."""
    try:
        return weakref.ref(x, gone)
    except TypeError:
        return x


class _Step:
    """One captured call: its graph, its own copies of the argument tensors (by position
    among the leaves), its outputs, the checks to run before a replay
    (``check_on_replay``) and the objects among its arguments (``objects``: weak
    references whose going drops the graph)."""

    def __init__(self, graph, copies: dict, outputs, pool, leaves: list):
        # An argument object among the outputs (the cache a transformers model returns) is
        # kept as its position, and a replay returns the caller's: the graph holds none.
        position = {id(x): _Leaf(i) for i, x in _objects(leaves)}
        self.outputs = graphs.map_tensors(outputs, lambda t: t,
                                          lambda x: position.get(id(x), x))
        self.graph, self.copies, self.pool = graph, copies, pool
        self.checks: tuple = ()
        self.objects: list = []

    @staticmethod
    def warm_up(fn, args, kwargs):
        """The call, once, on the caller's arguments, on a side stream as a capture asks
        (kernels assembled, workspaces allocated, lazy state such as a static cache's
        made): its outputs."""
        return graphs.warm_up(lambda: fn(*args, **kwargs))

    @classmethod
    def capture(cls, fn, leaves: list, copies: dict, spec, pool):
        """The step: the call captured on the graph's own copies of the argument tensors
        (``copies``, by position among the leaves) and the other leaves as they are."""
        own = [copies.get(i, x) for i, x in enumerate(leaves)]
        positional, names = spec
        args, kwargs = own[:positional], dict(zip(names, own[positional:]))
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        graph, outputs = graphs.capture(lambda: fn(*args, **kwargs), pool)
        return cls(graph, copies, outputs, pool, leaves)

    def replay(self, leaves: list):
        for i, copy in self.copies.items():
            copy.copy_(leaves[i])
        self.graph.replay()
        return graphs.map_tensors(
            self.outputs, torch.Tensor.clone,
            lambda x: leaves[x.position] if isinstance(x, _Leaf) else x)


class _Leaf:
    """In a captured call's outputs: the argument leaf at ``position``."""

    def __init__(self, position: int):
        self.position = position


def own_copies(leaves: list) -> dict:
    """A graph's own copies of the argument tensors, by position among the leaves: normal
    tensors even when captured under ``torch.inference_mode``, so that a replay outside it
    may copy into them (an inference tensor takes no in-place write there)."""
    with torch.inference_mode(False):
        return {i: x.clone() for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}


def _written(leaves: list, copies: dict, versions: dict, spec) -> str | None:
    """The first argument tensor the warm-up call wrote in place (its keyword, or its
    position), judged by its version counter (``versions``: before the call), or, for an
    inference tensor (which keeps none), by its values against the copy made before the
    call; None if none."""
    positional, names = spec
    for i, copy in copies.items():
        x = leaves[i]
        changed = x._version != versions[i] if i in versions else not torch.equal(x, copy)
        if changed:
            return repr(names[i - positional]) if i >= positional else str(i)
    return None


def _leaf_key(x):
    """What a graph captured for argument leaf ``x`` depends on: a tensor's shape, strides,
    dtype and device (its data is copied in); a number, string or None itself; any other
    object by identity and type (the graph reads and writes its tensors in place)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", (tuple(x.shape), x.stride(), x.dtype, x.device))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return ("value", x)
    return ("object", (id(x), type(x).__qualname__))


def _objects(leaves: list) -> list:
    """(position, leaf) of the argument leaves a graph holds in place, not by copy or value
    (``_leaf_key``'s objects: a transformers cache)."""
    return [(i, x) for i, x in enumerate(leaves) if _leaf_key(x)[0] == "object"]


def _kinds(key: tuple) -> tuple:
    """``key`` with each object by its type, not its identity: the same call on another
    object (the next generate's cache)."""
    spec, leaves = key
    return spec, tuple((kind, x[1]) if kind == "object" else (kind, x) for kind, x in leaves)


def _on_gpu(tensors: list) -> bool:
    """Whether every argument tensor is on a CUDA device: a graph records GPU work only, so
    a CPU model's captured call would replay nothing."""
    return all(x.is_cuda for x in tensors)


def _tokens(tensors: list) -> int:
    """The fewest tokens an argument tensor with dimensions holds: the product of its token
    dimensions (``token_dims``: every dimension longer than 1 but a float tensor's
    features); 0 where every argument tensor is 0-d."""
    return min((math.prod(x.shape[d] for d in token_dims(x)) for x in tensors if x.dim()),
               default=0)


class StepModule(torch.nn.Module):
    """A compiled module whose calls go through StepGraphs; its parameters and buffers are
    the module's (``compiled``, a submodule), and so are the attributes it lacks itself
    (the model's ``config``, ...), as torch.compile's module gives them."""

    def __init__(self, compiled: torch.nn.Module):
        super().__init__()
        self.compiled = compiled
        self.steps = StepGraphs(compiled)

    def forward(self, *args, **kwargs):
        return self.steps(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            compiled = self.__dict__.get("_modules", {}).get("compiled")
            if compiled is None:
                raise
            return getattr(compiled, name)
