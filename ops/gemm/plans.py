"""The launch plans of the GEMM and of the convolutions' implicit GEMMs: which kernels of the
template (``ops.gemm.template``) run, in how many blocks, on which arguments; under split-K
the partial products and the kernel that sums them in a fixed order."""

import numpy as np

from ops.constant_code import kernels_of_code
from ops.cuda import cuda, device_reshape
from ops.gemm.choices import k_slices, mma_format, pick_config, pick_conv_config, pick_tiling
from ops.gemm import gpu_facts  # noqa: F401  (loaded before a dry device: see gpu_facts)
from ops.gemm.conv_operands import conv_gemm_shape
from ops.gemm.mma import pipelined_tiling
from ops.gemm.template import gemm_kernels
from ops.gemm.tilings import (COMPACT, CONV_GRAD_WEIGHT, FORWARD, GRAD_A, GRAD_B, MEDIUM, PLAIN,
                              STATIC_SHARED_BYTES, shared_bytes, threads_of)
from ops.launch import threads_for
from ops.layout import flat
from ops.memory import empty
from ops.pointwise import IDENTITY, value_cuda


SUM_THREADS = 256


@cuda.jit(device=True)
def _slice_sum(partials, m, n):
    """Σ over slices of partials[:, m, n] in a fixed order: four running sums (sum c takes
    slices c, c + 4, ...), added in pairs at the end. One running sum made the loads wait on
    each other; four keep four in flight, and the order is still set by the slice count."""
    zero = partials.dtype.type(0)
    sum0 = sum1 = sum2 = sum3 = zero
    slices = partials.shape[0]
    s = 0
    while s + 4 <= slices:
        sum0 += partials[s, m, n]
        sum1 += partials[s + 1, m, n]
        sum2 += partials[s + 2, m, n]
        sum3 += partials[s + 3, m, n]
        s += 4
    if s < slices:
        sum0 += partials[s, m, n]
    if s + 1 < slices:
        sum1 += partials[s + 1, m, n]
    if s + 2 < slices:
        sum2 += partials[s + 2, m, n]
    return (sum0 + sum1) + (sum2 + sum3)


