"""The ONNX front end on the CPU. Every op of the table as a one-node model, on random
inputs, against onnx's reference evaluator at opset 18 and 23 (where the op exists);
the errors for what the table does not take; a small Llama exported by
torch.onnx.export (dynamo) at opset 18 and 23, run against onnxruntime at two sequence
lengths, and traced on the meta device, where the backend's passes find its Linears,
RMSNorms, SwiGLUs, residual adds and causal attention as in the PyTorch model."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import ptxforge.onnx as ptxforge_onnx  # noqa: E402
from ptxforge import cli  # noqa: E402
from ptxforge import models  # noqa: E402
from ptxforge.testing.checks import calc_diff  # noqa: E402

_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL,
         np.dtype(np.float16): TensorProto.FLOAT16}
_RNG = np.random.default_rng(0)


def f32(*shape):
    return _RNG.standard_normal(shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


class Const:
    """An input given as an initializer (shapes, axes, indices)."""

    def __init__(self, value):
        self.value = np.asarray(value)


def one_node(op, inputs, opset, outputs=1, **attributes):
    """A model of one ``op`` node: inputs given as arrays are graph inputs of their shape,
    ``Const`` ones initializers, None omitted."""
    names, graph_inputs, initializers, feeds = [], [], [], {}
    for i, value in enumerate(inputs):
        if value is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(value, Const):
            initializers.append(numpy_helper.from_array(value.value, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, _ELEM[value.dtype],
                                                              value.shape))
            feeds[name] = value
    outs = [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op, names, outs, name="the_node", **attributes)
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outs],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), feeds


def run_both(model, feeds):
    expected = ReferenceEvaluator(model).run(None, feeds)
    module = ptxforge_onnx.load(model)
    got = module(*(torch.from_numpy(v) for v in feeds.values()))
    got = got if isinstance(got, tuple) else (got,)
    return expected, [g.numpy() if g.dtype != torch.bfloat16 else g.float().numpy() for g in got]


def check(op, inputs, opset=18, **attributes):
    expected, got = run_both(*one_node(op, inputs, opset, **attributes))
    for e, g in zip(expected, got):
        e = np.asarray(e)
        assert g.shape == e.shape, (op, g.shape, e.shape)
        if e.dtype.kind == "f" or g.dtype.kind == "f":
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64),
                                       rtol=2e-5, atol=2e-5, err_msg=op)
        else:
            assert g.dtype == e.dtype, (op, g.dtype, e.dtype)
            np.testing.assert_array_equal(g, e, err_msg=op)


BIG = np.iinfo(np.int64).max
# (id, op, inputs, attributes): run at opset 18 and 23
CASES = [
    ("add broadcast", "Add", [f32(2, 3, 4), f32(4)], {}),
    ("add int const", "Add", [i64(1, 2, 3), Const(i64(5))], {}),
    ("sub broadcast", "Sub", [f32(3, 1), f32(1, 4)], {}),
    ("mul scalar", "Mul", [f32(2, 3), Const(np.float32(0.5))], {}),
    ("div float", "Div", [f32(2, 3), f32(3) + 3], {}),
    ("div int truncates", "Div", [i64(-7, 7, -8, 9), i64(2, -2, 3, 4)], {}),
    ("pow", "Pow", [np.abs(f32(2, 3)), Const(np.float32(2.0))], {}),
    ("max variadic", "Max", [f32(3, 1), f32(1, 4), f32(4)], {}),
    ("min", "Min", [f32(3, 4), f32(4)], {}),
    ("equal", "Equal", [i64(1, 2, 3), i64(1, 0, 3)], {}),
    ("less or equal", "LessOrEqual", [f32(3, 1), f32(1, 4)], {}),
    ("less", "Less", [f32(3, 4), f32(4)], {}),
    ("greater", "Greater", [f32(3, 4), f32(3, 1)], {}),
    ("greater or equal", "GreaterOrEqual", [i64(1, 2, 3), Const(i64(2))], {}),
    ("and", "And", [f32(3, 4) > 0, f32(4) > 0], {}),
    ("or", "Or", [f32(3, 4) > 0, f32(3, 1) > 0], {}),
    ("not", "Not", [f32(3, 4) > 0], {}),
    ("isnan", "IsNaN", [np.array([1.0, np.nan, -np.inf], np.float32)], {}),
    ("neg", "Neg", [f32(3, 4)], {}),
    ("sqrt", "Sqrt", [np.abs(f32(3, 4))], {}),
    ("reciprocal", "Reciprocal", [f32(3, 4) + 4], {}),
    ("exp", "Exp", [f32(3, 4)], {}),
    ("sigmoid", "Sigmoid", [f32(3, 4)], {}),
    ("sin", "Sin", [f32(3, 4)], {}),
    ("cos", "Cos", [f32(3, 4)], {}),
    ("where broadcast", "Where", [f32(3, 1) > 0, f32(1, 4), Const(np.float32(-1.0))], {}),
    ("where both constant", "Where", [f32(2, 3) > 0, Const(np.float32(0)),
                                      Const(np.float32(np.finfo(np.float32).min))], {}),
    ("cast float to int", "Cast", [f32(3, 4) * 5], {"to": TensorProto.INT64}),
    ("cast int to float", "Cast", [i64(1, -2, 3)], {"to": TensorProto.FLOAT}),
    ("cast bool to float", "Cast", [f32(3) > 0], {"to": TensorProto.FLOAT}),
    ("cast to float16", "Cast", [f32(3, 4)], {"to": TensorProto.FLOAT16}),
    ("cast to bfloat16", "Cast", [f32(3, 4)], {"to": TensorProto.BFLOAT16}),
    ("cast to int32", "Cast", [i64(1, 2, 3)], {"to": TensorProto.INT32}),
    ("shape", "Shape", [f32(2, 3, 4)], {}),
    ("shape start end", "Shape", [f32(2, 3, 4, 5)], {"start": -3, "end": -1}),
    ("reshape 0 and -1", "Reshape", [f32(2, 3, 4), Const(i64(0, -1))], {}),
    ("reshape allowzero", "Reshape", [f32(2, 3, 4), Const(i64(4, 6))], {"allowzero": 1}),
    ("expand", "Expand", [f32(3, 1), Const(i64(2, 3, 4))], {}),
    ("expand keeps larger", "Expand", [f32(3, 4), Const(i64(1, 1))], {}),
    ("expand fewer dims", "Expand", [f32(2, 1, 4), Const(i64(3, 1))], {}),
    ("transpose perm", "Transpose", [f32(2, 3, 4)], {"perm": [1, 2, 0]}),
    ("transpose default", "Transpose", [f32(2, 3, 4)], {}),
    ("concat last", "Concat", [f32(2, 3), f32(2, 1)], {"axis": -1}),
    ("concat first", "Concat", [f32(1, 3), f32(2, 3), Const(f32(1, 3))], {"axis": 0}),
    ("unsqueeze", "Unsqueeze", [f32(2, 3), Const(i64(0, -1))], {}),
    ("squeeze axes", "Squeeze", [f32(2, 1, 3, 1), Const(i64(-1))], {}),
    ("squeeze all", "Squeeze", [f32(2, 1, 3, 1)], {}),
    ("gather negative", "Gather", [f32(5, 3), i64(0, -1, 2, -5)], {}),
    ("gather axis 1", "Gather", [f32(2, 5, 3), np.array([[1, -2], [0, 4]])], {"axis": 1}),
    ("gather scalar index", "Gather", [f32(4, 3), Const(np.int64(-2))], {"axis": 0}),
    ("gather table", "Gather", [Const(f32(10, 3)), np.array([[1, 9], [0, -1]])], {}),
    ("gathernd", "GatherND", [f32(2, 3, 4), np.array([[0, 1], [1, -1]])], {}),
    ("gathernd full", "GatherND", [f32(2, 3, 4), np.array([[[0, 1, 3]], [[1, 2, 0]]])], {}),
    ("slice steps", "Slice", [f32(10, 6), Const(i64(1, 0)), Const(i64(8, 5)),
                              Const(i64(0, 1)), Const(i64(3, 2))], {}),
    ("slice negative starts", "Slice", [f32(10, 6), Const(i64(-3)), Const(i64(BIG)),
                                        Const(i64(-1))], {}),
    ("slice clamped", "Slice", [f32(5, 6), Const(i64(-100, 2)), Const(i64(100, 1000))], {}),
    ("slice negative step", "Slice", [f32(10, 6), Const(i64(-2)), Const(i64(-BIG)),
                                      Const(i64(0)), Const(i64(-3))], {}),
    ("slice reverse", "Slice", [f32(4, 6), Const(i64(BIG, 4)), Const(i64(-BIG, 0)),
                                Const(i64(0, 1)), Const(i64(-1, -2))], {}),
    ("slice empty", "Slice", [f32(5, 6), Const(i64(4)), Const(i64(2)), Const(i64(0))], {}),
    ("slice to int64 min", "Slice", [f32(5, 6), Const(i64(2)), Const(i64(-BIG - 1)),
                                     Const(i64(1))], {}),
    ("range int", "Range", [Const(np.int64(2)), Const(np.int64(11)), Const(np.int64(3))], {}),
    ("range float", "Range", [Const(np.float32(1)), Const(np.float32(-2)),
                              Const(np.float32(-0.5))], {}),
    ("reducemean last", "ReduceMean", [f32(2, 3, 4), Const(i64(-1))], {}),
    ("reducemean no keepdims", "ReduceMean", [f32(2, 3, 4), Const(i64(0, 2))], {"keepdims": 0}),
    ("reducemean all", "ReduceMean", [f32(2, 3, 4)], {}),
    ("reducemean noop", "ReduceMean", [f32(2, 3, 4)], {"noop_with_empty_axes": 1}),
    ("softmax axis", "Softmax", [f32(2, 3, 4)], {"axis": 1}),
    ("softmax default", "Softmax", [f32(2, 3, 4)], {}),
    ("cumsum", "CumSum", [f32(3, 4), Const(np.int64(1))], {}),
    ("cumsum exclusive", "CumSum", [i64(1, 2, 3, 4), Const(np.int64(0))], {"exclusive": 1}),
    ("cumsum reverse", "CumSum", [f32(3, 4), Const(np.int64(-2))], {"reverse": 1}),
    ("cumsum both", "CumSum", [f32(3, 4), Const(np.int64(-1))], {"reverse": 1, "exclusive": 1}),
    ("matmul batched", "MatMul", [f32(2, 1, 3, 4), f32(5, 4, 6)], {}),
    ("matmul vector", "MatMul", [f32(4), f32(3, 4, 2)], {}),
    ("matmul weight", "MatMul", [f32(2, 3, 4), Const(f32(4, 5))], {}),
    ("gemm", "Gemm", [f32(3, 4), f32(4, 5), f32(5)], {}),
    ("gemm trans alpha beta", "Gemm", [f32(4, 3), f32(5, 4), f32(3, 1)],
     {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}),
    ("gemm weight bias", "Gemm", [f32(3, 4), Const(f32(5, 4)), Const(f32(5))], {"transB": 1}),
    ("gemm weight alpha", "Gemm", [f32(3, 4), Const(f32(4, 5)), Const(f32(3, 5))],
     {"alpha": 2.0, "beta": 0.5}),
    ("identity", "Identity", [f32(2, 3)], {}),
    ("constant of shape", "ConstantOfShape", [Const(i64(2, 3))],
     {"value": numpy_helper.from_array(np.array([1.5], np.float32))}),
    ("constant", "Constant", [], {"value": numpy_helper.from_array(f32(2, 3))}),
    ("constant ints", "Constant", [], {"value_ints": [3, 1, 2]}),
]


@pytest.mark.parametrize("opset", [18, 23])
@pytest.mark.parametrize("op, inputs, attributes", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_op_matches_the_reference(op, inputs, attributes, opset):
    check(op, inputs, opset, **attributes)


def rope_caches(batch, length, half):
    angles = _RNG.standard_normal((batch, length, half)).astype(np.float32)
    return np.cos(angles), np.sin(angles)


@pytest.mark.parametrize("case", ["4-D", "4-D interleaved", "3-D positions", "partial"])
def test_rotary_embedding_matches_the_reference(case):
    if case.startswith("4-D"):
        cos, sin = rope_caches(2, 5, 4)
        check("RotaryEmbedding", [f32(2, 3, 5, 8), cos, sin], 23,
              interleaved=int(case.endswith("interleaved")))
    elif case == "3-D positions":
        cos, sin = rope_caches(1, 16, 4)
        positions = np.array([[3, 1, 0, 15, 7], [2, 2, 9, 4, 0]])
        check("RotaryEmbedding", [f32(2, 5, 24), cos[0], sin[0], positions], 23, num_heads=3)
    else:
        cos, sin = rope_caches(2, 5, 2)
        check("RotaryEmbedding", [f32(2, 3, 5, 8), cos, sin], 23, rotary_embedding_dim=4)


@pytest.mark.parametrize("case", ["bool mask", "gqa causal", "3-D float mask", "scale"])
def test_attention_matches_the_reference(case):
    if case == "bool mask":
        mask = f32(1, 1, 5, 7) > -1.0
        mask[..., 0] = True   # no row hidden entirely
        check("Attention", [f32(2, 4, 5, 8), f32(2, 4, 7, 8), f32(2, 4, 7, 8), mask], 23)
    elif case == "gqa causal":
        check("Attention", [f32(2, 4, 5, 8), f32(2, 2, 5, 8), f32(2, 2, 5, 8)], 23, is_causal=1)
    elif case == "3-D float mask":
        check("Attention", [f32(2, 5, 32), f32(2, 7, 16), f32(2, 7, 24), f32(5, 7)], 23,
              q_num_heads=4, kv_num_heads=2)
    else:
        check("Attention", [f32(1, 2, 3, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8)], 23, scale=0.3)


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("scale", ["initializer", "input"])
def test_rms_normalization_matches_the_reference(axis, scale):
    shape = (4,) if axis == -1 else (3, 4)
    weight = Const(f32(*shape)) if scale == "initializer" else f32(*shape)
    check("RMSNormalization", [f32(2, 3, 4), weight], 23, axis=axis, epsilon=1e-3)


# --- errors ------------------------------------------------------------------------------------

def load_error(model) -> str:
    with pytest.raises(ValueError) as error:
        ptxforge_onnx.load(model)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_unsupported_op_names_the_node_its_op_and_opset():
    model, _ = one_node("TopK", [f32(3, 4), Const(i64(2))], 18, outputs=2)
    assert load_error(model).startswith(
        "ptxforge.onnx: node 'the_node' (TopK, opset 18): the op is not supported; "
        "ptxforge.onnx takes Add, And, Attention, Cast,")


def test_an_op_version_the_table_does_not_take_is_refused():
    model, _ = one_node("ReduceMean", [f32(3, 4)], 13, axes=[-1])
    assert load_error(model) == ("ptxforge.onnx: node 'the_node' (ReduceMean, opset 13): "
                                 "ReduceMean-13 is not supported (versions taken: 18)")
    model, _ = one_node("Attention", [f32(1, 2, 3, 8)] * 3, 24)
    assert "(Attention, opset 24): Attention-24 is not supported (versions taken: 23)" in \
        load_error(model)


def test_unsupported_attributes_are_refused():
    model, _ = one_node("Attention", [f32(1, 2, 3, 8)] * 3, 23, softcap=30.0)
    assert load_error(model) == ("ptxforge.onnx: node 'the_node' (Attention, opset 23): "
                                 "attribute softcap=30.0 is not supported (takes 0.0)")
    model, _ = one_node("Softmax", [f32(3, 4)], 18, log=1)
    assert load_error(model).endswith("attribute log is not supported (takes: axis)")
    model, _ = one_node("Attention", [f32(1, 2, 3, 8)] * 3, 23, outputs=2)
    assert "inputs or outputs 'out1' are not supported" in load_error(model)


def test_unsupported_dtypes_are_refused():
    model, _ = one_node("Cast", [f32(3)], 18, to=TensorProto.DOUBLE)
    assert load_error(model) == (
        "ptxforge.onnx: node 'the_node' (Cast, opset 18): to=DOUBLE is not supported "
        "(takes FLOAT, FLOAT16, BFLOAT16, INT64, INT32, BOOL)")
    node = helper.make_node("Neg", ["x"], ["y"], name="neg")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE,
                                                                          [3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert load_error(model) == ("ptxforge.onnx: node 'neg' (Neg, opset 18): 'x' is DOUBLE, "
                                 "not one of FLOAT, FLOAT16, BFLOAT16, INT64, INT32, BOOL")


def test_a_shape_computed_at_run_time_is_refused_when_loading():
    model, _ = one_node("Reshape", [f32(2, 3), i64(3, 2)], 18)
    assert load_error(model) == (
        "ptxforge.onnx: node 'the_node' (Reshape, opset 18): input 1 (shape, 'in1') must be "
        "known when the graph is built (a constant, or computed from shapes), got a tensor "
        "computed at run time")


def test_another_domain_is_refused():
    node = helper.make_node("FusedMatMul", ["a", "b"], ["c"], name="fused", domain="com.microsoft")
    info = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph([node], "g", [info("a"), info("b")], [info("c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    assert load_error(model) == ("ptxforge.onnx: node 'fused' (FusedMatMul, opset 1): domain "
                                 "'com.microsoft' is not supported (only the default ONNX "
                                 "domain)")


def test_names_that_python_or_the_module_has_are_renamed_and_kept():
    """Values and initializers named like Python keywords, a GraphModule's attributes or
    the loaded module's own (``onnx_names``): renamed, traceable in ``onnx_names``."""
    nodes = [helper.make_node("MatMul", ["input", "graph"], ["self"], name="1st"),
             helper.make_node("Add", ["self", "forward"], ["class"]),
             helper.make_node("Mul", ["class", "onnx_names"], ["out.put"])]
    weights = [numpy_helper.from_array(f32(3, 2), "graph"),
               numpy_helper.from_array(f32(2), "forward"),
               numpy_helper.from_array(f32(2), "onnx_names")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "input", TensorProto.FLOAT, [4, 3])], [helper.make_empty_tensor_value_info("out.put")],
        weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    module = ptxforge_onnx.load(model)
    assert module.onnx_names == {"graph_t": "graph", "forward_": "forward",
                                 "onnx_names_": "onnx_names"}
    x = f32(4, 3)
    (expected,) = ReferenceEvaluator(model).run(None, {"input": x})
    np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(), expected, rtol=1e-5)


