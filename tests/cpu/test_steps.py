"""The decode runner (``compiler/steps.py``) on the CPU: which calls it captures, what a
graph is keyed on (argument tensors' shapes by copy, other objects by identity), when it
stops capturing and why, the outputs it returns, and when ``compile`` puts it in. The
capture itself is replaced by a stand-in that runs the call again on the graph's own
argument copies, which is what a replay computes, and the tensors are taken for GPU
ones; the CUDA side runs in tests/gpu/test_compiler_gpu.py."""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import logging
import weakref

import pytest

torch = pytest.importorskip("torch")

from ptxforge import compiler  # noqa: E402
from ptxforge.compiler import steps  # noqa: E402


class _Graph:
    """A captured graph's stand-in: a replay runs ``fn`` on the graph's own argument copies
    and the argument objects (weakly held, as the runner holds them) and writes its tensors
    into the captured outputs' own, as a graph's replay would (whatever the tensors: in
    inference mode, which writes into inference tensors too)."""

    def __init__(self, fn, own, spec):
        self.fn, self.spec, self.replays = fn, spec, 0
        self.own = [x if isinstance(x, torch.Tensor) or steps._leaf_key(x)[0] != "object"
                    else steps._watch(x, None) for x in own]
        self.outputs = None

    def replay(self):
        own = [x() if isinstance(x, weakref.ref) else x for x in self.own]
        positional, names = self.spec
        result = self.fn(*own[:positional], **dict(zip(names, own[positional:])))
        with torch.inference_mode():
            self.outputs["logits"].copy_(result["logits"])
        self.replays += 1


@pytest.fixture
def captures(monkeypatch):
    """Every capture made (the steps; ``step.graph.replays`` counts a step's replays),
    through the stand-in; every tensor taken for a GPU one; the test under
    ``torch.no_grad``, as transformers' generate calls the model."""
    made = []

    def capture(fn, leaves, copies, spec, pool):
        own = [copies.get(i, x) for i, x in enumerate(leaves)]
        positional, names = spec
        # A capture runs nothing: the stand-in's outputs come from a call on throwaway
        # copies of the objects (a cache written once per call, as on the GPU).
        scratch = [x if isinstance(x, torch.Tensor) else _scratch(x) for x in own]
        outputs = fn(*scratch[:positional], **dict(zip(names, scratch[positional:])))
        originals = {id(s): x for s, x in zip(scratch, own) if s is not x}
        outputs = {name: originals.get(id(value), value) for name, value in outputs.items()}
        graph = _Graph(fn, own, spec)
        pool = pool if pool is not None else f"pool {len(made)}"   # as a capture makes one
        step = steps._Step(graph, copies, outputs, pool, leaves)
        graph.outputs = step.outputs
        made.append(step)
        return step

    monkeypatch.setattr(steps._Step, "capture", staticmethod(capture))
    monkeypatch.setattr(steps._Step, "warm_up",
                        staticmethod(lambda fn, args, kwargs: fn(*args, **kwargs)))
    monkeypatch.setattr(steps, "_on_gpu", lambda tensors: True)
    with torch.no_grad():
        yield made


def _scratch(obj):
    """A throwaway copy of an object argument, its tensors cloned."""
    scratch = copy.copy(obj)
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(scratch, name, value.detach().clone())
    return scratch


class _Cache:
    """A static cache's stand-in: the call adds into it in place."""

    def __init__(self):
        self.total = torch.zeros(4)


def _forward(input_ids, cache_position, past_key_values, use_cache=True):
    past_key_values.total += input_ids.float().sum()
    return {"logits": input_ids.float() * 2 + cache_position.float(),
            "past_key_values": past_key_values}


def _step(runner, cache, value, position=0, batch=1):
    return runner(input_ids=torch.full((batch, 1), value), cache_position=torch.tensor([position]),
                  past_key_values=cache)