@kernels_of_code("act")
def _split_sum_kernel(mode, act):
    """The second launch of a split-K GEMM, one thread per output element: the sum of its
    partials, then ``mode``'s epilogue (bias and activation for FORWARD; for GRAD_B the bias
    row's sums are the bias gradient). GRAD_A's sum is PLAIN's."""
    if mode == FORWARD:
        @cuda.jit(cache=True)
        def dense_forward_sum_cuda(partials, bias, out, alpha):
            e = cuda.grid(1)
            cols = out.shape[1]
            if e < out.shape[0] * cols:
                m, n = e // cols, e % cols
                out[m, n] = value_cuda(act, _slice_sum(partials, m, n) + bias[n], alpha)
        return dense_forward_sum_cuda
    if mode == GRAD_B:
        @cuda.jit(cache=True)
        def dense_grad_params_sum_cuda(partials, grad_w, grad_b):
            e = cuda.grid(1)
            rows, cols = grad_w.shape
            if e < (rows + 1) * cols:
                m, n = e // cols, e % cols
                if m < rows:
                    grad_w[m, n] = _slice_sum(partials, m, n)
                else:
                    grad_b[n] = _slice_sum(partials, m, n)
        return dense_grad_params_sum_cuda

    @cuda.jit(cache=True)
    def gemm_sum_cuda(partials, out):
        e = cuda.grid(1)
        cols = out.shape[1]
        if e < out.shape[0] * cols:
            out[e // cols, e % cols] = _slice_sum(partials, e // cols, e % cols)
    return gemm_sum_cuda


def gemm_plan(mode, m, n, k, dtype, trans_a, trans_b, act, args):
    """The launches of the ``mode`` GEMM op(A) (m, k) @ op(B) (k, n), ``args`` those of the
    ``mode`` entry point: one kernel, or under split-K the partial products and their sum.

    The kernels are the cached ``@cuda.jit`` dispatchers themselves, never ``specialize()``d
    copies: a specialised dispatcher is a new one without the disk cache, and recompiling the
    seven GEMMs of an MLP step took 22 s of a warm start on the H200 (cProfile). After its
    first launch a kernel runs through ``ops.cuda``'s direct path, which skips Numba's
    per-call typing anyway."""
    dtype = np.dtype(dtype)
    extra_rows = 1 if mode == GRAD_B else 0
    rows = m + extra_rows
    mma = mma_format(dtype)
    pipelined = pipelined_tiling(mma, mode, args)
    tiling, split = pick_config(m, n, k, trans_a, trans_b, extra_rows, mma, pipelined=pipelined)
    if tiling.stages and pipelined is None:
        raise ValueError(f"matmul: {tiling} copies its operands as they are, which these "
                         f"are not (pipeline_suits)")
    if not tiling.stages and shared_bytes(tiling, dtype) > STATIC_SHARED_BYTES:
        # GEMM_CHOICES holds float32 measurements; a wider dtype whose tiles would not fit in
        # shared memory (float64 under WIDE, say) takes the rule's tiling at that shape
        tiling = pick_tiling(rows, n)
    blocks = (-(-n // tiling.BN), -(-rows // tiling.BM))
    threads = threads_of(tiling)
    slices = k_slices(k, split, tiling.BK)
    if slices == 1:
        kernel = gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, False)
        return [(kernel, blocks, threads, args)]
    partials = empty((slices, rows, n), dtype, "cuda")
    if mode == PLAIN:
        a, b, out = args
        partial_args, sum_args = (a, b, partials), (partials, out)
    elif mode == FORWARD:
        x, w, bias, out, alpha = args
        partial_args, sum_args = (x, w, partials), (partials, bias, out, alpha)
    elif mode == GRAD_A:
        g, y, w, grad_x, alpha = args
        partial_args, sum_args = (g, y, w, partials, alpha), (partials, grad_x)
    else:
        x, g, y, grad_w, grad_b, alpha = args
        partial_args, sum_args = (x, g, y, partials, alpha), (partials, grad_w, grad_b)
    # FORWARD's partials are PLAIN's; the activation matters to the prologues only
    partial_kernel = (gemm_kernels(dtype, tiling, trans_a, trans_b, PLAIN, IDENTITY, True)
                      if mode in (PLAIN, FORWARD) else
                      gemm_kernels(dtype, tiling, trans_a, trans_b, mode, act, True))
    sum_kernel = (_split_sum_kernel(mode, act) if mode == FORWARD else
                  _split_sum_kernel(GRAD_B if mode == GRAD_B else PLAIN, IDENTITY))
    elements = rows * n
    sum_threads = threads_for(elements, SUM_THREADS)
    return [(partial_kernel, blocks + (slices,), threads, partial_args),
            (sum_kernel, -(-elements // sum_threads), sum_threads, sum_args)]


@cuda.jit(cache=True)
def conv2d_grad_weight_sum_cuda(partials, grad_w, grad_b):
    """The second launch of a split-K weight gradient, one thread per (filter, column): the
    sum of its partials (slices, O, columns) in slice order; the column past grad_w's (the
    ones column) is db."""
    e = cuda.grid(1)
    rows, columns = partials.shape[1], partials.shape[2]
    if e < rows * columns:
        m, n = e // columns, e % columns
        if n < grad_w.shape[1]:
            grad_w[m, n] = _slice_sum(partials, m, n)
        else:
            grad_b[m] = _slice_sum(partials, m, n)
def conv_gemm_plan(mode, geometry, batch, dtype, act, args):
    """The launches of a convolution's ``mode`` GEMM, ``args`` those of its entry point:
    forward (x, w, bias, y, alpha), dx (w, grad_out, y, grad_x, alpha), dw (grad_out, y, x,
    grad_w, grad_b, alpha), all flat NCHW arrays; dw under split-K is the partial products
    and their sum."""
    dtype = np.dtype(dtype)
    m, n, k = conv_gemm_shape(mode, geometry, batch)
    tiling, split = pick_conv_config(mode, m, n, k, geometry.GROUPS, mma_format(dtype))
    if shared_bytes(tiling, dtype) > STATIC_SHARED_BYTES:   # a float32 choice, run in float64
        tiling = MEDIUM if m > COMPACT.BM else COMPACT   # both fit any dtype up to 8 bytes
    slices = k_slices(k, split, tiling.BK)
    blocks = (-(-n // tiling.BN), -(-m // tiling.BM), geometry.GROUPS * slices)
    threads = threads_of(tiling)
    trans_b = mode == CONV_GRAD_WEIGHT   # B (positions, taps): threads read along positions
    if slices == 1:
        kernel = gemm_kernels(dtype, tiling, False, trans_b, mode, act, False, geometry)
        return [(kernel, blocks, threads, args)]
    grad_out, y, x, grad_w, grad_b, alpha = args
    partials = empty((slices, geometry.O, n), dtype, "cuda")
    partial_kernel = gemm_kernels(dtype, tiling, False, trans_b, mode, act, True, geometry)
    weights = grad_w.size // geometry.O
    elements = geometry.O * n
    sum_threads = threads_for(elements, SUM_THREADS)
    return [(partial_kernel, blocks, threads, (grad_out, y, x, flat(partials), alpha)),
            (conv2d_grad_weight_sum_cuda, -(-elements // sum_threads), sum_threads,
             (partials, device_reshape(grad_w, (geometry.O, weights)), grad_b))]


MAX_GRID_Z = 65535   # CUDA's limit on a grid's z extent: the batched GEMM's batches


def batched_gemm_plan(m, n, k, dtype, trans_a, trans_b, args):
    """The one launch of a batched PLAIN GEMM ``(a, b, out, batches)``: out (B, m, n), a grid
    of the tiles of one product by B; the tiling is picked for all B products' rows together
    (the B x tiles blocks are what fills the GPU), without split-K."""
    a, b, out, batches = args
    count = out.shape[0]
    if count > MAX_GRID_Z:
        raise ValueError(f"matmul: {count} batches exceed a CUDA grid's {MAX_GRID_Z}; "
                         f"multiply in parts of at most {MAX_GRID_Z} batches")
    dtype = np.dtype(dtype)
    mma = mma_format(dtype)
    pipelined = pipelined_tiling(mma, PLAIN, (a[0], b[0])) if count else None
    tiling, _ = pick_config(m * count, n, k, trans_a, trans_b, 0, mma, pipelined=pipelined)
    if tiling.stages and pipelined is None:
        tiling, _ = pick_config(m * count, n, k, trans_a, trans_b, 0, None)
    if not tiling.stages and shared_bytes(tiling, dtype) > STATIC_SHARED_BYTES:
        tiling = pick_tiling(m * count, n)
    blocks = (-(-n // tiling.BN), -(-m // tiling.BM), count)
    kernel = gemm_kernels(dtype, tiling, trans_a, trans_b, PLAIN, IDENTITY, False,
                          batched=True)
    return [(kernel, blocks, threads_of(tiling), args)]