def test_onnx_report_of_an_unsupported_model_is_one_line_on_stderr(tmp_path, capsys):
    model, _ = one_node("TopK", [f32(3, 4), Const(i64(2))], 18, outputs=2)
    onnx.save(model, tmp_path / "topk.onnx")
    assert cli.main(["onnx-report", str(tmp_path / "topk.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptxforge onnx-report: ptxforge.onnx: node 'the_node' (TopK, opset "
                          "18): the op is not supported") and err.count("\n") == 1


@pytest.mark.parametrize("content, why", [
    ("random bytes", "{path} is not an ONNX model (Error parsing message"),
    ("truncated", "{path} is not an ONNX model (Error parsing message"),
    ("missing", "cannot read {path}: No such file or directory\n"),
    ("a directory", "cannot read {path}: Is a directory\n"),
])
def test_onnx_report_of_a_file_that_is_no_model_is_one_line_on_stderr(content, why, tmp_path,
                                                                       capsys):
    path = tmp_path / "model.onnx"
    if content == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(1000))
    elif content == "truncated":
        model, _ = one_node("MatMul", [f32(2, 4), Const(f32(4, 4))], 18)
        path.write_bytes(model.SerializeToString()[:-7])
    elif content == "a directory":
        path.mkdir()
    assert cli.main(["onnx-report", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("ptxforge onnx-report: ptxforge.onnx: " + why.format(path=path))


def test_onnx_report_of_a_model_without_a_ptxforge_kernel(tmp_path, capsys):
    """x [2, 4] @ w [4, 4]: a Linear too small for the GEMM, no kernel: still a report."""
    model, _ = one_node("MatMul", [f32(2, 4), Const(f32(4, 4))], 18)
    onnx.save(model, tmp_path / "matmul.onnx")
    assert cli.main(["onnx-report", str(tmp_path / "matmul.onnx")]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 Linears on ptxforge GEMMs; 0 of the 1 ONNX nodes" in out
    assert out.endswith("kernels, by token count:\n(none: no node runs on a ptxforge kernel)\n")


def test_onnx_report_of_a_model_nothing_matches(tmp_path, capsys):
    """a + b: nothing to rewrite, no kernel; the plan and the kernels each say so in a line."""
    model, _ = one_node("Add", [f32(3, 4), f32(3, 4)], 18)
    onnx.save(model, tmp_path / "add.onnx")
    assert cli.main(["onnx-report", str(tmp_path / "add.onnx")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("add.onnx on sm_90a: 1 graph(s)\n(nothing matched: every node runs "
                          "with Inductor)\n\n0 of 0 Linears on ptxforge GEMMs")


# --- external data: read from the model's folder (or base_dir) alone ----------------------------

def external(array, name: str, directory, location: str):
    """A TensorProto of ``array`` whose data is in ``directory / location``."""
    from onnx import external_data_helper

    tensor = numpy_helper.from_array(array, name)
    data = tensor.raw_data
    external_data_helper.set_external_data(tensor, location, 0, len(data))
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    (directory / location).write_bytes(data)
    return tensor


def constant_of_shape(directory, location="fill.bin"):
    """ConstantOfShape([2, 3]) filled with 3.0 stored as external data in ``directory``."""
    directory.mkdir(exist_ok=True)
    value = external(np.array([3.0], np.float32), "fill", directory, location)
    node = helper.make_node("ConstantOfShape", ["shape"], ["y"], name="the_node", value=value)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                               None)],
                              [numpy_helper.from_array(i64(2, 3), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, directory / "model.onnx")
    return directory / "model.onnx"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A current directory holding a decoy of the external data: 7.0 where 3.0 is meant."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "fill.bin").write_bytes(np.array([7.0], np.float32).tobytes())
    monkeypatch.chdir(cwd)
    return cwd


def test_a_constant_of_shape_value_is_read_from_the_model_s_folder(tmp_path, elsewhere):
    path = constant_of_shape(tmp_path / "model")
    assert torch.equal(ptxforge_onnx.load(path)(), torch.full((2, 3), 3.0))
    assert torch.equal(ptxforge_onnx.load(os.path.relpath(path))(), torch.full((2, 3), 3.0))


def test_a_model_proto_reads_external_data_from_base_dir_alone(tmp_path, elsewhere):
    path = constant_of_shape(tmp_path / "model")
    proto = onnx.load(path, load_external_data=False)
    with pytest.raises(ValueError, match="^ptxforge.onnx: tensor 'fill' has its data in an external "
                                         "file, and the model was given as a ModelProto without "
                                         "base_dir, the folder that file is in$"):
        ptxforge_onnx.load(proto)
    module = ptxforge_onnx.load(proto, base_dir=tmp_path / "model")
    assert torch.equal(module(), torch.full((2, 3), 3.0))
    whole = onnx.load(path)   # its external data read into the proto: no folder needed
    assert torch.equal(ptxforge_onnx.load(whole)(), torch.full((2, 3), 3.0))


@pytest.mark.parametrize("location, why", [
    ("absent.bin", "is not regular file"), ("../cwd/fill.bin", "points outside the directory"),
])
def test_external_data_outside_the_model_s_folder_is_refused(location, why, tmp_path, elsewhere):
    path = constant_of_shape(tmp_path / "model")
    model = onnx.load(path, load_external_data=False)
    attribute = model.graph.node[0].attribute[0].t
    for entry in attribute.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, path)
    with pytest.raises(ValueError, match=f"^ptxforge.onnx: tensor 'fill' has its data in an "
                                         f"external file that cannot be read: .*{why}"):
        ptxforge_onnx.load(path)


def test_onnx_report_reads_no_tensor_data(tmp_path, elsewhere, capsys):
    """The report builds the module on the meta device: the weights' file may be gone; a
    value the graph needs when it is built (ConstantOfShape's) is not read from a file
    either, and the report says so in one line."""
    directory = tmp_path / "model"
    directory.mkdir()
    weight = external(f32(256, 512), "w", directory, "weights.bin")
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="the_node")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          ["tokens", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             ["tokens", 512])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              directory / "linear.onnx")
    (directory / "weights.bin").unlink()
    assert cli.main(["onnx-report", str(directory / "linear.onnx")]) == 0
    assert "1 of 1 Linears on ptxforge GEMMs" in capsys.readouterr().out
    assert cli.main(["onnx-report", str(constant_of_shape(directory))]) == 2
    assert capsys.readouterr().err == (
        "ptxforge onnx-report: ptxforge.onnx: tensor 'fill' has its data in an external file, "
        "which a load on the meta device does not read; the graph needs its value when it is "
        "built\n")


def test_import_ptxforge_does_not_import_onnx():
    code = "import sys, ptxforge; assert 'onnx' not in sys.modules; ptxforge.onnx.load"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- shapes stay symbolic -----------------------------------------------------------------------

def test_shape_arithmetic_becomes_sizes_of_the_input():
    """Shape -> Slice -> Squeeze -> Cast -> Mul -> Max -> Unsqueeze -> Concat -> Reshape on a
    dynamic axis: the reshape takes ``max(x.size(1) * 2, 3)`` as a Python int (a SymInt
    under Dynamo, one graph for every length), no tensor of sizes is made."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "one", "two"], ["t1"]),
             helper.make_node("Squeeze", ["t1"], ["t"]),
             helper.make_node("Cast", ["t"], ["tc"], to=TensorProto.INT64),
             helper.make_node("Mul", ["tc", "double"], ["t2"]),
             helper.make_node("Max", ["t2", "three"], ["t3"]),
             helper.make_node("Unsqueeze", ["t3", "zero"], ["t3v"]),
             helper.make_node("Concat", ["minus", "t3v"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    constants = [numpy_helper.from_array(value, name) for name, value in (
        ("one", i64(1)), ("two", i64(2)), ("double", np.int64(2)), ("three", np.int64(3)),
        ("zero", i64(0)), ("minus", i64(-1)))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, "seq", 2])], [helper.make_empty_tensor_value_info("y")],
        constants)
    module = ptxforge_onnx.load(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 18)]))
    targets = [n.target for n in module.graph.nodes if n.op != "placeholder"]
    assert "size" in targets and "reshape" in targets and torch.tensor not in targets
    for length in (3, 5):
        x = torch.randn(4, length, 2)
        assert torch.equal(module(x), x.reshape(-1, 2 * length))
    graphs = []

    def spy(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 6, 2)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    compiled = torch.compile(module, backend=spy, fullgraph=True)
    assert compiled(x).shape == (4, 12) and compiled(torch.randn(4, 9, 2)).shape == (4, 18)
    assert len(graphs) == 1


# --- a small Llama exported by torch.onnx.export -----------------------------------------------

LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}


def export_llama(path, opset: int, **options) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    config = transformers.LlamaConfig(**LLAMA)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:   # norms' weights: each its own initializer
                parameter.normal_(1.0, 0.1)
    models.export_onnx(model, path, opset, **options)


@pytest.fixture(scope="module", params=[18, 23])
def llama_onnx(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llama{request.param}") / "llama.onnx"
    export_llama(path, request.param)
    return path, request.param


def test_the_exported_llama_uses_the_ops_of_its_opset(llama_onnx):
    path, opset = llama_onnx
    ops = {node.op_type for node in onnx.load(path).graph.node}
    fused = {"RMSNormalization", "RotaryEmbedding", "Attention"}
    assert (fused <= ops) if opset == 23 else not (fused & ops)


def test_the_exported_llama_matches_onnxruntime_at_two_lengths(llama_onnx):
    ort = pytest.importorskip("onnxruntime")
    path, _ = llama_onnx
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    module = ptxforge_onnx.load(path)
    (input_name,) = [i.name for i in session.get_inputs()]
    for length in (5, 11):
        ids = torch.randint(0, LLAMA["vocab_size"], (1, length))
        expected = torch.from_numpy(session.run(None, {input_name: ids.numpy()})[0])
        got = module(ids)
        assert got.shape == (1, length, LLAMA["hidden_size"])
        assert calc_diff(got, expected) < 1e-10
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    bf16 = ptxforge_onnx.load(path, dtype=torch.bfloat16)
    assert calc_diff(bf16(ids).float(), expected) < 1e-4


def test_the_loaded_llama_has_its_weights_as_parameters(llama_onnx):
    path, _ = llama_onnx
    module = ptxforge_onnx.load(path)
    initializers = {t.name: t for t in onnx.load(path).graph.initializer}
    parameters = dict(module.named_parameters())
    assert set(module.onnx_names) == set(parameters)
    embedding = [n for n, source in module.onnx_names.items()
                 if tuple(initializers[source].dims) == (LLAMA["vocab_size"], 256)]
    assert len(embedding) == 1
    linears = [p for p in parameters.values() if p.dim() == 2 and p is not parameters[embedding[0]]]
    assert len(linears) == 2 * 7       # q, k, v, o, gate, up, down per layer
    # the norms' scales (transformers from 5.2x also exports rotary's inv_freq, 1-D)
    assert sum(p.dim() == 1 and p.numel() == LLAMA["hidden_size"]
               for p in parameters.values()) == 2 * 2 + 1


def trace_on_meta(module, fp8):
    from ptxforge import arch, compiler

    graphs = []

    def spy(gm, example_inputs):
        graphs.append((gm, compiler.rewrite(gm, example_inputs, fp8=fp8,
                                            arch_of=lambda device: arch.get("sm_90a"))))
        return gm.forward

    torch._dynamo.reset()
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with torch.no_grad():
        compiler.mark_token_dims((ids,), {})
        torch.compile(module, backend=spy)(ids)
    return graphs


@pytest.mark.parametrize("fp8", [True, False])
def test_the_passes_find_the_llamas_rewrites(llama_onnx, fp8):
    """As test_compiler's Llama layer: per layer the norm fused with the quantization, q/k/v
    as one GEMM, o with the residual, the norm, gate/up as one GEMM, SwiGLU fused, down
    with the residual; the causal mask dropped for is_causal and k/v unrepeated."""
    path, _ = llama_onnx
    module = ptxforge_onnx.load(path, dtype=torch.bfloat16, device="meta")
    ((gm, plan),) = trace_on_meta(module, fp8)
    names = [str(n.target).split(".")[1] for n in gm.graph.nodes
             if n.op == "call_function" and str(n.target).startswith("ptxforge.")]
    if fp8:
        layer = ["rms_norm_fp8", "fp8_linear", "fp8_linear", "rms_norm_fp8", "fp8_linear",
                 "silu_mul_fp8", "fp8_linear"]
    else:
        layer = ["bf16_linear"] * 4
    assert names == layer * 2
    rewrites = [item.rewrite for item in plan]
    assert rewrites.count("3 linears of one x") == rewrites.count("2 linears of one x") == 2
    assert rewrites.count("residual add") == 4
    assert rewrites.count("causal attention") == rewrites.count("grouped-query attention") == 2
    assert all(item.operator for item in plan)


def test_onnx_report_names_the_onnx_nodes_of_each_kernel(llama_onnx, capsys):
    path, opset = llama_onnx
    assert cli.main(["onnx-report", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("|")]
    assert rows[0] == ["rewrite", "ONNX nodes", "runs on", "detail"]
    norms = [row for row in rows if row[0] == "rms_norm -> fp8"]
    assert len(norms) == 4 and all(row[2] == "ptxforge.rms_norm_fp8" for row in norms)
    if opset == 18:   # Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul
        assert all(row[1].endswith("(7 nodes)") for row in norms)
    else:
        assert all(row[1].startswith("node_RMSNormalization") for row in norms)
    assert "14 of 14 Linears on ptxforge GEMMs" in out


def test_a_llama_exported_in_bf16_gets_the_same_kernels(tmp_path):
    """A bf16 model's export casts each RMSNorm's input to float32 and its output back: the
    norm is still one torch.rms_norm (in bf16, computing in float32 inside), and the module
    computes what the PyTorch model computes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.transformers_model(transformers.LlamaConfig(**LLAMA)).model
    path = tmp_path / "llama_bf16.onnx"
    models.export_onnx(model, path, 18)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 9))
    with torch.no_grad():
        expected = models.in_f32(model)(ids, use_cache=False).last_hidden_state
        pytorch = model(ids, use_cache=False).last_hidden_state
        got = ptxforge_onnx.load(path)(ids)
    assert got.dtype == torch.bfloat16
    assert calc_diff(got.float(), expected) < 1.5 * calc_diff(pytorch.float(), expected)
    ((gm, plan),) = trace_on_meta(ptxforge_onnx.load(path, device="meta"), fp8=True)
    names = [str(n.target).split(".")[1] for n in gm.graph.nodes
             if n.op == "call_function" and str(n.target).startswith("ptxforge.")]
    assert names == ["rms_norm_fp8", "fp8_linear", "fp8_linear", "rms_norm_fp8", "fp8_linear",
                     "silu_mul_fp8", "fp8_linear"] * 2
    assert all(item.operator for item in plan)   # the causal mask too: its -inf is bf16's min


