"""The import graph of ``finetune`` and ``losses`` (DESIGN 2): every arrow points down, no import circle, and
``losses`` imports nothing of ``finetune``. Read from the source (module-level and function-level imports alike),
so that an import hidden in a function cannot close a circle either."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("finetune", "losses")


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """``{module: modules of the toolkit it imports}``; ``from pkg import name`` points at ``pkg.name`` when that
    is a module, else at ``pkg`` (its ``__init__``)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [known(f"{source}.{alias.name}") for alias in node.names] + [known(source)]
                targets = [t for t in targets if t] or []
                # ``from pkg import sub`` names the submodule, not (also) the package
                names = {f"{source}.{alias.name}" for alias in node.names}
                if any(t in names for t in targets):
                    targets = [t for t in targets if t in names or t != known(source)]
            else:
                continue
            graph[module].update(t for t in targets if t and t != module)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_toolkit_has_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_losses_imports_nothing_of_finetune():
    graph = import_graph()
    up = {m: sorted(t for t in targets if t.startswith("finetune")) for m, targets in graph.items()
          if m.startswith("losses")}
    assert not any(up.values()), {m: t for m, t in up.items() if t}


def test_the_checker_finds_a_circle(tmp_path):
    for package, body in (("finetune", "from finetune.b import x\n"), ("losses", "")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "finetune" / "a.py").write_text("from finetune.b import x\n")
    (tmp_path / "finetune" / "b.py").write_text("def x():\n    from finetune import a  # hidden in a function\n")
    assert import_circles(import_graph(tmp_path)) == [["finetune.a", "finetune.b"]]
