"""numba-cuda 0.30 under numpy 2.5, simulated on numpy 2.4 (numpy 2.5 needs Python 3.12+).

numpy 2.5 removed ``np.row_stack``, and numba-cuda 0.30.4 registers an overload of it when
its ``numba.cuda.np.arrayobj`` is imported, at the first kernel compile; ``ops.cuda.runtime``
supplies the name for that import only (``_register_overloads_of_removed_numpy_names``).
Each case runs in a fresh process that first deletes ``np.row_stack``, as numpy 2.5 lacks it
(numpy 2.5's other removals, such as the ``chararray`` re-export, numba and numba-cuda do not
use).

The compile cases type and lower one of the engine's kernels to NVVM IR through numba-cuda's
real compiler (``compile_cuda``: no GPU, no NVVM library needed); the simulator case runs an
op end to end, but the simulator compiles nothing, so only the compile cases meet the
failure. The real check is the ``gpu`` tests on a machine with numpy 2.5.
"""
import os
import subprocess
import sys

from tests.support.paths import REPO_ROOT


AS_NUMPY_2_5 = ("import numpy as np\n"
                "del np.row_stack\n"   # and from the names `from numpy import *` takes
                "np.__all__ = [name for name in np.__all__ if name != 'row_stack']\n")

COMPILE_AN_ENGINE_KERNEL = (
    "import engine\n"
    "from ops import check\n"
    "from ops.cuda import runtime\n"
    "runtime.import_numba_cuda()\n"
    "from numba import types\n"
    "from numba.cuda.compiler import compile_cuda\n"
    "result = compile_cuda(check.count_nonfinite_cuda.py_func, types.void,\n"
    "                      (types.float32[::1], types.int64[::1]), cc=(9, 0))\n"
    "print('compiled', 'nvptx64' in result.library.get_llvm_str(),\n"
    "      'row_stack' in dir(np))\n")


def _run(code, simulator=False):
    environment = {name: value for name, value in os.environ.items()
                   if name != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        environment["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)


def test_an_engine_kernel_compiles_without_np_row_stack():
    result = _run(AS_NUMPY_2_5 + COMPILE_AN_ENGINE_KERNEL)
    assert result.returncode == 0, result.stderr
    # compiled to NVVM IR, and the shim took its row_stack away again: numpy as it was
    assert result.stdout.split() == ["compiled", "True", "False"]


def test_without_the_shim_the_first_compile_fails_on_row_stack():
    """What the shim is for: numba-cuda 0.30.4 itself cannot compile a kernel without it."""
    result = _run(AS_NUMPY_2_5
                  + "from ops.cuda import runtime\n"
                    "runtime._register_overloads_of_removed_numpy_names = lambda: None\n"
                  + COMPILE_AN_ENGINE_KERNEL)
    assert result.returncode != 0
    assert "AttributeError: module 'numpy' has no attribute 'row_stack'" in result.stderr


def test_the_shim_leaves_a_numpy_that_has_row_stack_alone():
    result = _run("import numpy as np\n"
                  "before = np.row_stack\n"
                  + COMPILE_AN_ENGINE_KERNEL
                  + "print(np.row_stack is before)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["compiled", "True", "True", "True"]


def test_a_cuda_op_runs_in_the_simulator_without_np_row_stack():
    result = _run(AS_NUMPY_2_5
                  + "import engine\n"
                    "a = np.arange(6, dtype=np.float32).reshape(2, 3)\n"
                    "b = np.ones((3, 2), dtype=np.float32)\n"
                    "x = engine.tensor(a, device='cuda', requires_grad=True)\n"
                    "y = engine.tensor(b, device='cuda')\n"
                    "(x @ y).sum().backward()\n"
                    "print(np.allclose((x @ y).numpy(), a @ b),\n"
                    "      np.allclose(x.grad.numpy(), np.ones((2, 2)) @ b.T),\n"
                    "      'row_stack' in dir(np))\n", simulator=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]
