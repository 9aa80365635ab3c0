"""CUDA graphs for the backend's ``mode="reduce-overhead"``: the compiled function replayed
as one graph per shape of its inputs, so a call costs a copy in, a replay and a copy out
on the host instead of a launch per kernel. Shapes whose changing inputs are too large to
be worth the copy (``MAX_COPY_BYTES``) run without a graph.

    call(*inputs) --shapes seen before?--> copy the inputs that change into the graph's
                                           own, replay, clone the outputs
                  --new shapes-----------> run once (warm-up: kernels assembled, buffers
                                           allocated), capture; the warm-up's outputs are
                                           the call's

Every call runs the model once, whether it replays, captures or runs without a graph (a
capture runs nothing): an expert-parallel layer's ranks pair each call's communication
with the other ranks' calls, whichever of the three each rank makes.

The model's parameters and buffers (the inputs Dynamo marks static) are read where they
are: a graph holds their addresses, as it holds the weights the passes quantized. A
static input other than a parameter may be another tensor at the next call without
Dynamo compiling again (``torch._dynamo.mark_static_address`` leaves the address
unguarded unless asked: transformers' static KV cache, made anew by each ``generate``):
its address is part of a graph's key, so a new one gets a graph of its own instead of a
replay into the tensor of an earlier call. The
outputs are cloned because the next replay overwrites the graph's own. Inductor's CUDA
graphs (cudagraph trees) do the same job with more bookkeeping per call (measured in
docs/performance.md); this runner is what ``mode="reduce-overhead"`` means here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

# Graphs kept per compiled function, the least recently used dropped first: one per token
# count a server sees, and one per generate where its static cache is new each time.
MAX_GRAPHS = 64
# A graph saves the launches, and costs a copy of the changing inputs in: above this many
# bytes of them the call runs without one (the FFN block at 4096 tokens, 58 MB of x: its
# copy and the output's cost 56 us of 425, measured, where launching is hidden behind the
# kernels anyway).
MAX_COPY_BYTES = 8 << 20


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list            # the graph's own copies of the changing inputs, by position
    outputs: object         # what the captured call returned


class GraphRunner:
    """``fn`` (the compiled graph: flat tensor and int inputs -> tensors) replayed as CUDA
    graphs; ``changing``: the positions of the inputs a call may change (the others are
    read in place); ``held``: those of the inputs read in place that may be other tensors
    at another call (static inputs but parameters), whose addresses a graph is for."""

    def __init__(self, fn, changing: list[int], held: list[int] = ()):
        self.fn, self.changing, self.held = fn, changing, tuple(held)
        # None: this shape runs without one. Oldest use first.
        self.graphs: collections.OrderedDict[tuple, _Graph | None] = collections.OrderedDict()
        self.pool = None

    def _key(self, inputs) -> tuple:
        return (tuple(_signature(x) for x in map(inputs.__getitem__, self.changing)),
                tuple(_address(inputs[i]) for i in self.held))

    def __call__(self, *inputs):
        key = self._key(inputs)
        entry = self.graphs.get(key, False)
        if entry is False:
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.popitem(last=False)
                if not any(self.graphs.values()):
                    # The graphs' shared memory pool went with the last of them: the next
                    # capture makes a new one (one into a released pool fails in torch).
                    self.pool = None
            if self._worth(inputs):
                self.graphs[key], outputs = self._capture(inputs)
                return outputs
            self.graphs[key] = entry = None
        else:
            self.graphs.move_to_end(key)
        if entry is None:
            return self.fn(*inputs)
        for i, copy in entry.inputs:
            copy.copy_(inputs[i])
        entry.graph.replay()
        return map_tensors(entry.outputs, torch.Tensor.clone)

    def _worth(self, inputs) -> bool:
        tensors = [inputs[i] for i in self.changing if isinstance(inputs[i], torch.Tensor)]
        return torch.cuda.is_available() and sum(x.nbytes for x in tensors) <= MAX_COPY_BYTES

    def _capture(self, inputs) -> tuple:
        """(the graph of a call on ``inputs``, the warm-up's outputs)."""
        copies = [(i, inputs[i].clone()) for i in self.changing
                  if isinstance(inputs[i], torch.Tensor)]
        args = list(inputs)
        for i, copy in copies:
            args[i] = copy
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        warm = warm_up(lambda: self.fn(*args))
        graph, outputs = capture(lambda: self.fn(*args), self.pool)
        return _Graph(graph, copies, outputs), warm


def warm_up(call):
    """``call()`` once on a side stream, as torch's graph capture asks (lazy work,
    assembling kernels, allocating workspaces, a static cache's first state, happens before
    the capture, not inside it); its outputs, recorded on the current stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm = call()
    current = torch.cuda.current_stream()
    current.wait_stream(stream)
    map_tensors(warm, lambda t: t.record_stream(current))   # (allocated on the side stream)
    return warm


def capture(call, pool) -> tuple:
    """(graph, its outputs): ``call()`` captured into the memory pool ``pool`` (a capture
    records the kernels; it runs none)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = call()
    return graph, outputs


def _signature(x):
    """What a graph captured for input ``x`` depends on: a GPU tensor's shape, strides and
    dtype (its data is copied in), a CPU scalar's value (a float attribute Dynamo lifted,
    read on the host when the graph is captured), any other argument itself."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "cpu" and x.numel() == 1:
        return x.item()
    return x.shape, x.stride(), x.dtype, x.device


def _address(x):
    """Where a graph reads and writes an input it holds in place."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x


def map_tensors(value, fn, other=None):
    """``value`` with ``fn`` applied to the tensors in it, through lists, tuples and dicts
    (a transformers ModelOutput is one); ``other`` to any other object (None: each as it
    is)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn, other) for v in value)
    if isinstance(value, dict):
        return type(value)(**{name: map_tensors(v, fn, other) for name, v in value.items()})
    return value if other is None else other(value)
