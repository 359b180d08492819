"""The CPU GEMMs: BLAS through ``np.dot``, in ``@njit`` (``gemm_cpu``, in row blocks across the
engine's threads: ``gemm_split_cpu``) or from Python (``blas_product``, which compiles
nothing: Dense's)."""
import numpy as np
from numba import njit

from ops.cpu_threads import numpy_blas_on_one_thread, row_blocks, run_blocks
from ops.gemm import cblas



@njit(cache=True, nogil=True)
def gemm_cpu(a, b, out, trans_a, trans_b):
    """out = op(a) @ op(b) through BLAS, op a free transpose view when asked."""
    if trans_a and trans_b:
        np.dot(a.T, b.T, out)
    elif trans_a:
        np.dot(a.T, b, out)
    elif trans_b:
        np.dot(a, b.T, out)
    else:
        np.dot(a, b, out)


def gemm_split_cpu(a, b, out, trans_a, trans_b):
    """``gemm_cpu``, a large product with an untransposed ``a`` in row blocks of ``a`` and
    ``out`` across the engine's threads (``ops.cpu_threads``): the same kernel on row
    slices, the same sums. (A transposed ``a``'s row blocks are its columns, a slice of
    another layout that would compile the kernel again: it runs whole.)"""
    blocks = None if trans_a else row_blocks(out.shape[0], out.size * a.shape[1])
    if blocks is None:
        gemm_cpu(a, b, out, trans_a, trans_b)
    else:
        run_blocks([(gemm_cpu, (a[start:stop], b, out[start:stop], trans_a, trans_b))
                    for start, stop in blocks])


gemm_split_cpu.__wrapped__ = gemm_cpu


def blas_product(a, b, out):
    """out = a @ b by NumPy's BLAS, called from Python: ``np.dot`` inside ``@njit`` compiles
    Numba's GEMM wrapper once per operand layout and again into every kernel that calls it
    (the MLP's four Dense kernels took 1.7-2.1 s of a 3.1-4.6 s cold first step, their loops
    alone 0.7 s now: ``python -m bench.mlp``). NumPy releases the GIL in the call, so the
    blocks of a split still run at once, and reads a transposed or column-sliced operand in
    place. On one BLAS thread (``ops.cpu_threads.numpy_blas_on_one_thread``). Where MKL is
    installed (``ops.gemm.cblas``), a float32 product it can describe is MKL's instead, as
    the split's workers compute their blocks."""
    numpy_blas_on_one_thread()
    if cblas.mkl_installed() and cblas.describable(a, b, out):   # compiles only then
        sgemm = cblas.available()
        description = np.empty(cblas.DESCRIPTION_SIZE, np.int64)
        if cblas.library() == "mkl" and cblas.describe(description, a, b, out):
            cblas.run(description, sgemm)
            return
    np.matmul(a, b, out=out)   # np.dot's BLAS call, and an ``out`` of strided rows too


blas_product.is_matmul = True   # a split's worker runs its blocks as their CBLAS call


def product_blocks(a, b, out, threads_at_most=None):
    """How ``out = a @ b`` splits across the engine's threads (at most ``threads_at_most``):
    ``(by_columns, blocks)``, blocks of out's columns when ``a`` is the smaller operand (each
    block then packs all of ``a`` and its slice of ``b``), else of its rows; ``blocks`` None
    for one call. Each block is the same dot products summed in the same order, the bits of
    the whole product. Measured on 2 threads: the Quickstart's 64x784 @ 784x512 whole 549
    us, in two row blocks 418 (each packs all of W), in two column blocks 351; the GPT's
    768x128 @ 128x384 whole 731, rows 436, columns 478."""
    by_columns = a.size < b.size
    blocks = row_blocks(out.shape[1] if by_columns else out.shape[0],
                        out.size * a.shape[1], threads_at_most)
    return by_columns, blocks


def product_calls(a, b, out, threads_at_most=None):
    """``(blas_product, args)`` calls that together make ``out = a @ b``, in the blocks of
    ``product_blocks`` (one call when it does not split)."""
    by_columns, blocks = product_blocks(a, b, out, threads_at_most)
    if blocks is None:
        return [(blas_product, (a, b, out))]
    if by_columns:
        return [(blas_product, (a, b[:, start:stop], out[:, start:stop]))
                for start, stop in blocks]
    return [(blas_product, (a[start:stop], b, out[start:stop])) for start, stop in blocks]



@njit(cache=True, nogil=True)
def gemm_batches_cpu(a, b, out, batches, trans_a, trans_b, first, stop):
    """out[z] = op(a[i]) @ op(b[j]) for the batches z in [first, stop), i and j from
    ``batches`` (``ops.gemm.plans.batch_meta``), one BLAS call each."""
    dims = batches[0]
    for z in range(first, stop):
        rest, at_a, at_b = z, 0, 0
        for d in range(dims - 1, -1, -1):   # the last batch dim varies fastest
            index = rest % batches[1 + d]
            rest //= batches[1 + d]
            at_a += index * batches[1 + dims + d]
            at_b += index * batches[1 + 2 * dims + d]
        gemm_cpu(a[at_a], b[at_b], out[z], trans_a, trans_b)


def gemm_batched_cpu(a, b, out, batches, trans_a, trans_b):
    """``gemm_batches_cpu`` over all batches, a large product's batches in blocks across the
    engine's threads: each product is one BLAS call whichever thread runs it, so the bits
    do not depend on the thread count."""
    count = out.shape[0]
    k = a.shape[1] if trans_a else a.shape[2]
    blocks = row_blocks(count, out.size * k) if count > 1 else None
    if blocks is None:
        gemm_batches_cpu(a, b, out, batches, trans_a, trans_b, 0, count)
    else:
        run_blocks([(gemm_batches_cpu, (a, b, out, batches, trans_a, trans_b, start, stop))
                    for start, stop in blocks])


gemm_batched_cpu.__wrapped__ = gemm_batches_cpu