def test_an_exported_qwen_keeps_the_biases_on_its_linears(tmp_path):
    """Qwen2's q, k and v have biases: MatMul + Add(bias) becomes one Linear with its bias,
    which the GEMM adds in its epilogue."""
    ort = pytest.importorskip("onnxruntime")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.transformers_model(transformers.Qwen2Config(**LLAMA)).model.float()
    path = tmp_path / "qwen.onnx"
    models.export_onnx(model, path, 18)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 7))
    expected = ort.InferenceSession(str(path)).run(None, {"ids": ids.numpy()})[0]
    assert calc_diff(ptxforge_onnx.load(path)(ids), torch.from_numpy(expected)) < 1e-10
    ((gm, plan),) = trace_on_meta(ptxforge_onnx.load(path, dtype=torch.bfloat16, device="meta"),
                                  fp8=True)
    linears = [n for n in gm.graph.nodes if str(n.target) == "ptxforge.fp8_linear.default"]
    assert sum(n.kwargs.get("bias") is not None for n in linears) == 3 * 2
    assert all(item.operator for item in plan)


def test_external_data_and_a_model_proto_load_the_same(tmp_path):
    path = tmp_path / "llama.onnx"
    export_llama(path, 18, external_data=True)
    assert any(p.name != "llama.onnx" for p in tmp_path.iterdir())   # the weights' file
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 6))
    from_path = ptxforge_onnx.load(path)(ids)
    from_proto = ptxforge_onnx.load(onnx.load(path))(ids)
    assert torch.equal(from_path, from_proto)
