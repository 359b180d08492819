"""numba-cuda is imported when CUDA is first used, not by ``import engine`` or CPU work.

Each case runs in a fresh process: the test process itself has imported numba-cuda long ago.
``ops.cuda`` explains the mechanism (the kernel modules' ``cuda`` is a stand-in until
then; the first use puts the real dispatchers into module globals and closure cells)."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import REPO_ROOT


def _run(code, simulator):
    environment = {name: value for name, value in os.environ.items()
                   if name != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        environment["NUMBA_ENABLE_CUDASIM"] = "1"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


CUDA_MODULES = "('numba', 'numba.cuda', 'cuda.core', 'ml_dtypes')"


def _assert_cpu_work_imports_no_numba_cuda(program, worked):
    """``program`` runs on the CPU, ``worked`` (an expression) holds after it, and none of
    ``CUDA_MODULES`` was imported."""
    imported = _run(textwrap.dedent(program) + f"import sys\nprint({worked}, *(name in "
                    f"sys.modules for name in {CUDA_MODULES}))\n", simulator=False)
    assert imported == ["True", "True", "False", "False", "False"]


def test_a_first_cpu_tensor_imports_no_numba_cuda():
    _assert_cpu_work_imports_no_numba_cuda("""
        import engine
        x = engine.tensor([1., 2.], requires_grad=True)
        (x * x).sum().backward()
        """, "x.grad.numpy().tolist() == [2.0, 4.0]")


def test_captured_cpu_training_steps_import_no_numba_cuda():
    _assert_cpu_work_imports_no_numba_cuda("""
        import optim
        from tests.support.captured_training import train
        *_, step = train("cpu", True, lambda params: optim.Adam(params, lr=1e-2), clip=True)
        """, "step.eager_reason is None and step.replayed > 0")


def test_the_first_cuda_tensor_makes_the_module_kernels_real():
    # the simulator stands in for a GPU; the kernels were lazy until the CUDA tensor
    result = _run(
        "import sys, engine, ops.elementwise as elementwise\n"
        "from ops.cuda import LazyKernel\n"
        "lazy = isinstance(elementwise.BINARY[elementwise.MUL].cuda, LazyKernel)\n"
        "x = engine.tensor([1., 2., 3.], device='cuda', requires_grad=True)\n"
        "(x * x).sum().backward()\n"
        "from numba import cuda\n"
        "print(lazy, x.grad.numpy().tolist() == [2.0, 4.0, 6.0], elementwise.cuda is cuda,\n"
        "      not any(isinstance(value, LazyKernel) for value in vars(elementwise).values()))\n",
        simulator=True)
    assert result == ["True", "True", "True", "True"]


def test_device_functions_held_in_closures_are_made_real_before_the_kernel_runs():
    result = _run(
        "import numpy as np\n"
        "from ops.cuda import LazyKernel, cuda\n"
        "def make(factor):\n"
        "    @cuda.jit(device=True)\n"
        "    def scaled(value):\n"
        "        return factor * value\n"
        "    @cuda.jit\n"
        "    def kernel(out):\n"
        "        i = cuda.grid(1)\n"
        "        if i < out.size:\n"
        "            out[i] = scaled(out[i])\n"
        "    return kernel\n"
        "kernel = make(3.0)\n"
        "lazy = isinstance(kernel, LazyKernel)\n"
        "out = cuda.to_device(np.arange(5.0))\n"
        "kernel[1, 8](out)\n"
        "after = make(2.0)\n"
        "print(lazy, out.copy_to_host().tolist() == [0.0, 3.0, 6.0, 9.0, 12.0],\n"
        "      isinstance(after, LazyKernel))\n", simulator=True)
    assert result == ["True", "True", "False"]


def test_auto_device_without_an_nvidia_driver_imports_no_numba_cuda():
    loads, device, *imported = _run(
        "import sys, engine\n"
        "from ops.cuda import driver_library_loads\n"
        "from ops.device import check_device\n"
        "loads = driver_library_loads()\n"
        "print(loads, check_device('auto'), engine.zeros(2, device='auto').device,\n"
        f"      *(name in sys.modules for name in {CUDA_MODULES}))\n", simulator=False)
    if loads == "True":
        pytest.skip("the NVIDIA driver library loads here: the case is a machine without one")
    assert [device, *imported] == ["cpu", "cpu", "True", "False", "False", "False"]


def test_the_driver_library_check_agrees_with_numba_cuda():
    """ops.cuda looks for the driver where numba-cuda does, without importing
    numba.cuda."""
    mine, numbas = _run(
        "from ops.cuda import driver_library_loads\n"
        "mine = driver_library_loads()\n"
        "from numba.cuda.cudadrv import driver\n"
        "try:\n"
        "    driver.find_driver()\n"
        "except driver.CudaSupportError:\n"
        "    print(mine, False)\n"
        "else:\n"
        "    print(mine, True)\n", simulator=False)
    assert mine == numbas
