"""The engine's and the kernels' modules import one way: no circles, not even through imports
inside functions."""
import ast
import pathlib

import engine.tensor

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules(package):
    return {_module_name(path): path for path in sorted((ROOT / package).rglob("*.py"))}


def _imported(node, modules, package):
    """The package's modules an import statement names (``from engine import nn`` names
    ``engine.nn``; the package itself, the facade over all of them, is left out)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module is not None:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        names = []
    return {name for name in names if name in modules and name != package}


def import_graph(package="engine"):
    """``{module: {modules it imports anywhere in its code}}`` over the package's submodules."""
    modules = _package_modules(package)
    graph = {}
    for name, path in modules.items():
        if name == package:
            continue
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _imported(node, modules, package) - {name}
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


def test_ops_has_no_import_circle():
    graph = import_graph("ops")
    assert "ops.launch" in graph and "ops.memory" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_ops_runtime_floor_in_order():
    """The floor under the op families: each imports only those before it (numba-cuda only
    through ops.cuda_backend)."""
    graph = import_graph("ops")
    order = ["ops.cuda_backend", "ops.twin", "ops.out_of_memory", "ops.launch",
             "ops.subnormals", "ops.cpu_threads", "ops.element_kernel", "ops.flag_buffer",
             "ops.array_copy", "ops.device", "ops.fill", "ops.cuda_pool", "ops.memory",
             "ops.layout", "ops.dispatch", "ops.block_reduce"]
    for position, module in enumerate(order):
        assert graph[module] <= set(order[:position]), (module, graph[module])


def _imports_numba_cuda(node):
    if isinstance(node, ast.Import):
        return any(alias.name.startswith("numba.cuda") for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.module:
        return (node.module.startswith("numba.cuda")
                or node.module == "numba" and any(a.name == "cuda" for a in node.names))
    return False


def test_only_the_cuda_backend_imports_numba_cuda():
    """A move from numba-cuda to its successor is a change to ops/cuda_backend.py alone."""
    importers = sorted(str(path.relative_to(ROOT))
                       for package in ("engine", "ops", "optim", "data", "bench")
                       for path in (ROOT / package).rglob("*.py")
                       if any(_imports_numba_cuda(node)
                              for node in ast.walk(ast.parse(path.read_text()))))
    assert importers == ["ops/cuda_backend.py"]


def test_the_core_layers_in_order():
    """random, autograd, functional, sequence, tensor, parameter: each imports only those
    before it."""
    graph = import_graph()
    order = ["engine.random", "engine.autograd", "engine.functional", "engine.sequence",
             "engine.tensor", "engine.parameter"]
    for position, module in enumerate(order):
        assert graph[module] <= set(order[:position]), (module, graph[module])


def test_no_colliding_helper_names():
    """One copy helper for engine, optim and ops; tensor.py binds no array-level ``add``."""
    sources = [path for package in ("engine", "optim", "ops")
               for path in (ROOT / package).rglob("*.py")]
    copies = [str(path.relative_to(ROOT)) for path in sources
              for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "copy_into"]
    assert copies == ["ops/device.py"]
    assert not hasattr(engine.tensor, "add")


def _imported_names(path):
    """Every absolute module name ``path`` imports, anywhere in its code, with the names a
    ``from`` import takes (``from engine import train`` gives ``engine`` and
    ``engine.train``)."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _imports_of(path):
    """The top-level package of every module ``path`` imports, anywhere in its code."""
    return {name.split(".")[0] for name in _imported_names(path)}


def test_only_the_command_imports_optim_or_data_in_engine():
    """DESIGN's rule: the engine core never imports the optimizers or the data loaders; the
    composer (engine/train.py) wires them in (fit is handed clipping, and finds a loader's
    cursor by its epoch_cursor method)."""
    importers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "engine").rglob("*.py")
                       if _imports_of(path) & {"optim", "data"})
    assert importers == ["engine/train.py"], importers


def test_the_benchmarks_never_import_the_command():
    """DESIGN's rule: bench imports the library, the model recipes (engine.models) and the
    data recipes (data.datasets) too, never the CLI module engine.train."""
    importers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "bench").rglob("*.py")
                       if any(name == "engine.train" or name.startswith("engine.train.")
                              for name in _imported_names(path)))
    assert importers == [], importers