def test_a_decode_step_is_captured_the_second_time_and_replayed_on_new_values(captures):
    runner, cache = steps.StepGraphs(_forward), _Cache()
    for position in range(4):
        out = _step(runner, cache, position + 1, position)
        assert torch.equal(out["logits"], torch.tensor([[2.0 * (position + 1) + position]]))
        assert out["past_key_values"] is cache     # the object as the call returned it
    # the first call ran as it is, the second was captured, the others replayed
    assert len(captures) == 1 and captures[0].graph.replays == 2
    assert cache.total.tolist() == [10.0] * 4      # every call ran once
    first, again = _step(runner, cache, 5), _step(runner, cache, 6)
    assert first["logits"].item() == 10.0          # the next replay did not overwrite it
    assert again["logits"].item() == 12.0


def test_a_prompt_that_comes_once_is_not_captured(captures):
    runner, cache = steps.StepGraphs(_forward), _Cache()
    runner(input_ids=torch.ones(1, 16, dtype=torch.long), cache_position=torch.arange(16),
           past_key_values=cache)
    assert captures == [] and len(runner.seen) == 1


def test_another_object_or_shape_gets_a_graph_of_its_own(captures):
    runner, one, two = steps.StepGraphs(_forward), _Cache(), _Cache()
    for _ in range(3):
        _step(runner, one, 1)
        _step(runner, two, 1)                      # the next generate's cache
        _step(runner, one, 1, batch=2)             # a batch of two
    assert len(captures) == 3 and [c.graph.replays for c in captures] == [1, 1, 1]
    assert _step(runner, two, 2)["past_key_values"] is two     # the caller's, returned


def test_graphs_of_old_caches_make_room_for_new_ones(captures):
    """A generate a cache: past max_graphs, the least recently replayed graph goes."""
    runner = steps.StepGraphs(_forward, max_graphs=2)
    caches = [_Cache() for _ in range(4)]
    for cache in caches:
        for position in range(3):
            _step(runner, cache, 1, position)
    assert len(captures) == 4 and runner.refused is None
    assert [step.objects[0]() for step in runner.graphs.values()] == caches[2:]


def test_the_next_caches_first_step_is_captured_at_once(captures):
    """A call like one captured before on another object (the next generate's first decode
    step on its new cache) is captured the first time; a new shape still waits for its
    second."""
    runner, first, second = steps.StepGraphs(_forward), _Cache(), _Cache()
    for position in range(3):
        _step(runner, first, 1, position)
    assert [c.graph.replays for c in captures] == [1]
    _step(runner, second, 1, 0)
    assert len(captures) == 2
    _step(runner, second, 1, 1, batch=2)
    assert len(captures) == 2 and len(runner.seen) == 1


def test_a_graph_goes_with_its_cache(captures):
    """A graph does not keep its cache alive (a generate's cache is new each time, and can
    be 17 GB): when the cache goes, so does the graph; with the last graph its memory pool,
    and the next capture makes a new one."""
    runner, caches = steps.StepGraphs(_forward), [_Cache(), _Cache()]
    for cache in caches:
        for position in range(3):
            _step(runner, cache, 1, position)
    assert len(runner.graphs) == 2
    gone = weakref.ref(caches.pop(0))
    gc.collect()
    assert gone() is None and [step.objects[0]() for step in runner.graphs.values()] == caches
    assert runner.pool == "pool 0"                 # shared, and held by the graph left
    del cache
    caches.clear()
    gc.collect()
    assert runner.graphs == {} and runner.pool is None   # gone with the last graph
    new = _Cache()
    for position in range(2):
        _step(runner, new, 1, position)
    assert runner.pool == "pool 2" and len(runner.graphs) == 1


def test_many_tokens_run_as_they_are(captures):
    runner = steps.StepGraphs(_forward, max_tokens=8)
    prompt = torch.arange(64).view(1, 64)
    out = runner(input_ids=prompt, cache_position=torch.arange(64), past_key_values=_Cache())
    assert captures == [] and runner.refused is None
    assert torch.equal(out["logits"], prompt.float() * 2 + torch.arange(64))


