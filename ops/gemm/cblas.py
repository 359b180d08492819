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

**MKL** (the ``mkl`` extra: Intel's ``mkl`` package): where it is installed, the described
GEMMs call its ``cblas_sgemm`` instead, on its sequential layer (one thread a call, the
engine's split being the threading), and ``ops.gemm.cpu.blas_product`` describes its own
products too, so every block of a product is MKL's (a block's bits are then MKL's, the same
bits as the whole product's, row or column blocks alike: checked on the GPT's and the
Quickstart's shapes). On the 2-core Xeon (an AVX-512 part, where torch's own GEMMs are
MKL's), one thread, MKL took 0.62-0.93x OpenBLAS's CPU time on the Quickstart's and the GPT's
Dense shapes but one (its 64x512 dW, 1.4x), and the GPT's CPU step went from 1.07-1.15x
torch's to 1.01-1.02x (``bench.gpt --device cpu --threads 2``); the reference MLP's captured
epoch, though, from 0.58-0.60x to 0.71-0.77x. ``library()`` names the one in use.

Compile time: ``describe`` has one signature (operands of any layout convert to it), so the
pool's compiled code is compiled once, in a cold first step (its functions are in the list
``bench.mlp`` prints), then loaded from Numba's cache.
"""
import ctypes
import functools
import importlib.metadata

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


MKL_THREADING_SEQUENTIAL = 1   # MKL_Set_Threading_Layer's value for one thread a call


def _function(address, integer):
    """The ``cblas_sgemm`` at ``address`` (``integer``: its integers' C type) as a ctypes
    function pointer Numba can call."""
    pointer = ctypes.c_int64   # a pointer passed as the 64-bit integer it is
    return ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer,
                            integer, ctypes.c_float, pointer, integer, pointer, integer,
                            ctypes.c_float, pointer, integer)(address)


def _numpy_sgemm():
    """NumPy's ``cblas_sgemm``, or None."""
    from numpy._core import _multiarray_umath
    try:
        numpy_module = ctypes.CDLL(_multiarray_umath.__file__)
    except OSError:
        return None
    for name, integer in _SYMBOLS:
        try:   # dlsym searches the module and the libraries it loads
            return _function(ctypes.cast(numpy_module[name], ctypes.c_void_p).value, integer)
        except AttributeError:
            continue
    return None


@functools.cache
def _mkl_runtime():
    """The path of the ``mkl`` package's runtime library (``libmkl_rt``), or None."""
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((file.locate() for file in files
                 if file.name.startswith(("libmkl_rt.", "mkl_rt."))), None)


def mkl_installed():
    """Whether the ``mkl`` extra is installed (nothing loaded or compiled to tell)."""
    return _mkl_runtime() is not None


def _mkl_sgemm():
    """The ``mkl`` package's ``cblas_sgemm`` (32-bit integers, its default interface) on
    MKL's sequential layer, or None where the package is not installed."""
    path = _mkl_runtime()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
        library.MKL_Set_Threading_Layer(ctypes.c_int(MKL_THREADING_SEQUENTIAL))
        address = ctypes.cast(library.cblas_sgemm, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return _function(address, ctypes.c_int)


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


_found = None   # (cblas_sgemm, its library's name) once looked for; (None, None): none


def available():
    """The ``cblas_sgemm`` the described GEMMs call, once found and checked on odd shapes
    (transposed operands, strided rows): MKL's where installed and computing ``matmul``'s
    products, else NumPy's where it matches ``matmul`` bit for bit; None otherwise."""
    global _found, describe
    if _found is None:
        describe = njit(_SIGNATURE, cache=True, nogil=True)(_describe)
        _found = next(((sgemm, name) for name, find, exact in (
            ("mkl", _mkl_sgemm, False), ("numpy", _numpy_sgemm, True))
            if (sgemm := find()) is not None and _matching(sgemm, exact)), (None, None))
    return _found[0]


def library():
    """``"mkl"`` or ``"numpy"``: whose ``cblas_sgemm`` the described GEMMs call (None before
    ``available``, or without one)."""
    return None if _found is None else _found[1]


def _matching(sgemm, exact):
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
        if not (np.array_equal(expected, got) if exact else
                np.allclose(expected, got, rtol=1e-5, atol=1e-5)):
            return False
    return True
