"""The package's import graph has no cycle and points down the layers: every import between quickdraft's files,
those inside functions included (a lazy import is a circle put off until run time, not removed), read from the
source with `ast`, goes to a module of the importer's own layer or of a layer below it (LAYERS)."""

from __future__ import annotations

import ast
from pathlib import Path

import quickdraft

PACKAGE = Path(quickdraft.__file__).resolve().parent

# Cycles known to remain while the design round (issue 24) is merged; a cycle not listed here fails the test,
# and so does a listed one that is gone (so the list empties as they are removed).
KNOWN_CYCLES: list[set[str]] = []  # none left after the design round (issue 24); keep it empty


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package (a package is its __init__)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("quickdraft",) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` blocks are never run: their imports are annotations, not edges."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node of the tree, at any depth, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports. `from a.b import c` is an edge to a.b.c where that is a module,
    else to a.b; a relative import resolves against the importing module's package."""
    names = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base
                           for alias in node.names]
            edges.update(t for t in targets if t in names and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    root = tmp_path / "quickdraft"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("def f():\n    from quickdraft.sub import b\n")
    (root / "sub" / "b.py").write_text("from .. import a\nfrom typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from quickdraft.sub import c\n")
    (root / "sub" / "c.py").write_text("import quickdraft.a\n")
    graph = import_graph(root)
    assert graph["quickdraft.a"] == {"quickdraft.sub.b"}
    assert graph["quickdraft.sub.b"] == {"quickdraft.a"}  # the TYPE_CHECKING import is no edge
    assert graph["quickdraft.sub.c"] == {"quickdraft.a"}
    assert cycles(graph) == [{"quickdraft.a", "quickdraft.sub.b"}]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "quickdraft.models.cuda_runner" in graph and graph["quickdraft.api"]  # the walk found the package
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles (lazy imports count): {unexpected}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these known cycles are gone: drop them from KNOWN_CYCLES: {gone}"


# The layers of README's "How it is built", top to bottom: a module may import its own layer's modules and those
# of the layers below it, never above (a lazy import counts). Module names are matched by prefix ("quickdraft.kv"
# is the package and its modules); the package's own __init__ is the face that re-exports the API.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("faces", ("quickdraft", "quickdraft.cli", "quickdraft.cli_args", "quickdraft.server", "quickdraft.offline",
               "quickdraft.bench", "quickdraft.tools")),
    ("API", ("quickdraft.api",)),
    ("scheduling", ("quickdraft.scheduler",)),
    ("step", ("quickdraft.engine", "quickdraft.step", "quickdraft.step_batch")),
    ("drafts", ("quickdraft.drafts",)),
    ("request state", ("quickdraft.sequence", "quickdraft.detokenize", "quickdraft.structured",
                       "quickdraft.token_bytes")),
    ("models", ("quickdraft.models",)),
    ("memory", ("quickdraft.kv", "quickdraft.cache")),
    ("pure core", ("quickdraft.verify", "quickdraft.verify_tree", "quickdraft.sampling", "quickdraft.speedup_model",
                   "quickdraft.adaptive", "quickdraft.token_tree", "quickdraft.params", "quickdraft.errors")),
    ("kernels", ("quickdraft.kernels", "quickdraft.progress")),  # progress: the loaders' and the build's bars
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the module's layer (0 at the top): the longest prefix that names it."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it to its layer")
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a module to one in a layer above its own."""
    return sorted(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                  for name, targets in graph.items() for target in targets if layer_of(target) < layer_of(name))


def test_the_layer_check_finds_an_upward_import():
    graph = {"quickdraft.params": {"quickdraft.structured"}, "quickdraft.structured": {"quickdraft.params"},
             "quickdraft.detokenize": {"quickdraft.engine"}}
    assert upward_imports(graph) == [
        "quickdraft.detokenize (request state) imports quickdraft.engine (step)",
        "quickdraft.params (pure core) imports quickdraft.structured (request state)"]


def test_every_module_imports_only_its_layer_or_below():
    graph = import_graph()
    for name in graph:
        layer_of(name)  # every module has a layer
    assert not upward_imports(graph), "imports that point up the layers:\n" + "\n".join(upward_imports(graph))