def test_shapes_that_change_every_call_stop_the_captures_with_a_reason(captures, caplog):
    """A dynamic cache's calls: an argument one longer every step (here the positions)."""
    runner, cache = steps.StepGraphs(_forward), _Cache()
    with caplog.at_level(logging.WARNING, logger="ptxforge"):
        for length in range(1, 13):
            out = runner(input_ids=torch.tensor([[1]]), cache_position=torch.zeros(length, 1),
                         past_key_values=cache)
            assert out["logits"].tolist() == [[2.0]] * length
    assert captures == []
    assert runner.refused and "each with new shapes" in runner.refused
    assert sum("without CUDA graphs" in r.message for r in caplog.records) == 1
    assert cache.total.tolist() == [12.0] * 4      # every call ran once


@torch.no_grad()
def test_a_call_that_cannot_be_captured_runs_as_it_is_once(monkeypatch, caplog):
    """The capture fails after the warm-up ran the call: the warm-up's outputs are the
    call's, and nothing runs twice (an expert-parallel rank would pair an extra call's
    communication with its peers' next)."""
    monkeypatch.setattr(steps, "_on_gpu", lambda tensors: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(steps._Step, "warm_up",
                        staticmethod(lambda fn, args, kwargs: fn(*args, **kwargs)))

    def capture(fn, leaves, copies, spec, pool):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(steps._Step, "capture", staticmethod(capture))
    runner, cache = steps.StepGraphs(_forward), _Cache()
    with caplog.at_level(logging.WARNING, logger="ptxforge"):
        for _ in range(3):
            out = _step(runner, cache, 3, 1)
            assert out["logits"].item() == 7.0
    assert "could not be captured: RuntimeError: Cannot copy between CPU and CUDA" in \
        runner.refused
    assert "without CUDA graphs" in caplog.text
    assert cache.total.tolist() == [9.0] * 4      # three calls, each run once


def _accumulate(x, total):
    total += x.sum()
    return {"logits": total * 1}


@pytest.mark.parametrize("inference", [False, True])
def test_a_call_writing_an_argument_in_place_stops_the_captures(captures, caplog, inference):
    """Its warm-up wrote the caller's tensor (its version counter moved; an inference
    tensor's values changed): a graph would write its own copy, so the calls run as they
    are from then on, each writing the caller's tensor."""
    runner = steps.StepGraphs(_accumulate)
    with torch.inference_mode() if inference else contextlib.nullcontext():
        total = torch.zeros(())
        with caplog.at_level(logging.WARNING, logger="ptxforge"):
            for _ in range(4):
                runner(torch.ones(1, 2), total=total)
    assert total.item() == 8.0
    assert captures == []
    assert runner.refused == ("the call writes its argument 'total' in place, where a graph "
                              "would write its own copy")
    assert "without CUDA graphs" in caplog.text


@torch.no_grad()
def test_calls_on_cpu_tensors_run_as_they_are(monkeypatch):
    """A CPU model, on a machine with a GPU or without: a graph would replay nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runner, cache = steps.StepGraphs(_forward), _Cache()
    for _ in range(3):
        out = _step(runner, cache, 2)
        assert out["logits"].item() == 4.0
    assert runner.graphs == {} and not runner.seen and runner.refused is None
    assert cache.total.tolist() == [6.0] * 4       # every call ran once


def test_calls_that_autograd_records_run_as_they_are_and_later_ones_capture(captures):
    """A replay's cloned outputs would carry no autograd history: with grad enabled a call
    runs as it is, refuses nothing and leaves no key seen; under no_grad or inference_mode
    the same step captures and replays."""
    weight = torch.tensor(2.0, requires_grad=True)

    def forward(input_ids, cache_position, past_key_values):
        return _forward(input_ids * weight, cache_position, past_key_values)

    runner, cache = steps.StepGraphs(forward), _Cache()
    with torch.enable_grad():
        for _ in range(3):
            out = _step(runner, cache, 1)
            assert out["logits"].item() == 4.0 and out["logits"].grad_fn is not None
    assert captures == [] and not runner.seen and runner.refused is None
    with torch.inference_mode():
        for _ in range(3):
            assert _step(runner, cache, 1)["logits"].item() == 4.0
    assert len(captures) == 1 and captures[0].graph.replays == 1
    with torch.enable_grad():
        out = _step(runner, cache, 3)
    assert out["logits"].item() == 12.0 and out["logits"].grad_fn is not None
    assert captures[0].graph.replays == 1                # ran as it is, the graph kept
    assert _step(runner, cache, 3)["logits"].item() == 12.0 and captures[0].graph.replays == 2


class _Frozen:
    """A captured call's stand-in that, as a graph's replay, runs none of its Python."""

    pool = None

    def __init__(self, outputs):
        self.outputs = outputs

    def replay(self, leaves):
        return self.outputs.clone()


@torch.no_grad()
def test_a_weight_changed_after_the_capture_is_refused_before_a_replay(monkeypatch):
    """backend.FoldedWeights checks the weights in Python, which a replay does not run: the
    capture keeps the check and the runner makes it before each replay."""
    backend = importlib.import_module("ptxforge.compiler.backend")
    weight = torch.ones(4)
    compiled = backend.FoldedWeights(lambda x: x * 2, [weight])

    def capture(fn, leaves, copies, spec, pool):
        return _Frozen(fn(*leaves))

    monkeypatch.setattr(steps._Step, "capture", staticmethod(capture))
    monkeypatch.setattr(steps._Step, "warm_up",
                        staticmethod(lambda fn, args, kwargs: fn(*args, **kwargs)))
    monkeypatch.setattr(steps, "_on_gpu", lambda tensors: True)
    runner = steps.StepGraphs(compiled)
    for _ in range(3):
        assert runner(torch.ones(1, 4)).tolist() == [[2.0] * 4]
    (step,) = runner.graphs.values()
    assert step.checks == (compiled.check,)
    weight.mul_(2)
    with pytest.raises(RuntimeError, match="compile the model again"):
        runner(torch.ones(1, 4))


@pytest.mark.parametrize("step_graphs", [None, True])
def test_compile_wraps_the_compiled_call_by_default_or_when_asked(step_graphs):
    model = torch.nn.Linear(4, 4)
    compiled = compiler.compile(model, step_graphs=step_graphs)
    assert isinstance(compiled, steps.StepModule)
    assert set(dict(compiled.named_parameters())) == {"compiled._orig_mod.weight",
                                                      "compiled._orig_mod.bias"}
    assert compiled.in_features == 4               # the model's attributes, through it
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    call = compiler.compile(lambda x: model(x), step_graphs=step_graphs)
    assert isinstance(call.steps, steps.StepGraphs)
    torch.testing.assert_close(call(x), model(x))


@pytest.mark.parametrize("options", [dict(step_graphs=False), dict(mode="reduce-overhead"),
                                     dict(mode="max-autotune"),
                                     dict(options={"triton.cudagraphs": True})])
def test_compile_leaves_the_call_unwrapped_when_asked_or_with_cuda_graphs_inside(options):
    model = torch.nn.Linear(4, 4)
    assert not isinstance(compiler.compile(model, **options), steps.StepModule)
    assert compiler.compile(lambda x: model(x), **options).steps is None


def test_compile_leaves_the_call_unwrapped_with_an_ep_group(monkeypatch):
    """The expert-parallel normal path synchronises with the host: no capture holds it, and
    asking for one is refused."""
    backend = importlib.import_module("ptxforge.compiler.backend")
    monkeypatch.setattr(backend.expert_parallel, "expert_parallel", lambda *a, **k: None)
    model = torch.nn.Linear(4, 4)
    assert not isinstance(compiler.compile(model, ep_group=object()), steps.StepModule)
    with pytest.raises(ValueError, match="ep_group's normal path synchronises with the host"):
        compiler.compile(model, ep_group=object(), step_graphs=True)


@pytest.mark.parametrize("options", [dict(mode="reduce-overhead"), dict(mode="max-autotune"),
                                     dict(options={"triton.cudagraphs": True})])
def test_step_graphs_and_cuda_graphs_inside_are_one_or_the_other(options):
    with pytest.raises(ValueError, match="pass one or the other"):
        compiler.compile(torch.nn.Linear(4, 4), step_graphs=True, **options)
