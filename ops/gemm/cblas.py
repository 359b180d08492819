"""NumPy's own CBLAS GEMM, called from compiled code: a split's worker runs its block of
``out = a @ b`` without taking the GIL.

A worker that runs a Python call (``ops.gemm.cpu.blas_product``, NumPy's ``matmul``) must take
the GIL first, while the calling thread holds it on its way into its own block: the worker
sleeps on the GIL and is woken when the caller's BLAS call releases it. On the 2-core EPYC VM
(whose idle CPUs halt at once: ``guest_halt_poll_ns`` 0) that wake-up made the worker start
its block 20-22 us after the hand-over, against 2.3 us for a worker that stays in compiled
code. So a worker is handed a float32 GEMM block as a description (``describe``: the CBLAS
arguments, pointers included) and calls ``cblas_sgemm`` itself (``run``). (A float64 block,
the gradient checks', runs as a Python call: one dtype is one compile less in the first
step.)

The function is the one NumPy's ``matmul`` calls (looked up through NumPy's own extension
module, so the same library), with the arguments ``matmul`` passes (row-major, each operand
transposed or not by its strides, alpha 1, beta 0): the block's bits are ``matmul``'s. A
product ``matmul`` would compute otherwise (a vector, an operand BLAS cannot read in place,
``a @ a.T``, which NumPy sends to SYRK) is not described, and runs as a Python call. At first
use the two are compared on odd shapes (``available``); where they differ, or
the symbol is not found (another BLAS, another platform), every block runs as a Python call.

Compile time: ``describe`` has one signature (operands of any layout convert to it), so the
pool's compiled code is compiled once, in a cold first step (its functions are in the list
``bench.mlp`` prints), then loaded from Numba's cache.
"""
import ctypes

import numpy as np
from numba import njit, types

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# NumPy's wheels link SciPy's OpenBLAS build with 64-bit integers and prefixed names;
# other builds name the plain CBLAS function
_SYMBOLS = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
            ("scipy_cblas_sgemm", ctypes.c_int), ("cblas_sgemm", ctypes.c_int))
# the description's fields (int64s)
TRANS_A, TRANS_B, M, N, K, A, LDA, B, LDB, OUT, LDOUT = range(11)
DESCRIPTION_SIZE = 11
_BLAS_MAXSIZE = np.iinfo(np.int32).max   # NumPy hands BLAS no larger dimension or stride


def _sgemm():
    """NumPy's ``cblas_sgemm`` as a ctypes function pointer Numba can call, or None."""
    from numpy._core import _multiarray_umath
    try:
        numpy_module = ctypes.CDLL(_multiarray_umath.__file__)
    except OSError:
        return None
    for name, integer in _SYMBOLS:
        try:   # dlsym searches the module and the libraries it loads
            address = ctypes.cast(numpy_module[name], ctypes.c_void_p).value
        except AttributeError:
            continue
        pointer = ctypes.c_int64   # a pointer passed as the 64-bit integer it is
        return ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, integer,
                                integer, integer, ctypes.c_float, pointer, integer, pointer,
                                integer, ctypes.c_float, pointer, integer)(address)
    return None


@njit(cache=True, nogil=True)
def _operand(x):
    """``(transposed, leading dimension)`` as NumPy's ``matmul`` passes ``x`` to BLAS, or
    ``(-1, 0)`` where it would not pass it in place."""
    rows, cols = x.shape
    size = x.itemsize
    if x.strides[1] == size and x.strides[0] % size == 0 \
            and cols <= x.strides[0] // size <= _BLAS_MAXSIZE:
        return NO_TRANS, x.strides[0] // size
    if x.strides[0] == size and x.strides[1] % size == 0 \
            and rows <= x.strides[1] // size <= _BLAS_MAXSIZE:
        return TRANS, x.strides[1] // size
    return -1, 0


def _describe(description, a, b, out):
    """Fill ``description`` with the CBLAS call NumPy's ``matmul(a, b, out=out)`` makes;
    False where it would make another (and ``description`` means nothing)."""
    m, k = a.shape
    n = b.shape[1]
    if m < 2 or n < 2 or k < 1 or max(m, n, k) > _BLAS_MAXSIZE:
        return False   # vectors go to dot or gemv, empty products to no BLAS at all
    trans_a, lda = _operand(a)
    trans_b, ldb = _operand(b)
    size = out.itemsize
    if trans_a < 0 or trans_b < 0 or out.strides[1] != size or out.strides[0] % size != 0 \
            or not n <= out.strides[0] // size <= _BLAS_MAXSIZE:
        return False
    if a.ctypes.data == b.ctypes.data and m == n and trans_a != trans_b:
        return False   # a @ a.T: NumPy's SYRK
    description[TRANS_A], description[TRANS_B] = trans_a, trans_b
    description[M], description[N], description[K] = m, n, k
    description[A], description[LDA] = a.ctypes.data, lda
    description[B], description[LDB] = b.ctypes.data, ldb
    description[OUT], description[LDOUT] = out.ctypes.data, out.strides[0] // size
    return True


_OPERAND = types.Array(types.float32, 2, "A", readonly=True, aligned=False)
# every float32 matrix converts to these (any layout, writable or not): one compile
_SIGNATURE = types.boolean(types.Array(types.int64, 1, "C"), _OPERAND, _OPERAND,
                           types.Array(types.float32, 2, "A", aligned=False))
describe = None   # _describe compiled for _SIGNATURE by available(): not at import


@njit(cache=True, nogil=True)
def run(description, sgemm):
    """The described GEMM (``out = a @ b``)."""
    d = description
    sgemm(ROW_MAJOR, d[TRANS_A], d[TRANS_B], d[M], d[N], d[K], np.float32(1.0), d[A], d[LDA],
          d[B], d[LDB], np.float32(0.0), d[OUT], d[LDOUT])


def describable(a, b, out):
    """Whether ``describe`` takes these operands (float32 matrices)."""
    return a.dtype == b.dtype == out.dtype == np.float32 and a.ndim == b.ndim == out.ndim == 2


_checked = None


def available():
    """NumPy's ``cblas_sgemm`` once found and matching ``matmul`` bit for bit on odd shapes
    (transposed operands, strided rows); None otherwise."""
    global _checked, describe
    if _checked is None:
        sgemm = _sgemm()
        if sgemm is not None:
            describe = njit(_SIGNATURE, cache=True, nogil=True)(_describe)
        _checked = sgemm is not None and _matching(sgemm) and sgemm
    return _checked or None


def _matching(sgemm):
    rng = np.random.default_rng(0)
    description = np.zeros(DESCRIPTION_SIZE, np.int64)
    a = rng.standard_normal((37, 83)).astype(np.float32)
    b = rng.standard_normal((61, 53)).astype(np.float32)
    for left, right in ((a[:, 5:66], b),   # rows strided
                        (a.T[3:40], b[:37]),   # a transposed view
                        (a[:, :61], np.asfortranarray(b))):   # b read transposed
        expected = np.zeros((left.shape[0], right.shape[1]), np.float32)
        got = np.zeros((left.shape[0], right.shape[1] + 3), np.float32)[:, 1:-2]
        np.matmul(left, right, out=expected)
        if not describe(description, left, right, got):
            return False
        run(description, sgemm)
        if not np.array_equal(expected, got):
            return False
    return True
