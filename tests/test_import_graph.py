"""Imports go one way: no import cycle among the modules of ``kvquant/``, ``kernels/`` and ``eval/``.

The graph is read from the source with :mod:`ast` (nothing is imported): every ``import`` and ``from ... import``,
at module level, inside functions and under ``if TYPE_CHECKING:`` alike (a deferred import hides a cycle, it does
not remove it). ``kernels/`` and ``eval/`` are named ``kvquant.kernels.*`` / ``kvquant.eval.*``, as installed.

``research/`` (the lab) is imported by none of them, nor by the benchmarks, examples or tests.

Layers: the library (``kvquant.*``) never imports ``kvquant.eval`` or the command line ``kvquant.cli``; the eval
imports the library; ``kvquant.cli`` is the top that sees both (it loads its subcommands by name). The edges that
still go against this direction are listed below, each with the work that removes it; a new one fails the test,
and so does a listed one that no longer exists (take it off the list). ``kernels/`` imports nothing of the library
but its contracts: the attention's snapshot (:mod:`kvquant.snapshot`) and the quantizers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Edges known to close a cycle, left out of the cycle check until the work named removes them (none left: every
# cycle fails the test).
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()

# kernels/ -> library: the kernels import only the contracts they read, the attention's snapshot (kvquant.snapshot)
# and the quantizer interface and formats (kvquant.quantizers and its modules), never the store, the cache or the pool.
KERNEL_CONTRACTS = ("kvquant.snapshot", "kvquant.quantizers")
# The one other edge: the offline compile check allocates part tensors on the meta device in the arena's own layout
# (kvquant.blocks), so that it compiles the strides the runtime passes; it is not on the attention's path.
KERNEL_TOOL_EDGES = {("kvquant.kernels.triton_compile_check", "kvquant.blocks")}


def _contract(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in KERNEL_CONTRACTS)


# eval -> the command line: ``python -m kvquant.eval.cli`` enters the one ``kvquant`` parser.
EVAL_TO_TOP = {("kvquant.eval.cli", "kvquant.cli")}


LINKS = {("kvquant", "kernels"), ("kvquant", "eval")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("kernels", "eval"):
        parts.insert(0, "kvquant")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "kvquant").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), *(ROOT / "eval").rglob("*.py")]
    # kvquant/kernels and kvquant/eval link the top-level folders: read those once, by their own path
    return {_module_name(p): p for p in files if p.relative_to(ROOT).parts[:2] not in LINKS}


def _imported(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file imports (a ``from P import x`` names ``P.x`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    names = set(sources)
    return {m: _imported(p, m, names) for m, p in sources.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _layer(module: str) -> str:
    if module.startswith("kvquant.kernels."):
        return "kernels"
    if module.startswith("kvquant.eval."):
        return "eval"
    return "top" if module == "kvquant.cli" else "library"


def _edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets}


def test_the_graph_is_read():
    graph = _graph()
    assert "kvquant.cache" in graph and "kvquant.kernels.dispatch" in graph and "kvquant.eval.runner" in graph
    assert "kvquant.pool" in graph["kvquant.cache"]  # a TYPE_CHECKING import counts
    assert "kvquant.kernels.dispatch" in graph["kvquant.attention"]  # an import inside a function counts


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    """No strongly connected component of more than one module, with only the listed edges left out (the list is
    empty: a cycle anywhere fails)."""
    graph = _graph()
    edges = _edges(graph)
    assert edges >= KNOWN_CYCLE_EDGES, f"gone from the code, take off KNOWN_CYCLE_EDGES: {KNOWN_CYCLE_EDGES - edges}"
    pruned = {m: {t for t in targets if (m, t) not in KNOWN_CYCLE_EDGES} for m, targets in graph.items()}
    assert _cycles(pruned) == []


def test_layers_point_one_way():
    edges = _edges(_graph())
    wrong = {(a, b) for a, b in edges if _layer(a) != _layer(b) and (_layer(a), _layer(b)) != ("eval", "library")}
    wrong -= {(a, b) for a, b in wrong if _layer(a) == "top" or (_layer(a), _layer(b)) == ("library", "kernels")}
    assert not {(a, b) for a, b in wrong if _layer(b) == "eval"}, "only kvquant.cli may import kvquant.eval"
    new = sorted(wrong - EVAL_TO_TOP - KERNEL_TOOL_EDGES - {(a, b) for a, b in wrong if _contract(b)})
    assert not new, f"new imports against the layers: {new}"
    stale = (KERNEL_TOOL_EDGES | EVAL_TO_TOP) - wrong
    assert not stale, f"gone from the code, take off the allow-list: {sorted(stale)}"


def test_kernels_import_only_the_contracts():
    """Every import of the library by ``kernels/`` names a contract module (the snapshot, the quantizers), and none
    names the store, the cache or the pool; the contracts themselves do not import the store, the cache or the pool
    (the snapshot would otherwise bring them back)."""
    graph = _graph()
    edges = _edges(graph)
    kernel_edges = {(a, b) for a, b in edges if _layer(a) == "kernels" and _layer(b) == "library"}
    assert kernel_edges, "the kernels import the snapshot contract"
    assert {(a, b) for a, b in kernel_edges if not _contract(b)} == KERNEL_TOOL_EDGES
    for contract in ("kvquant.snapshot", "kvquant.view"):
        assert not graph[contract] & {"kvquant.store", "kvquant.cache", "kvquant.pool"}, contract


def test_research_is_imported_by_nothing():
    """``research/`` is the lab: no module of the library, the benchmarks, the examples or the tests imports it or
    loads a file from it by path."""
    offenders = []
    for folder in ("kvquant", "kernels", "eval", "benchmarks", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).parts[:2] in LINKS or path == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                as_path = isinstance(node, ast.Constant) and node.value in ("research", "research/")
                if as_path or any(n == "research" or n.startswith("research.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
