"""ops.gemm.cblas: NumPy's own CBLAS GEMM called from compiled code gives matmul's bits; MKL's
where installed computes the same products, and every block of a product has its bits."""
import importlib.metadata

import numpy as np
import pytest

from ops import cpu_pool
from ops.cpu_threads import ROW_ALIGN
from ops.gemm import cblas
from ops.gemm.cpu import blas_product

pytestmark = pytest.mark.skipif(cblas.available() is None,
                                reason="NumPy's CBLAS GEMM not found (another BLAS)")


def _mkl_installed():
    try:
        return importlib.metadata.files("mkl") is not None
    except importlib.metadata.PackageNotFoundError:
        return False


def _operands(dtype):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((45, 71)).astype(dtype)
    b = rng.standard_normal((71, 33)).astype(dtype)
    return a, b


@pytest.mark.parametrize("case", ["plain", "rows strided", "a transposed", "b transposed",
                                  "out strided", "read-only operands"])
def test_a_described_product_is_numpy_s_matmul(case):
    """The bits of ``matmul`` with NumPy's own CBLAS; with MKL's, its product."""
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
    if cblas.library() == "numpy":
        assert np.array_equal(out, expected)
    else:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 784, 512), (768, 128, 384), (768, 512, 128),
                                   (45, 71, 33), (784, 64, 512)])
def test_row_and_column_blocks_of_a_product_have_the_whole_product_s_bits(shape):
    """What a split relies on (ops.gemm.cpu.product_blocks), whichever library: the
    Quickstart's and the GPT's Dense shapes, an odd one, a dW with a transposed operand,
    each cut where a split cuts, on a multiple of ``ROW_ALIGN`` (OpenBLAS's edge kernels
    sum a block cut elsewhere in another order)."""
    m, k, n = shape
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    row, column = (max(ROW_ALIGN, size // 2 // ROW_ALIGN * ROW_ALIGN) for size in (m, n))
    for left in (a, np.ascontiguousarray(a.T).T):
        whole, rows, columns = (np.zeros((m, n), np.float32) for _ in range(3))
        blas_product(left, b, whole)
        blas_product(left[:row], b, rows[:row])
        blas_product(left[row:], b, rows[row:])
        blas_product(left, b[:, :column], columns[:, :column])
        blas_product(left, b[:, column:], columns[:, column:])
        assert np.array_equal(rows, whole) and np.array_equal(columns, whole)


@pytest.mark.skipif(not _mkl_installed(), reason="the mkl extra is not installed")
def test_the_mkl_extra_computes_the_dense_products():
    a, b = _operands(np.float32)
    assert cblas.library() == "mkl"
    out, described = np.zeros((45, 33), np.float32), np.zeros((45, 33), np.float32)
    blas_product(a, b, out)   # the caller's own product: MKL's, as its workers' blocks
    description = np.zeros(cblas.DESCRIPTION_SIZE, np.int64)
    assert cblas.describe(description, a, b, described)
    cblas.run(description, cblas.available())
    assert np.array_equal(out, described)


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
    monkeypatch.setattr(cblas, "_found", None)
    monkeypatch.setattr(cblas, "_matching", lambda sgemm, exact: False)   # another BLAS
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
