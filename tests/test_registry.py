"""Every registered op has both kernels and is covered by some test module's ``CASES``."""
import importlib
import pathlib
import pkgutil

import pytest
from numba.core.registry import CPUDispatcher

import ops
from ops.device import SIMULATOR

TESTS = pathlib.Path(__file__).parent


def _import_all_ops():
    for module in pkgutil.iter_modules(ops.__path__):
        if not (SIMULATOR and module.name == "cuda_pool"):   # Numba's allocator: real CUDA only
            importlib.import_module(f"ops.{module.name}")
    return ops.REGISTRY


def _is_cuda_kernel(kernel):
    if SIMULATOR:
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        return isinstance(kernel, FakeCUDAKernel)
    from numba.cuda.dispatcher import CUDADispatcher
    return isinstance(kernel, CUDADispatcher)


def test_registry_is_populated():
    assert {"add", "mul", "sum", "max", "relu", "transpose"} <= set(_import_all_ops())


@pytest.mark.parametrize("name", sorted(_import_all_ops()))
def test_op_has_cpu_and_cuda_kernels(name):
    op = ops.REGISTRY[name]
    if op.is_view:
        assert not op.cpu_kernels and not op.cuda_kernels, f"{name}: a view runs no kernel"
        return
    assert op.cpu_kernels, f"{name}: no @njit CPU kernel"
    assert op.cuda_kernels, f"{name}: no @cuda.jit kernel"
    for kernel in op.cpu_kernels:
        assert isinstance(kernel, CPUDispatcher), f"{name}: {kernel!r} is not an @njit kernel"
    for kernel in op.cuda_kernels:
        assert _is_cuda_kernel(kernel), f"{name}: {kernel!r} is not a @cuda.jit kernel"


def test_every_registered_op_has_a_test_case():
    covered = set()
    for path in sorted(TESTS.glob("test_*.py")):
        module = importlib.import_module(f"tests.{path.stem}")
        covered |= {case.op for case in getattr(module, "CASES", ())}
    missing = sorted(set(_import_all_ops()) - covered)
    assert not missing, f"registered ops without a check_op case: {missing}"
