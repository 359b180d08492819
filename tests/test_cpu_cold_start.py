"""What the CPU's cold first step compiles: the Dense GEMMs and the batch gather call NumPy
from Python (nothing to compile), on one BLAS thread from the first GEMM on."""
import os
import subprocess
import sys

import numpy as np

from ops import cpu_threads
from ops.gather import gather_rows


def _fresh_interpreter(code):
    environment = {name: value for name, value in os.environ.items()
                   if name not in cpu_threads.USER_VARIABLES}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_first_gemm_through_numpy_sets_its_blas_to_one_thread_before_numba_compiles():
    # before any compile: Numba's first compile loads SciPy's BLAS, which also sets every
    # BLAS library's threads (engine.blas_threads)
    code = ("import sys\nimport numpy as np\nimport engine\n"
            "from threadpoolctl import threadpool_info\nfrom ops.matmul import blas_product\n"
            "blas_product(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32), "
            "np.empty((64, 64), np.float32))\n"
            "print(sorted({l['num_threads'] for l in threadpool_info() "
            "if l['user_api'] == 'blas'}), 'scipy.linalg.cython_blas' in sys.modules)")
    assert _fresh_interpreter(code) == "[1] False"


def test_the_cpu_gather_takes_the_rows_of_the_order_from_the_cursor_on():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 7), np.float32)
    y = rng.integers(0, 10, (50, 1))
    order = rng.permutation(50)
    cursor = np.array([20], np.int64)
    x_batch, y_batch = gather_rows(x, y, order, 3, 9, cursor=cursor)
    np.testing.assert_array_equal(x_batch, x[order[23:32]])
    np.testing.assert_array_equal(y_batch, y[order[23:32]])
