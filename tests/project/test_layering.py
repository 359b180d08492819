"""The engine's and the kernels' modules import one way: no circles, not even through imports
inside functions."""
import ast

import engine.tensor
from tests.support.paths import REPO_ROOT


def _module_name(path):
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules(package):
    return {_module_name(path): path for path in sorted((REPO_ROOT / package).rglob("*.py"))}


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
    through ops.cuda)."""
    graph = import_graph("ops")
    order = ["ops.out_of_memory", "ops.cuda.runtime", "ops.cuda.gpu", "ops.cuda.arrays",
             "ops.cuda.fingerprints", "ops.cuda.shipped", "ops.cuda.direct_launch",
             "ops.cuda.graphs", "ops.cuda.dry_device", "ops.cuda.pool", "ops.cuda",
             "ops.twin", "ops.launch",
             "ops.subnormals", "ops.gemm", "ops.gemm.cblas", "ops.compiled_call", "ops.cpu_pool",
             "ops.cpu_threads", "ops.kernel_pace",
             "ops.element_kernel", "ops.flag_buffer",
             "ops.array_copy", "ops.device", "ops.fill", "ops.memory",
             "ops.layout", "ops.dispatch", "ops.block_reduce"]
    for position, module in enumerate(order):
        assert graph[module] <= set(order[:position]), (module, graph[module])


# numba-cuda and the cuda-python packages it is built on (cuda.core, cuda.bindings, ...)
_NUMBA_CUDA_MODULES = ("numba.cuda", "numba_cuda", "cuda")


def _names_numba_cuda(name):
    return any(name == module or name.startswith(module + ".") for module in _NUMBA_CUDA_MODULES)


def _imports_numba_cuda(node):
    if isinstance(node, ast.Import):
        return any(_names_numba_cuda(alias.name) for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return (_names_numba_cuda(node.module)
                or node.module == "numba" and any(a.name == "cuda" for a in node.names))
    return False


def _sources(*packages):
    return [path for package in packages for path in sorted((REPO_ROOT / package).rglob("*.py"))]


def test_imports_numba_cuda_sees_every_spelling():
    spellings = ["import numba.cuda", "from numba import cuda", "from numba.cuda import jit",
                 "import numba_cuda", "from cuda.core import launch", "from cuda import bindings",
                 "def f():\n    from numba.cuda.cudadrv import driver"]
    for code in spellings:
        assert any(_imports_numba_cuda(node) for node in ast.walk(ast.parse(code))), code
    for code in ["import numba", "from numba import njit", "from ops.cuda import cuda",
                 "from ops import cuda as cuda_runtime", "import ops.cuda"]:
        assert not any(_imports_numba_cuda(node) for node in ast.walk(ast.parse(code))), code


def test_only_ops_cuda_imports_numba_cuda():
    """A move from numba-cuda to its successor is a change to ops/cuda/ alone: no other module
    imports numba.cuda, numba_cuda or the cuda-python packages, at the top or inside a
    function."""
    importers = sorted(str(path.relative_to(REPO_ROOT))
                       for path in _sources("engine", "ops", "optim", "data", "bench")
                       if any(_imports_numba_cuda(node)
                              for node in ast.walk(ast.parse(path.read_text()))))
    assert "ops/cuda/runtime.py" in importers
    assert [path for path in importers if not path.startswith("ops/cuda/")] == []


def test_the_rest_imports_ops_cuda_through_its_interface():
    """Outside ops/cuda/, modules import the package (``ops/cuda/__init__.py``), never one of
    its modules; the one exception is ``ops.cuda.ptx``, which the tensor-core kernel builders
    import when they build one (importing it imports numba.cuda)."""
    reaching_in = sorted(
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in _sources("engine", "ops", "optim", "data", "bench")
        if not str(path.relative_to(REPO_ROOT)).startswith("ops/cuda/")
        for name in _imported_names(path)
        if name.startswith("ops.cuda.") and name != "ops.cuda.ptx"
        and not _is_exported_name(name))
    assert reaching_in == [], reaching_in


def _is_exported_name(name):
    """``from ops.cuda import X`` gives the name ``ops.cuda.X``: fine when X is no module."""
    package, _, attribute = name.rpartition(".")
    return package == "ops.cuda" and not (REPO_ROOT / "ops" / "cuda" / f"{attribute}.py").exists()


ABOVE_OPS = {"engine", "optim", "data"}


def test_ops_imports_nothing_above_it():
    """ops knows arrays and nothing of the tape, the optimizers or the data: no module under
    ops/ imports engine, optim or data, not even inside a function."""
    importers = sorted(f"{path.relative_to(REPO_ROOT)}: {sorted(_imports_of(path) & ABOVE_OPS)}"
                       for path in _sources("ops") if _imports_of(path) & ABOVE_OPS)
    assert importers == [], importers


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
               for path in (REPO_ROOT / package).rglob("*.py")]
    copies = [str(path.relative_to(REPO_ROOT)) for path in sources
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


def test_the_benchmarks_never_import_the_command():
    """DESIGN's rule: bench imports the library, the model recipes (engine.models) and the
    data recipes (data.datasets) too, never the CLI module engine.train."""
    importers = sorted(str(path.relative_to(REPO_ROOT))
                       for path in (REPO_ROOT / "bench").rglob("*.py")
                       if any(name == "engine.train" or name.startswith("engine.train.")
                              for name in _imported_names(path)))
    assert importers == [], importers


def test_only_the_cli_wing_imports_optim_or_data_in_engine():
    """DESIGN's rule: the engine core never imports the optimizers or the data loaders; the
    CLI wing (engine/cli/) wires them in (fit is handed clipping, and finds a loader's
    cursor by its epoch_cursor method). engine/train.py, the shim of ``python -m
    engine.train``, imports the wing and neither; the benchmarks never import the wing.
    engine/vision/ (torchvision's data sets over data's readers) is a wing too: data's
    readers below it, no engine module imports it."""
    wings = ("engine/cli/", "engine/vision/")
    importers = sorted(str(path.relative_to(REPO_ROOT))
                       for path in (REPO_ROOT / "engine").rglob("*.py")
                       if _imports_of(path) & {"optim", "data"})
    assert importers and all(path.startswith(wings) for path in importers), importers
    vision_users = sorted(str(path.relative_to(REPO_ROOT))
                          for path in (REPO_ROOT / "engine").rglob("*.py")
                          if not str(path.relative_to(REPO_ROOT)).startswith("engine/vision/")
                          and any(name == "engine.vision" or name.startswith("engine.vision.")
                                  for name in _imported_names(path)))
    assert vision_users == [], vision_users
    assert not _imports_of(REPO_ROOT / "engine" / "train.py") & {"optim", "data"}
    wing_users = sorted(str(path.relative_to(REPO_ROOT))
                        for path in (REPO_ROOT / "bench").rglob("*.py")
                        if any(name == "engine.cli" or name.startswith("engine.cli.")
                               for name in _imported_names(path)))
    assert wing_users == [], wing_users


# the benchmarks' shared pieces: a benchmark (run as python -m bench.NAME) imports these
BENCH_LIBRARIES = {"bench.harness", "bench.report", "bench.precision", "bench.framework_process",
                   "bench.gpu_time", "bench.wall_time", "bench.gemm_plan"}


def test_no_benchmark_imports_another():
    """What benchmarks share is in bench.harness and the small libraries beside it, so no
    benchmark imports another (bench.mlp once doubled as the others' library)."""
    benchmarks = {".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
                  for path in (REPO_ROOT / "bench").rglob("*.py")
                  if path.name != "__init__.py"} - BENCH_LIBRARIES
    assert {"bench.mlp", "bench.cnn", "bench.ports.count"} <= benchmarks
    importers = sorted(f"{path.relative_to(REPO_ROOT)}: {name}"
                       for path in (REPO_ROOT / "bench").rglob("*.py")
                       for name in _imported_names(path) if name in benchmarks)
    assert importers == [], importers


def test_no_ops_module_over_400_lines():
    """The house's size rule (issue 43): a kernel module a newcomer reads in one sitting;
    ``ops/matmul.py`` keeps only the op and ``gemm()``, the GEMM's rooms being ``ops/gemm/``."""
    lengths = {str(path.relative_to(REPO_ROOT)): len(path.read_text().splitlines())
               for path in _sources("ops")}
    assert not {name: n for name, n in lengths.items() if n > 400}
    assert lengths["ops/matmul.py"] < 120
