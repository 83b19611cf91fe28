#!/usr/bin/env python3
"""Import rules of shim/ that import-linter cannot express (scripts/lint.sh runs both).

1. No import cycles between modules of shim/ (shim/proto excluded). Every import counts:
   those that run when the module is loaded, those inside functions and those under
   ``if TYPE_CHECKING:`` (a cycle that never runs still ties the modules together for the
   reader and the type checker).
2. No private name (``_x``: a module, or a name in one) imported from another package:
   what a package keeps private is used inside it only.
3. shim/relay/ never uses grpc.aio (``import grpc.aio``, ``from grpc import aio``,
   ``from grpc.aio import ...`` or ``grpc.aio.<...>``) nor grpc's thread-pool server
   (``grpc.server``), at any level: the relay engine is independent of the grpc engine.
4. No test (tests/) reads a private attribute (``obj._x``) of another module's object: a
   behaviour worth testing gets a public accessor. Allowed: ``self._x``, ``cls._x``,
   ``super()._x``, and names the test file itself defines (its own classes' privates).

The package rules (relay -> grpc_engine, images -> relay, runtime_handlers -> images,
cri -> relay/images/process, metrics and tracing -> process only, no cycle between packages, ...)
are import-linter contracts in pyproject.toml ([tool.importlinter]).

Usage: scripts/check_imports.py [--root DIR] [--graph]. Exit status 1 when a rule is broken.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "shim"
EXCLUDED = ("shim.proto",)
RELAY = "shim.relay"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def excluded(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EXCLUDED)


def discover(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        if not excluded(name):
            out[name] = path
    return out


def imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def targets(importer: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """Fully qualified names a statement imports (a module, or a name in a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    mod = _absolute(importer, is_package, node)
    for alias in node.names:
        yield f"{mod}.{alias.name}" if alias.name != "*" else mod


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The shim module a qualified name lives in: itself, or its nearest known parent."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def shim_imports(modules: dict[str, Path]) -> Iterator[tuple[str, int, str, str]]:
    """(importer, line, imported name, the shim module it lives in) for every import of a shim name."""
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in imports(ast.parse(path.read_text(), str(path))):
            for target in targets(mod, is_package, node):
                if not (target == PACKAGE or target.startswith(PACKAGE + ".")) or excluded(target):
                    continue
                home = resolve(target, modules)
                if home is not None:
                    yield mod, node.lineno, target, home


def build_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line of the first such import}, every import counted."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for mod, line, _, dep in shim_imports(modules):
        if dep != mod:
            graph[mod].setdefault(dep, line)
    return graph


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(modules: dict[str, Path], root: Path) -> list[str]:
    """Imports of a private name (``_x``, or anything inside a ``_x`` module) that lives in
    another package than the importer's."""
    return [f"{modules[mod].relative_to(root)}:{line}: {target}" for mod, line, target, home in shim_imports(modules)
            if package_of(home, modules) != package_of(mod, modules) and any(map(_private, target.split(".")))]


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative. Components of two or more modules, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def shortest_cycle(graph: dict[str, dict[str, int]], start: str, within: set[str]) -> list[str]:
    """The shortest cycle through ``start`` inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in within:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return list(reversed(path)) + [start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """For every component, the shortest cycle through each of its modules (duplicates dropped)."""
    out: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for comp in strongly_connected(graph):
        for m in comp:
            cyc = shortest_cycle(graph, m, set(comp))
            body = cyc[:-1]
            i = body.index(min(body))
            key = tuple(body[i:] + body[:i])
            if key not in seen:
                seen.add(key)
                out.append(list(key) + [key[0]])
    return out


def relay_grpc_aio(modules: dict[str, Path], root: Path) -> list[str]:
    """Uses of grpc.aio or grpc.server in shim/relay, at any level."""
    found: list[str] = []
    for mod, path in modules.items():
        if not (mod == RELAY or mod.startswith(RELAY + ".")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            what = ""
            if isinstance(node, ast.Import):
                what = next((a.name for a in node.names if a.name == "grpc.aio" or a.name.startswith("grpc.aio.")), "")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "grpc.aio" or node.module.startswith("grpc.aio."):
                    what = f"from {node.module} import ..."
                elif node.module == "grpc" and any(a.name in ("aio", "server") for a in node.names):
                    what = "from grpc import " + ", ".join(a.name for a in node.names if a.name in ("aio", "server"))
            elif (isinstance(node, ast.Attribute) and node.attr in ("aio", "server")
                  and isinstance(node.value, ast.Name) and node.value.id == "grpc"):
                what = f"grpc.{node.attr}"
            if what:
                found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}: {what}")
    return found


def _defined_privates(tree: ast.Module) -> set[str]:
    """Private names a file defines itself: functions and classes, and attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and _private(sub.attr) and isinstance(sub.value, ast.Name)
                            and sub.value.id in ("self", "cls")):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name) and _private(sub.id):
                        names.add(sub.id)
    return names


def private_reads_in_tests(root: Path) -> list[str]:
    """Reads of ``obj._x`` in tests/ where ``obj`` is another module's object (rule 4)."""
    found: list[str] = []
    for path in sorted((root / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        own = _defined_privates(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in own:
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the repository")
    ap.add_argument("--graph", action="store_true", help="print the import graph")
    args = ap.parse_args(argv)
    root = Path(args.root)
    modules = discover(root)
    graph = build_graph(modules)
    if args.graph:
        for mod in sorted(graph):
            print(mod, "->", ", ".join(sorted(graph[mod])) or "-")
    def show(g: dict[str, dict[str, int]], cyc: list[str]) -> str:
        steps = [f"{a} ({modules[a].relative_to(root)}:{g[a][b]})" for a, b in zip(cyc, cyc[1:])]
        return "  " + " -> ".join(steps) + f" -> {cyc[-1]}"

    found = cycles(graph)
    broken = {
        f"{len(found)} import cycle(s) among shim modules (every import counts, TYPE_CHECKING and "
        "function-level ones too):": [show(graph, cyc) for cyc in found],
        "private names imported from another package:": private_imports(modules, root),
        "shim/relay uses grpc.aio or grpc.server (the relay engine must not):": relay_grpc_aio(modules, root),
        "tests read a private attribute of another module's object:": private_reads_in_tests(root),
    }
    failed = False
    for rule, lines in broken.items():
        if lines:
            failed = True
            print("check_imports: " + rule)
            for line in lines:
                print("  " + line.strip())
    if not failed:
        print(f"check_imports: {len(modules)} modules, no import cycle, no private name taken from another "
              "package; shim/relay uses no grpc.aio; no test reads another module's private attribute")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
