"""Measure passrate_jax's layout: its import graph and the size of its files and functions.

    python tools/import_graph.py                 # this tree: graph numbers, upward edges, oversize code
    python tools/import_graph.py --root DIR      # another checkout (e.g. one made by git archive)
    python tools/import_graph.py --json          # the numbers as JSON

The graph has two granularities: modules (every ``.py`` file; a package's ``__init__`` is its folder's
module) and units (a module directly under ``passrate_jax/`` or a whole top-level folder, as
docs/design.md section 3 lays the package out). Edges are the imports of project modules, at the module
head or inside functions alike (``if TYPE_CHECKING:`` blocks excepted), without self edges and without a
package's ``__init__`` importing its own submodules. A module's level is one above the highest level of
what it imports (a module that imports no project module is level 0); modules on a cycle share a level.

An edge runs upward when the importer's layer ranks below the imported module's layer, in the order
ground < text, model, sampling, rl, data, envs < allocation < rollout < run < study < cli. Flat modules of
the layout before the folders (commit 72ec879: ``train.py``, ``study_report.py``, ...) are placed in the
layer of the folder they moved to, so both layouts are measured against the same layering.

Sizes: files over ``--max-lines`` lines and functions (methods and nested functions too) over
``--max-function`` lines, counted from ``def`` (decorators included) to the last line of the body.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

PACKAGE = "passrate_jax"
LAYERS = {  # the rank of each layer: a module may import its own rank or lower
    "ground": 0, "text": 1, "model": 1, "sampling": 1, "rl": 1, "data": 1, "envs": 1,
    "allocation": 2, "rollout": 3, "run": 4, "study": 5, "cli": 6,
}
GROUND = ("configlib", "sharding", "distributed", "plugins", "__init__")
# The flat modules before the folder move, by the folder each moved to.
FLAT = {
    "tokenizer": "text", "chat_template": "text", "loop": "rollout", "rollouts": "rollout",
    "config": "run", "train": "run", "session": "run", "sft": "run", "evaluate": "run", "checkpoint": "run",
    "metrics": "run", "trackers": "run", "runfiles": "run", "plot": "run",
    "study": "study", "study_methods": "study", "study_analysis": "study", "study_report": "study",
    "study_stats": "study", "cli": "cli", "commands": "cli", "generate_cli": "cli", "info": "cli", "export": "cli",
}


def module_name(root: str, path: str) -> str:
    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def find_modules(root: str) -> dict[str, str]:
    """Module name -> file path, for every .py file of the package under ``root``."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, PACKAGE)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                found[module_name(root, path)] = path
    return found


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: str, me: str, modules) -> tuple[set[str], int]:
    """The project modules ``me`` imports, and how many of its import statements of project modules sit
    inside a function."""
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for part in node.body for n in ast.walk(part)}
    in_functions = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(fn)}
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    out, inner = set(), 0
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        hits = {r for r in (_resolve(n, modules) for n in names) if r and r != me}
        hits = {h for h in hits if not h.startswith(me + ".")}  # a package's __init__ over its own submodules
        out |= hits
        inner += bool(hits) and id(node) in in_functions
    return out, inner


def unit_of(module: str) -> str:
    """The top-level unit a module belongs to: its folder under the package, or itself when flat."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def layer_of(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in LAYERS:
        return top
    if top in GROUND:
        return "ground"
    if top in FLAT:
        return FLAT[top]
    raise ValueError(f"{module}: in no layer; add its folder or flat name to LAYERS, GROUND or FLAT")


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node one level above the highest of its successors (cycles share a level), by repeated
    relaxation of the strongly connected components' condensation."""
    component = _components(graph)
    members: dict[int, list[str]] = {}
    for node, c in component.items():
        members.setdefault(c, []).append(node)
    memo: dict[int, int] = {}

    def level(c: int) -> int:
        if c not in memo:
            below = {component[t] for n in members[c] for t in graph[n]} - {c}
            memo[c] = 1 + max((level(b) for b in below), default=-1)
        return memo[c]

    return {node: level(c) for node, c in component.items()}


def _components(graph: dict[str, set[str]]) -> dict[str, int]:
    """Tarjan's strongly connected components (iterative): node -> component id."""
    index, low, on, stack, comp, counter = {}, {}, set(), [], {}, [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1; stack.append(start); on.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    while True:
                        w = stack.pop(); on.discard(w); comp[w] = index[node]
                        if w == node:
                            break
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]; counter[0] += 1; stack.append(nxt); on.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return comp


def graph_numbers(graph: dict[str, set[str]]) -> dict:
    lv = levels(graph)
    groups: dict[int, list[str]] = {}
    for node, c in _components(graph).items():
        groups.setdefault(c, []).append(node)
    cycles = sorted(" <-> ".join(sorted(g)) for g in groups.values() if len(g) > 1)
    upward = sorted(f"{m} -> {t}" for m in graph for t in graph[m] if LAYERS[layer_of(m)] < LAYERS[layer_of(t)])
    return {"nodes": len(graph), "edges": sum(map(len, graph.values())), "levels": max(lv.values()) + 1,
            "cycles": cycles, "upward_edges": upward}


def measure_imports(root: str) -> dict:
    modules = find_modules(root)
    graph, inner = {}, 0
    for m, path in modules.items():
        graph[m], k = imports_of(path, m, modules)
        inner += k if layer_of(m) != "cli" else 0  # the command line may load a subcommand's module lazily
    units: dict[str, set[str]] = {unit_of(m): set() for m in graph}
    for m, targets in graph.items():
        units[unit_of(m)] |= {unit_of(t) for t in targets} - {unit_of(m)}
    return {"modules": graph_numbers(graph), "units": graph_numbers(units), "in_function_imports": inner}


def measure_sizes(root: str, max_lines: int, max_function: int) -> dict:
    long_files, long_functions = [], []
    for m, path in sorted(find_modules(root).items()):
        text = open(path).read()
        rel = os.path.relpath(path, root)
        if text.count("\n") > max_lines:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
                length = fn.end_lineno - first + 1
                if length > max_function:
                    long_functions.append(f"{rel}:{first} {fn.name}: {length} lines")
    return {"files_over": long_files, "functions_over": long_functions}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the checkout holding passrate_jax/ (default: here)")
    parser.add_argument("--max-lines", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, PACKAGE)):
        print(f"--root {args.root!r}: holds no {PACKAGE}/ folder; give the checkout's top folder", file=sys.stderr)
        return 2
    result = {**measure_imports(args.root), **measure_sizes(args.root, args.max_lines, args.max_function)}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for kind in ("modules", "units"):
        g = result[kind]
        print(f"{kind}: {g['nodes']} nodes, {g['edges']} edges, {g['levels']} levels, {len(g['cycles'])} cycles, "
              f"{len(g['upward_edges'])} upward edges")
        for cycle in g["cycles"]:
            print(f"  cycle: {cycle}")
    for edge in result["modules"]["upward_edges"]:
        print(f"  upward: {edge}")
    print(f"project imports inside functions (outside cli/): {result['in_function_imports']}")
    print(f"files over {args.max_lines} lines: {len(result['files_over'])}")
    for line in result["files_over"]:
        print(f"  {line}")
    print(f"functions over {args.max_function} lines: {len(result['functions_over'])}")
    for line in result["functions_over"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
