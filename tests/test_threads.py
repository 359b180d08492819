"""engine.set_num_threads / get_num_threads: the BLAS threads of the CPU GEMMs."""
import os
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import engine
from engine import blas_threads
from ops.matmul import gemm


@pytest.fixture
def restore_threads():
    before = engine.get_num_threads()
    yield
    engine.set_num_threads(before)


def _blas_thread_counts():
    return [library["num_threads"] for library in threadpool_info()
            if library["user_api"] == "blas"]


def _fresh_interpreter(code, **variables):
    environment = {name: value for name, value in os.environ.items()
                   if name not in blas_threads.USER_VARIABLES}
    environment.update(variables)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_first_gemm_runs_every_blas_library_on_the_default_thread_count():
    code = ("import sys\nimport numpy as np\nimport engine\nfrom ops.matmul import gemm\n"
            "print('scipy.linalg' in sys.modules)\n"   # import engine leaves SciPy's BLAS out
            "gemm(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))\n"
            "from threadpoolctl import threadpool_info\n"
            "print(sorted({l['num_threads'] for l in threadpool_info()"
            " if l['user_api'] == 'blas'}), engine.get_num_threads())")
    assert _fresh_interpreter(code).split("\n") == [
        "False", f"[{blas_threads.DEFAULT_THREADS}] {blas_threads.DEFAULT_THREADS}"]


@pytest.mark.parametrize("variable", blas_threads.USER_VARIABLES)
def test_a_thread_count_chosen_in_the_environment_is_left_alone(variable):
    code = ("import scipy.linalg.cython_blas\nfrom threadpoolctl import threadpool_info\n"
            "print(max(l['num_threads'] for l in threadpool_info() if l['user_api'] == 'blas'))\n"
            "import engine\nprint(engine.get_num_threads())")
    before, after = _fresh_interpreter(code, **{variable: "2"}).split()
    assert after == before   # OpenBLAS reads OPENBLAS_ and OMP_NUM_THREADS itself
    if variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        assert after == "2"


def test_set_num_threads_sets_every_blas_library(restore_threads):
    engine.set_num_threads(2)
    assert engine.get_num_threads() == 2 and set(_blas_thread_counts()) == {2}
    engine.set_num_threads(1)
    assert engine.get_num_threads() == 1 and set(_blas_thread_counts()) == {1}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_set_num_threads_rejects_what_is_not_a_positive_integer(bad, restore_threads):
    with pytest.raises(ValueError, match=rf"engine.set_num_threads: n must be a positive "
                                         rf"integer, got {bad!r}"):
        engine.set_num_threads(bad)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_gemm_repeats_bit_for_bit_at_a_fixed_thread_count(threads, restore_threads):
    rng = np.random.default_rng(0)
    a, b = rng.random((128, 784), np.float32), rng.random((784, 256), np.float32)
    engine.set_num_threads(threads)
    first = gemm(a, b)
    assert all(np.array_equal(gemm(a, b), first) for _ in range(5))
    np.testing.assert_allclose(first, a.astype(np.float64) @ b, rtol=1e-5)
