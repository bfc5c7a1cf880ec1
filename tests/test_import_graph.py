"""The package has no import cycles, counting every import statement: module level, inside
functions (the lazy imports that only postpone a cycle to call time), under ``if TYPE_CHECKING``.

Edges: ``import a.b`` and ``from a import b`` (b a submodule) point at that module; ``from a import
name`` (not a submodule) points at ``a`` itself (its ``__init__``). The parent packages that Python
runs before a submodule are not edges: they always finish first, whoever imports the submodule.
``importlib.import_module`` with a computed name is not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package)} of every module under ``root / package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _known(name: str, modules) -> str:
    """The deepest module of ``modules`` that ``name`` is or lies in."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(root: Path, package: str) -> dict[str, dict[str, list[int]]]:
    """{module: {module it imports: [line numbers]}} over ``package``'s own modules.

    Parameters
    ----------
    root : Path
        The folder that holds the package.
    package : str
        The top-level package name.
    """
    modules = _modules(root, package)
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (path, is_package) in modules.items():
        edges = graph.setdefault(name, {})

        def add(target: str, line: int) -> None:
            target = _known(target, modules)
            if target in modules and target != name:
                edges.setdefault(target, []).append(line)

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not (source == package or source.startswith(package + ".")):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    add(submodule if submodule in modules else source, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, list[int]]]) -> list[str]:
    """One cycle of ``graph`` as [m0, m1, ..., m0], or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def _describe(cycle: list[str], graph) -> str:
    return "\n".join(f"  {a} -> {b} (line {', '.join(map(str, graph[a][b]))})" for a, b in zip(cycle, cycle[1:]))


def test_the_package_has_no_import_cycles():
    graph = import_graph(ROOT, "sage_diffusers")
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in sage_diffusers:\n" + _describe(cycle, graph)


def test_the_graph_counts_imports_inside_functions():
    """Guards the test above against a builder that sees nothing: known lazy and eager edges."""
    graph = import_graph(ROOT, "sage_diffusers")
    assert "sage_diffusers.integration" in graph["sage_diffusers"]  # in __getattr__
    assert "sage_diffusers._sagebwd_autograd" in graph["sage_diffusers.backends"]  # module level
    assert "sage_diffusers.selftest" in graph["sage_diffusers._dispatch"]  # in _auto_status
    assert "sage_diffusers.config" in graph["sage_diffusers.kernels._jit"]  # module level, `from .. import`
    assert "sage_diffusers.kernels.sagebwd_triton" in graph["sage_diffusers.backends"]  # in _sagebwd_triton_module
    assert len(graph) > 30 and sum(map(len, graph.values())) > 60


def test_a_lazy_import_back_is_reported_as_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b.g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f  # lazy: still a cycle\n    return f\n")
    (pkg / "c.py").write_text("import pkg.sub.b\nfrom pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a": [1]} and graph["pkg.c"] == {"pkg.sub.b": [1], "pkg.a": [2]}
    cycle = find_cycle(graph)
    assert cycle in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    assert "pkg.sub.b -> pkg.a (line 2)" in _describe(cycle, graph)
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == []
