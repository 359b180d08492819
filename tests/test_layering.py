"""The engine's modules import one way: no circles, not even through imports inside functions."""
import ast
import pathlib

import engine.tensor

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engine_modules():
    return {_module_name(path): path for path in sorted((ROOT / "engine").rglob("*.py"))}


def _imported(node, modules):
    """The engine modules an import statement names (``from engine import nn`` names
    ``engine.nn``; the ``engine`` package itself, the facade over all of them, is left out)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module is not None:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        names = []
    return {name for name in names if name in modules and name != "engine"}


def import_graph():
    """``{module: {modules it imports anywhere in its code}}`` over engine's submodules."""
    modules = _engine_modules()
    graph = {}
    for name, path in modules.items():
        if name == "engine":
            continue
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _imported(node, modules) - {name}
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_engine_has_no_import_circle():
    graph = import_graph()
    assert "engine.tensor" in graph and "engine.autograd" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_core_layers_in_order():
    """random, autograd, functional, tensor, parameter: each imports only those before it."""
    graph = import_graph()
    order = ["engine.random", "engine.autograd", "engine.functional", "engine.tensor",
             "engine.parameter"]
    for position, module in enumerate(order):
        assert graph[module] <= set(order[:position]), (module, graph[module])


def test_no_colliding_helper_names():
    """One gradient-copy helper for engine and optim; tensor.py binds no array-level ``add``."""
    sources = list((ROOT / "engine").rglob("*.py")) + list((ROOT / "optim").rglob("*.py"))
    copies = [path.name for path in sources
              for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "copy_into"]
    assert copies == ["parameter.py"]
    assert not hasattr(engine.tensor, "add")
