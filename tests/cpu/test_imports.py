"""The package's imports, read from its source without running it: every ``import`` and
``from ... import`` of a ptxforge module, at the top of a file or inside a function. No
module reaches itself again through what it imports (a circle held together by a deferred
import is still a circle), and no module imports another's private (``_name``) module or
name: what is shared gets a public name."""

from __future__ import annotations

import ast
from collections import deque
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(find_spec("ptxforge").origin).parent

def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of the tree at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> list[tuple[str, str | None, int]]:
    """(the module imported, the name taken from it or None, line) for each import of a
    module of ``known`` that module ``name`` makes, deferred ones included. ``from a import
    b`` imports module ``a.b`` where there is one, else the name ``b`` of module ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.partition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(_module(alias.name, known), None, node.lineno) for alias in node.names
                      if alias.name.partition(".")[0] == top]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # level 1: this package, each further level one up
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").partition(".")[0] == top:
                source = node.module
            else:
                continue
            for alias in node.names:
                inner = f"{source}.{alias.name}"
                found.append((inner, None, node.lineno) if inner in known
                             else (_module(source, known), alias.name, node.lineno))
    return found


def _module(name: str, known: dict) -> str:
    """The innermost module of ``known`` that ``name`` is or lies in."""
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def circles(graph: dict[str, set]) -> list[list[str]]:
    """Each circle of ``graph`` (module -> modules it imports) once, as the shortest path
    from its first module (by name) back to itself."""
    found = {}
    for start in sorted(graph):
        came_from, queue = {}, deque([start])
        while queue and start not in came_from:
            current = queue.popleft()
            for target in sorted(graph[current]):
                if target not in came_from:
                    came_from[target] = current
                    queue.append(target)
        if start in came_from:
            path = [start]
            while len(path) == 1 or path[-1] != start:
                path.append(came_from[path[-1]])
            path.reverse()
            found.setdefault(frozenset(path), path)
    return list(found.values())


def private_imports(name: str, found) -> set[tuple[str, str]]:
    """(``name``, what) for each private module of another package (one whose ``_name``
    part is not in a package that holds ``name``) and each private name of another module
    that ``name`` imports."""
    wrong = set()
    for module, taken, _ in found:
        parts = module.split(".")
        for i, part in enumerate(parts):
            if _private(part) and not name.startswith(".".join(parts[:i]) + "."):
                wrong.add((name, module))
        if taken is not None and _private(taken) and module != name:
            wrong.add((name, f"{module}.{taken}"))
    return wrong


def test_no_module_imports_itself_back():
    known = modules()
    graph = {name: {module for module, _, _ in imports(name, path, known) if module != name}
             for name, path in known.items()}
    found = circles(graph)
    assert not found, [" -> ".join(circle) for circle in found]


def test_no_private_module_or_name_is_imported_from_elsewhere():
    known = modules()
    wrong = set().union(*(private_imports(name, imports(name, path, known))
                          for name, path in known.items()))
    assert wrong == set()


def test_the_reader_finds_circles_and_private_imports(tmp_path):
    """The checks above on a small tree that has each fault: a circle through a deferred
    import, a private module imported from another package, a private name of another
    module; and what is allowed (a private module of the importer's own package)."""
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from . import two\n",
        "a/two.py": "def f():\n    from .one import g\n",
        "a/_impl.py": "x = 1\n",
        "a/uses_impl.py": "from ._impl import x\n",
        "b/__init__.py": "",
        "b/reach.py": "from ..a import _impl\nfrom ..a.one import _hidden\nimport pkg.a.two\n",
    }
    for relative, text in files.items():
        (tmp_path / "pkg" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / relative).write_text(text)
    known = modules(tmp_path / "pkg")
    found = {name: imports(name, path, known) for name, path in known.items()}
    graph = {name: {module for module, _, _ in edges if module != name}
             for name, edges in found.items()}
    assert circles(graph) == [["pkg.a.one", "pkg.a.two", "pkg.a.one"]]
    assert set().union(*(private_imports(name, edges) for name, edges in found.items())) == {
        ("pkg.b.reach", "pkg.a._impl"), ("pkg.b.reach", "pkg.a.one._hidden")}
