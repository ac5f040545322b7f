"""The package's dependencies point one way, with no circles.

Every module of ``numpyro_fed`` is parsed with :mod:`ast` (nothing is imported) and every
import of a ``numpyro_fed`` module is an edge of the import graph: module-level imports and
the imports inside functions alike (a function-local import must not hide a circle), plus the
implicit import of the enclosing subpackages (importing ``numpyro_fed.distributed.client``
runs ``numpyro_fed/distributed/__init__.py``). The root ``numpyro_fed/__init__.py`` is the
public facade on top, and Python imports it first whatever submodule is asked for, so that
implicit edge is not counted.

Layers, bottom to top (a module may import its own layer and the layers below it):

0. base: errors, minibatch, compressors, partition, potential, bits, compilation, validation;
1. algorithms: the pure algorithm pieces;
2. kernels: the NumPyro kernels;
3. deployment and applications of the kernels: distributed, flower, infdata, saem;
4. what is built on those: nlme, examples;
5. the root package ``numpyro_fed`` (the facade).

A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "numpyro_fed"
PACKAGE = "numpyro_fed"

#: (module or subpackage prefix, layer). The longest matching prefix decides.
LAYERS: dict[str, int] = {
    "numpyro_fed.bits": 0,
    "numpyro_fed.compilation": 0,
    "numpyro_fed.compressors": 0,
    "numpyro_fed.errors": 0,
    "numpyro_fed.minibatch": 0,
    "numpyro_fed.partition": 0,
    "numpyro_fed.potential": 0,
    "numpyro_fed._validation": 0,
    "numpyro_fed._programs": 0,
    "numpyro_fed._serial_lapack": 0,
    "numpyro_fed.validation": 0,
    "numpyro_fed.algorithms": 1,
    "numpyro_fed.kernels": 2,
    "numpyro_fed.distributed": 3,
    "numpyro_fed.flower": 3,
    "numpyro_fed.infdata": 3,
    "numpyro_fed.cached_mcmc": 3,
    "numpyro_fed.saem": 3,
    "numpyro_fed.nlme": 4,
    "numpyro_fed.examples": 4,
    "numpyro_fed": 5,
}

LAYER_NAMES = ["base", "algorithms", "kernels", "deployment/applications", "nlme/examples",
               "root package"]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that importing ``target`` loads (its longest prefix)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[tuple[str, int]]:
    """``(imported module, line)`` for every import of a package module in ``path``, at any
    depth of the syntax tree (module level, functions, ``if TYPE_CHECKING`` blocks)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if is_package(path) else name.rpartition(".")[0]
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from numpyro_fed import compressors` imports the submodule; `from
            # numpyro_fed.bits import BitCounter` the module (resolve: the longest prefix)
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            resolved = resolve(target, modules)
            if resolved is not None:
                found.add((resolved, node.lineno))
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[tuple[str, int]]]:
    """Edges ``module -> {(imported module, line)}``, plus (line 0: implicit) the subpackages
    enclosing an imported module, except the root package and the packages that enclose the
    importing module itself (those are already being imported when it runs)."""
    modules = all_modules(root)
    graph: dict[str, set[tuple[str, int]]] = {}
    for name, path in modules.items():
        edges = set()
        for target, line in imports_of(name, path, modules):
            edges.add((target, line))
            parts = target.split(".")
            for n in range(2, len(parts)):
                parent = ".".join(parts[:n])
                if parent in modules and not (name == parent or name.startswith(parent + ".")):
                    edges.add((parent, 0))
        graph[name] = {(t, line) for t, line in edges if t != name}
    return graph


def layer_of(name: str) -> int:
    matches = [p for p in LAYERS if name == p or name.startswith(p + ".")]
    return LAYERS[max(matches, key=len)]


def find_cycle(graph: dict[str, set[tuple[str, int]]]) -> list[str] | None:
    """A cycle of the graph as a list of modules (first == last), or ``None``."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for target, _ in sorted(graph[node]):
            if colour.get(target, 2) == 1:
                return stack[stack.index(target):] + [target]
            if colour.get(target) == 0:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_every_module_is_parsed_and_has_a_layer():
    modules = all_modules()
    # the walk finds the package and its subpackages (guards against a test that checks
    # nothing because the paths moved)
    for name in ("numpyro_fed", "numpyro_fed.compressors", "numpyro_fed.kernels.qlsd",
                 "numpyro_fed.flower.protocol", "numpyro_fed.distributed.sharding"):
        assert name in modules
    unassigned = [m for m in modules
                  if not any(m == p or m.startswith(p + ".") for p in LAYERS if p != PACKAGE)
                  and m != PACKAGE]
    assert not unassigned, (
        f"modules without a layer: {unassigned}; add them to LAYERS in tests/test_layers.py")


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_point_down_the_layers():
    graph = import_graph()
    upward = sorted(
        f"{src} (layer {LAYER_NAMES[layer_of(src)]}) imports {dst} (layer "
        f"{LAYER_NAMES[layer_of(dst)]})" + (f" at line {line}" if line else
                                            " (its enclosing package)")
        for src, edges in graph.items() for dst, line in edges
        if layer_of(dst) > layer_of(src)
    )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_graph_has_the_implicit_subpackage_edges():
    """Importing a submodule of another subpackage runs that subpackage's ``__init__``: an
    edge of the graph (on a real edge of the package; function-local imports are checked on
    small packages below)."""
    graph = import_graph()
    assert ("numpyro_fed.algorithms", 0) in graph["numpyro_fed.kernels.qlsd"]
    assert any(dst == "numpyro_fed.algorithms.participation" and line > 0
               for dst, line in graph["numpyro_fed.kernels.qlsd"])
    # but not the package that encloses the importing module (it is being imported already)
    assert not any(dst == "numpyro_fed.kernels" for dst, _ in graph["numpyro_fed.kernels.qlsd"])


@pytest.mark.parametrize("source, expected", [
    # a hidden circle: a -> b at module level, b -> a inside a function
    ({"a": "from numpyro_fed.kernels import b\n",
      "b": "def f():\n    from numpyro_fed.kernels import a\n"}, ["a", "b", "a"]),
    # through a subpackage __init__: a imports pkg.c, whose package __init__ imports a
    ({"a": "import numpyro_fed.kernels.pkg.c\n",
      "pkg/__init__": "from numpyro_fed.kernels import a\n", "pkg/c": ""}, ["a", "pkg", "a"]),
    ({"a": "from numpyro_fed.kernels import b\n", "b": "x = 1\n"}, None),
])
def test_cycle_finder_on_small_packages(tmp_path, source, expected):
    """The graph and the cycle search find a circle hidden in a function or behind a
    subpackage ``__init__``, and nothing in an acyclic package."""
    root = tmp_path / "numpyro_fed"
    kernels = root / "kernels"
    for rel, text in {"../__init__": "", "__init__": "", **source}.items():
        path = (kernels / f"{rel}.py").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    cycle = find_cycle(import_graph(root))
    if expected is None:
        assert cycle is None
    else:
        assert cycle is not None
        short = [c.removeprefix("numpyro_fed.kernels.") for c in cycle]
        assert sorted(set(short)) == sorted(set(expected)), short
