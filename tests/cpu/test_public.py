"""The public names come from one table (ptxforge.public): the package, ptxforge.ops and
ptxforge.deep_gemm export what it lists, each op that launches a kernel has its kernel in
the registry the CLI walks, and ``import ptxforge`` stays free of torch."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

import ptxforge
import ptxforge.deep_gemm as deep_gemm
from ptxforge import kernels, ops
from ptxforge.public import DEEP_GEMM_NAMES, EP_KERNELS, PTXFORGE_NAMES, PUBLIC

SRC = Path(ptxforge.__file__).parents[1]


def test_import_ptxforge_does_not_import_torch():
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", "import ptxforge, sys; assert 'torch' not in sys.modules, "
                               "sorted(m for m in sys.modules if m.startswith('torch'))[:5]"],
        env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_each_name_is_listed_once():
    names = [entry.name for entry in PUBLIC]
    assert len(names) == len(set(names))


def test_every_registry_kernel_serves_a_public_op():
    served = {kernel for entry in PUBLIC for kernel in entry.kernels} | set(EP_KERNELS)
    assert set(kernels.REGISTRY) <= served, sorted(set(kernels.REGISTRY) - served)
    from ptxforge.ep import Buffer, low_latency
    owners = {"Buffer": Buffer, "low_latency": low_latency}
    for caller in EP_KERNELS.values():
        owner, name = caller.split(".")
        assert callable(getattr(owners[owner], name))


def test_every_public_op_that_launches_a_kernel_has_a_registry_entry():
    missing = [entry.name for entry in PUBLIC
               if any(kernel not in kernels.REGISTRY for kernel in entry.kernels)]
    assert not missing


def test_the_name_lists_are_the_table_s():
    # ptxforge also exports the compile backend's shorthand, ptxforge.compile, and the
    # greedy loop over a compiled model, ptxforge.generate
    assert ptxforge.__all__ == [entry.name for entry in PUBLIC if entry.in_ptxforge] + [
        "compile", "generate"]
    assert ops.__all__ == list(PTXFORGE_NAMES) == ptxforge.__all__[:-2]
    assert deep_gemm.__all__ == [entry.name for entry in PUBLIC if entry.in_deep_gemm]
    assert deep_gemm.__all__ == list(DEEP_GEMM_NAMES)


@pytest.mark.parametrize("entry", PUBLIC, ids=lambda entry: entry.name)
def test_each_name_is_the_function_its_module_defines(entry):
    defined = getattr(import_module(f"ptxforge.ops.{entry.module}"), entry.name)
    assert callable(defined)
    exported = [getattr(namespace, entry.name) for namespace, listed in (
        (ptxforge, entry.in_ptxforge), (ops, entry.in_ptxforge), (deep_gemm, entry.in_deep_gemm))
        if listed]
    assert exported and all(function is defined for function in exported)
    if not entry.in_ptxforge:
        with pytest.raises(AttributeError, match=entry.name):
            getattr(ptxforge, entry.name)


def test_deep_gemm_has_its_helpers():
    extras = {"ceil_div", "get_num_sms", "set_num_sms", "get_col_major_tma_aligned_tensor"}
    assert extras <= set(deep_gemm.__all__)
    assert all(callable(getattr(deep_gemm, name)) for name in extras)
    assert deep_gemm.get_col_major_tma_aligned_tensor is deep_gemm.get_mn_major_tma_aligned_tensor
    assert deep_gemm.ceil_div(7, 2) == 4 and deep_gemm.get_tma_aligned_size(5, 4) == 8


# Each layer and what it may import of the package (design.md: imports run one way).
LAYERS = {"ptx": {"arch", "ptx"}, "patterns": {"arch", "ptx", "patterns"},
          "kernels": {"arch", "ptx", "patterns", "kernels"},
          "runtime": {"arch", "settings", "runtime"},
          "jit": {"arch", "settings", "runtime", "jit"},
          "ops": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels", "public",
                  "ops"},
          "compiler": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels",
                       "public", "ops", "ep", "compiler"},
          "ep": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels", "ops", "ep"},
          "onnx": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels", "public",
                   "ops", "compiler", "models", "onnx"},
          "testing": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels",
                      "public", "ops", "testing"},
          "bench": {"arch", "settings", "runtime", "jit", "ptx", "patterns", "kernels", "public",
                    "ops", "compiler", "models", "onnx", "ep", "testing", "bench"}}


def test_imports_run_one_way():
    import ast

    root = Path(ptxforge.__file__).parent
    wrong = []
    for layer, allowed in LAYERS.items():
        for path in (root / layer).rglob("*.py"):
            package = path.relative_to(root).parent.parts
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or not node.level:
                    continue
                # level 1 is the file's own package, each further level one up.
                base = package[:len(package) - node.level + 1]
                parts = base + tuple(node.module.split(".")) if node.module else base
                for name in parts[:1] or [alias.name for alias in node.names]:
                    if name not in allowed:
                        wrong.append(f"{path.relative_to(root)} imports {name}")
    assert not wrong, wrong


def _imported_modules(path: Path, root: Path) -> set[str]:
    """The modules a file of the package imports, by their full names (``from a import b``:
    both ``a`` and ``a.b``, as b may be a module)."""
    import ast

    package = ("ptxforge",) + path.relative_to(root).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_package_ships_no_test_only_module():
    """What the tests alone use lives in tests/support: each module of ptxforge.testing is
    imported by the product outside it (the CLI's demo, the benchmark suites), and no
    module of the package imports the tests' helpers."""
    root = Path(ptxforge.__file__).parent
    imports = {path: _imported_modules(path, root) for path in root.rglob("*.py")}
    unused = []
    for module in (root / "testing").glob("*.py"):
        name = f"ptxforge.testing.{module.stem}"
        if module.stem != "__init__" and not any(
                name in found for path, found in imports.items()
                if (root / "testing") not in path.parents):
            unused.append(name)
    assert not unused, f"imported by the tests alone: {unused}"
    from_tests = sorted(f"{path.relative_to(root)} imports {name}"
                        for path, found in imports.items() for name in found
                        if name.split(".")[0] in ("support", "tests"))
    assert not from_tests, from_tests
