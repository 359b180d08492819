"""ops.gemm.cblas: NumPy's own CBLAS GEMM called from compiled code gives matmul's bits."""
import numpy as np
import pytest

from ops import cpu_pool
from ops.gemm import cblas
from ops.gemm.cpu import blas_product

pytestmark = pytest.mark.skipif(cblas.available() is None,
                                reason="NumPy's CBLAS GEMM not found (another BLAS)")


def _operands(dtype):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((45, 71)).astype(dtype)
    b = rng.standard_normal((71, 33)).astype(dtype)
    return a, b


@pytest.mark.parametrize("case", ["plain", "rows strided", "a transposed", "b transposed",
                                  "out strided", "read-only operands"])
def test_a_described_product_has_the_bits_of_numpy_s_matmul(case):
    dtype = np.float32
    a, b = _operands(dtype)
    out_rows = np.zeros((45, 40), dtype)
    if case == "rows strided":
        a, b = a[:, 3:68], b[3:68]
    elif case == "a transposed":
        a = np.ascontiguousarray(a.T).T
    elif case == "b transposed":
        b = np.asfortranarray(b)
    elif case == "read-only operands":
        a.flags.writeable = b.flags.writeable = False
    out = out_rows[:, 2:35] if case == "out strided" else np.zeros((45, 33), dtype)
    expected = np.matmul(a, b)
    description = np.zeros(cblas.DESCRIPTION_SIZE, np.int64)
    assert cblas.describe(description, a, b, out)
    cblas.run(description, cblas.available())
    assert np.array_equal(out, expected)


def test_only_float32_matrices_are_described():
    a, b = _operands(np.float64)
    assert not cblas.describable(a, b, np.zeros((45, 33)))
    assert cblas.describable(a.astype(np.float32), b.astype(np.float32),
                             np.zeros((45, 33), np.float32))


@pytest.mark.parametrize("case", ["a row", "b column", "a @ a.T", "columns strided"])
def test_a_product_numpy_computes_otherwise_is_not_described(case):
    a, b = _operands(np.float32)
    out = np.zeros((45, 33), np.float32)
    if case == "a row":
        a, out = a[:1], out[:1]
    elif case == "b column":
        b, out = b[:, :1], out[:, :1]
    elif case == "a @ a.T":
        b, out = a.T, np.zeros((45, 45), np.float32)
    else:
        a = a[:, ::2][:, :36]   # BLAS cannot read every other column in place
        b = b[:36]
    assert not cblas.describe(np.zeros(cblas.DESCRIPTION_SIZE, np.int64), a, b, out)


def test_a_worker_runs_a_matmul_block_as_its_cblas_call_with_the_same_bits():
    a, b = _operands(np.float32)
    whole, split = np.zeros((45, 33), np.float32), np.zeros((45, 33), np.float32)
    blas_product(a, b, whole)
    cpu_pool.run_calls([(blas_product, (a[:20], b, split[:20])),
                        (blas_product, (a[20:], b, split[20:]))])
    worker = cpu_pool.workers(1)[0]
    assert worker.flags[cpu_pool._KIND] == cpu_pool._GEMM and worker.call is None
    assert np.array_equal(split, whole)
    vector = np.zeros((1, 33), np.float32)   # not described: the worker calls matmul
    cpu_pool.run_calls([(blas_product, (a[:20], b, split[:20])),
                        (blas_product, (a[20:21], b, vector))])
    assert worker.flags[cpu_pool._KIND] == cpu_pool._PYTHON
    assert np.array_equal(vector, np.matmul(a[20:21], b))   # gemv's bits, as NumPy's


def test_where_numpy_s_cblas_differs_from_matmul_every_block_runs_as_a_python_call(monkeypatch):
    monkeypatch.setattr(cblas, "_checked", None)
    monkeypatch.setattr(cblas, "_matching", lambda sgemm: False)   # as on another BLAS
    assert cblas.available() is None
    worker = cpu_pool._Worker(97, cblas.available())
    try:
        a, b = _operands(np.float32)
        out = np.zeros((45, 33), np.float32)
        worker.hand((blas_product, (a, b, out)))
        assert worker.flags[cpu_pool._KIND] == cpu_pool._PYTHON
        assert worker.wait() is None
        assert np.array_equal(out, np.matmul(a, b))
    finally:
        worker.stop()
        worker.thread.join(5)
