"""The README's Quick start and its ONNX first try, as a new user on a machine without a GPU
meets them (.ci/run runs the Quick start's lines themselves)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:   # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's text from the heading ``title`` to the next heading (## or deeper: a
    line starting "# " is a comment of a code block)."""
    start = README.index(f"\n{title}\n") + len(title) + 2
    end = re.search(r"\n#{2,} ", README[start:])
    return README[start:start + end.start() if end else None]


def code_block(text: str, language: str) -> list[str]:
    """The lines of the first ```language block of ``text``."""
    return re.search(rf"```{language}\n(.*?)```", text, re.S).group(1).splitlines()


def test_the_quick_start_installs_a_supported_cpu_torch_first():
    """Without a GPU, torch's CPU build before anything that depends on torch (which would
    bring the 5.5 GB CUDA build); its version within the package's own requirement; then
    the two commands, demo and tests."""
    blocks = re.findall(r"```bash\n(.*?)```", section("## Quick start"), re.S)
    (first,), commands = (block.splitlines() for block in blocks)
    assert len(commands) == 2
    assert "ptxforge demo" in commands[0] and "pytest" in commands[1]
    pin = re.match(r'pip install "torch==(\S+)" ', first)
    assert pin and pin.group(1).endswith("+cpu"), first
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [Requirement(r) for r in project["dependencies"] if r.startswith("torch")]
    assert Version(pin.group(1)) in torch.specifier
    assert "'/^## Quick start/" in (ROOT / ".ci" / "run").read_text()   # CI runs these lines


def test_no_install_from_an_index_the_package_is_not_on():
    assert not re.search(r'pip install\s+"?ptxforge\[', README)


def test_the_onnx_first_try_is_small_and_loads_on_the_cpu(tmp_path, monkeypatch):
    """The ONNX example up to its GPU part, run as written: the exported model is tens of
    MB (Llama-3-8B's sizes made 2 GB in f32), and loads on the CPU."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    lines = code_block(section("### Run an ONNX model"), "python")
    gpu = next(i for i, line in enumerate(lines) if 'device="cuda"' in line)
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(compile("\n".join(lines[:gpu]), "README.md", "exec"), names)
    module = names["ptxforge"].onnx.load("llama.onnx")
    assert module(names["ids"]).shape == (1, 8, names["small"].hidden_size)
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert 1e6 < size < 100e6
