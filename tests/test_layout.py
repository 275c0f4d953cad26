"""The package's layering (docs/design.md section 3), measured by tools/import_graph.py: no import cycle,
no import up the layers, no project module imported inside a function, no layer below run/ reading the
run's session; and the measurement itself (levels and upward edges) against plain references on small graphs."""

import ast
import importlib.util
import itertools
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_imports_point_down_and_none_hides_in_a_function():
    measured = import_graph.measure_imports(ROOT)
    for kind in ("modules", "units"):
        assert measured[kind]["cycles"] == [], kind
        assert measured[kind]["upward_edges"] == [], kind
    assert measured["in_function_imports"] == 0


def test_no_file_over_400_lines_and_no_function_over_60(tmp_path):
    """The layout issue's size bounds, in passrate_jax/; the measurement counts a 401-line file and a
    61-line function (decorator included) as over."""
    assert import_graph.measure_sizes(ROOT, 400, 60) == {"files_over": [], "functions_over": []}
    (tmp_path / "passrate_jax").mkdir()
    body = "\n".join(["@staticmethod", "def f():"] + ["    pass"] * 59) + "\n"
    (tmp_path / "passrate_jax" / "big.py").write_text(body + "\n" * (401 - body.count("\n")))
    assert import_graph.measure_sizes(str(tmp_path), 400, 60) == {
        "files_over": ["passrate_jax/big.py: 401 lines"], "functions_over": ["passrate_jax/big.py:1 f: 61 lines"]}


def _longest_path_levels(graph):
    """Reference for a DAG: a node's level is the number of edges on the longest path out of it,
    found by trying every path (small graphs only)."""
    def longest(node):
        return max((1 + longest(t) for t in graph[node]), default=0)
    return {n: longest(n) for n in graph}


def test_levels_are_longest_paths_and_a_cycle_shares_one_level():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 7)
        nodes = [f"m{i}" for i in range(n)]
        # edges only from a higher index to a lower one: a DAG
        graph = {a: {b for b in nodes[:i] if rng.random() < 0.4} for i, a in enumerate(nodes)}
        assert import_graph.levels(graph) == _longest_path_levels(graph)
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    assert import_graph.levels(cyclic) == {"a": 2, "b": 1, "c": 1, "d": 0}
    assert import_graph.graph_numbers({"passrate_jax.model." + k: {"passrate_jax.model." + t for t in v}
                                       for k, v in cyclic.items()})["cycles"] == [
        "passrate_jax.model.b <-> passrate_jax.model.c"]


def test_an_edge_is_upward_exactly_when_it_climbs_the_layer_order():
    order = ["passrate_jax.configlib", "passrate_jax.model.a", "passrate_jax.allocation.b", "passrate_jax.rollout.c",
             "passrate_jax.run.d", "passrate_jax.study.e", "passrate_jax.cli.f", "passrate_jax.train"]
    ranks = [0, 1, 2, 3, 4, 5, 6, 4]  # train.py: the flat module of the old layout, in the run layer
    for (a, ra), (b, rb) in itertools.permutations(zip(order, ranks), 2):
        upward = import_graph.graph_numbers({a: {b}, b: set()})["upward_edges"]
        assert upward == ([f"{a} -> {b}"] if ra < rb else []), (a, b)


# The layers below run/: a module here takes the parts it needs (a sampler, callables, numbers), never the run's Session.
BELOW_RUN = ("rollout", "envs", "data", "sampling", "model", "rl", "allocation")


def session_reads(source: str) -> list[int]:
    """Lines of ``source`` that name a ``session``: a parameter, a variable or an attribute (strings and
    docstrings aside)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg.lower() == "session" \
                or isinstance(node, ast.Name) and node.id.lower() == "session" \
                or isinstance(node, ast.Attribute) and node.attr.lower() == "session":
            lines.append(node.lineno)
    return sorted(lines)


def test_no_layer_below_run_reads_a_session():
    assert session_reads("def f(session): return session.cfg") == [1, 1]
    assert session_reads("x = self.session.sampler") == [1]
    assert session_reads('def f(cfg):\n    """the session\'s cfg"""\n    return cfg') == []
    found = {}
    for package in BELOW_RUN:
        for d, _, files in os.walk(os.path.join(ROOT, "passrate_jax", package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(d, name)
                    with open(path) as f:
                        lines = session_reads(f.read())
                    if lines:
                        found[os.path.relpath(path, ROOT)] = lines
    assert found == {}, f"modules below run/ that read a session (build them from its parts in run/): {found}"


# The run's whole config tree: only run/ and the layers that drive runs (study/, cli/) may see it.
CONFIG_SECTIONS = ("model", "warm_start", "data", "sampling", "allocation", "prefix_sampling", "rl", "optimizer",
                   "mesh", "distributed", "checkpoint", "logging")
GROUND = ("configlib.py", "sharding.py", "distributed.py", "plugins.py")


def whole_config_reads(source: str) -> list[int]:
    """Lines of ``source`` that import the run's config tree (``passrate_jax.run.config``) or read a field
    through one of its sections (``cfg.sampling.temperature``, ``self.config.data.task``): a module that
    should have been handed its own section (``SamplingConfig``) was handed the whole ``Config``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("passrate_jax.run"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("passrate_jax.run") for a in node.names):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr in CONFIG_SECTIONS):
            holder = node.value.value
            name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", "")
            if "cfg" in name.lower() or "config" in name.lower():
                lines.append(node.lineno)
    return sorted(lines)


def test_each_layer_below_run_gets_its_own_config_section():
    assert whole_config_reads("from passrate_jax.run.config import Config") == [1]
    assert whole_config_reads("def f(cfg):\n    return cfg.sampling.temperature") == [2]
    assert whole_config_reads("x = self.config.data.task") == [1]
    assert whole_config_reads("def f(cfg):\n    return cfg.temperature, sampling.cfg") == []
    found = {}
    paths = [os.path.join(ROOT, "passrate_jax", g) for g in GROUND]
    for package in BELOW_RUN + ("text",):
        for d, _, files in os.walk(os.path.join(ROOT, "passrate_jax", package)):
            paths += [os.path.join(d, name) for name in sorted(files) if name.endswith(".py")]
    for path in paths:
        with open(path) as f:
            if lines := whole_config_reads(f.read()):
                found[os.path.relpath(path, ROOT)] = lines
    assert found == {}, f"modules below run/ that see the whole Config (hand them their section): {found}"
