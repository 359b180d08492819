"""Every registered op declares the kernel pairs it runs, and the declaration is exact.

Each op's ``check_op`` cases run with a ``LaunchRecorder`` around that op's forward and
backward only: every kernel recorded must be declared in ``op.kernels``, and every declared
kernel must run in some case (a declaration nobody runs is stale). The sweep runs on the CPU:
which pair runs cannot depend on the device, since the dispatcher picks the side inside the
pair (and the simulator would take minutes for every case a second time; the per-module
``test_op`` runs each case on CUDA already)."""
import importlib
import inspect
import pkgutil

import pytest
from numba.core.registry import CPUDispatcher

import ops
from ops.cuda import is_cuda_kernel
from ops.launch import Kernel, LaunchRecorder

from tests.support.op_check import check_op
from tests.support.paths import REPO_ROOT


def _import_all_ops():
    for module in pkgutil.iter_modules(ops.__path__):   # ops.cuda's own modules hold no op
        importlib.import_module(f"ops.{module.name}")
    return ops.REGISTRY


def _cases():
    """Every ``CASES`` list of the test modules, in every folder of tests/."""
    cases = []
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        cases += list(getattr(importlib.import_module(module), "CASES", ()))
    return cases


def test_registry_is_populated():
    assert {"add", "mul", "sum", "max", "relu", "transpose"} <= set(_import_all_ops())


@pytest.mark.parametrize("name", sorted(_import_all_ops()))
def test_op_declares_twin_kernels(name):
    op = ops.REGISTRY[name]
    if op.is_view:
        assert not op.kernels, f"{name}: a view runs no kernel"
        return
    assert op.kernels, f"{name}: declares no kernel"
    for kernel in op.kernels:
        assert isinstance(kernel, Kernel), f"{name}: {kernel!r} is not an ops.launch.Kernel"
        # a CPU side that splits its work across threads wraps its @njit kernel (__wrapped__)
        compiled = inspect.unwrap(kernel.cpu, stop=lambda f: isinstance(f, CPUDispatcher))
        assert isinstance(compiled, CPUDispatcher), f"{name}: {kernel!r} has no @njit kernel"
        assert kernel.cuda_plan is not None or is_cuda_kernel(kernel.cuda), \
            f"{name}: {kernel!r} has no @cuda.jit kernel"


def test_every_registered_op_has_a_test_case():
    covered = {case.op for case in _cases()}
    missing = sorted(set(_import_all_ops()) - covered)
    assert not missing, f"registered ops without a check_op case: {missing}"


@pytest.fixture
def recorded(monkeypatch):
    """Per op name, the kernel runs made inside that op's own forward and backward."""
    runs = {}

    def recording(name, method):
        def wrapper(self, *args):
            with LaunchRecorder() as recorder:
                try:
                    return method(self, *args)
                finally:
                    runs.setdefault(name, []).extend(recorder.runs)
        return wrapper

    for name, op in _import_all_ops().items():
        monkeypatch.setattr(op, "forward", recording(name, op.forward))
        monkeypatch.setattr(op, "backward", recording(name, op.backward))
    return runs


def test_ops_run_exactly_the_kernels_they_declare(recorded):
    device = "cpu"
    for case in _cases():
        check_op(case, device)
    for name, op in _import_all_ops().items():
        ran = {run.kernel for run in recorded.get(name, ())}
        undeclared = sorted(k.name for k in ran - set(op.kernels))
        unused = sorted(k.name for k in set(op.kernels) - ran)
        assert not undeclared, f"{name} runs kernels it does not declare: {undeclared}"
        assert not unused, f"{name} declares kernels none of its cases ran on {device}: {unused}"
        assert all(run.device == device for run in recorded.get(name, ())), \
            f"{name}: a kernel ran on another device than its inputs' ({device})"


def test_no_op_class_shares_a_name_with_a_layer():
    """A layer and the op it runs have different names (nn.Dense runs ops.dense.DenseOp), so
    both import by name, without module aliases."""
    import inspect

    from engine import nn
    from ops.registry import REGISTRY
    layers = {name for name, value in vars(nn).items() if inspect.isclass(value)}
    ops_classes = {type_.__name__ for type_ in REGISTRY.values() if inspect.isclass(type_)}
    assert ops_classes and layers
    assert not layers & ops_classes, sorted(layers & ops_classes)
