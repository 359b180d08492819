"""LayerNorm's CPU kernels (``ops.layer_norm`` has the op, its math and the CUDA kernels):
the forward's row loop, dx's, and dweight/dbias as chunk partials and their fold, in the
order the CUDA kernels follow.

Each of the three runs in blocks of whole chunks of ``PARAM_CHUNK`` rows across the engine's
threads where the work pays (``_row_blocks``), a worker's block handed over as a compiled
call (``ops.compiled_call``): a row's values, and a chunk's partials, are the same bits
whichever block computes them, so the results do not depend on the thread count.
"""
import math

import numpy as np
from numba import njit

from ops.cpu_threads import run_blocks, work_blocks
from ops.launch import CPU_KERNEL

HAS_WEIGHT, HAS_BIAS = 1, 2   # the op's ``affine`` flags
PARAM_CHUNK = 32   # rows summed into one partial of dweight/dbias (both devices alike)

# The fold adds column j's chunk partials in FOLD_LANES lanes, lane l taking chunks l,
# l + FOLD_LANES, ... in order, then the lanes pairwise (l += l + width, width halving from
# FOLD_LANES / 2): the same order on both devices. On CUDA a lane is a thread, warps along
# the columns: a thread a column adding every chunk in turn waited on each load (the GPT's 13
# folds of 512 chunks: 1.18 ms of its H200 step, 0.59 with four loads in flight on an H100).
FOLD_LANES = 16


# The CPU's row loops: "reassoc" lets LLVM keep a float64 sum in vector lanes (a fixed order
# of this code, the same bits every run), and the per-element arithmetic stays in x's dtype
# after the float64 subtraction of the mean: 768x128 float32, one core, forward 106 -> 44
# us, dx 101 -> 41 (eight hand-written partial sums, float64 throughout, had taken 77 -> 67)
_ROW_LOOPS = dict(CPU_KERNEL, nogil=True, error_model="numpy", fastmath={"reassoc"})


@njit(inline="always", error_model="numpy")
def _affine_cpu(weight, bias, x, n, affine):
    """The scale and offset in x's dtype (ones and zeros for those absent): the row loops
    then carry no branch (a branch per element kept them scalar: 4 ns an element)."""
    scale = np.ones(n, x.dtype)
    offset = np.zeros(n, x.dtype)
    if affine & HAS_WEIGHT:
        scale[:] = weight[:n]
    if affine & HAS_BIAS:
        offset[:] = bias[:n]
    return scale, offset


# One thread's time an element (768 rows of 128 float32 on one core of the 2-core EPYC:
# forward 44 us, dx 41, the partials of dweight and dbias 23), from which ``_row_blocks`` cuts
# the rows into blocks worth a thread (``ops.cpu_threads.MIN_BLOCK_SECONDS``)
ROW_SECONDS_PER_ELEMENT = 0.45e-9
PARTIALS_SECONDS_PER_ELEMENT = 0.23e-9


def _row_blocks(rows, n, seconds_per_element=ROW_SECONDS_PER_ELEMENT):
    """The ``(start, stop)`` blocks of rows, whole chunks of ``PARAM_CHUNK``, a CPU kernel
    runs in (None: one call)."""
    return work_blocks(rows, rows * n * seconds_per_element, PARAM_CHUNK)


def layer_norm_split_cpu(x, weight, bias, out, mean, rstd, rows, n, eps, affine):
    blocks = _row_blocks(rows, n)
    if blocks is None:
        layer_norm_cpu(x, weight, bias, out, mean, rstd, rows, n, eps, affine)
        return
    run_blocks([(layer_norm_cpu, (x[a * n:b * n], weight, bias, out[a * n:b * n], mean[a:b],
                                  rstd[a:b], b - a, n, eps, affine)) for a, b in blocks])


@njit(**_ROW_LOOPS)
def layer_norm_cpu(x, weight, bias, out, mean, rstd, rows, n, eps, affine):
    scale, offset = _affine_cpu(weight, bias, x, n, affine)
    # every row's statistics, then every row's values: a row's values wait on its sums, the
    # next row's sums do not (768x128 float32, one core of the 2-core Xeon: 73 -> 54 us, the
    # same bits)
    for r in range(rows):
        row = x[r * n:(r + 1) * n]
        shift = float(row[0])
        s1 = 0.0
        s2 = 0.0
        for k in range(n):
            d = float(row[k]) - shift
            s1 += d
            s2 += d * d
        m1 = s1 / n
        mean[r] = shift + m1
        rstd[r] = 1.0 / math.sqrt(max(s2 / n - m1 * m1, 0.0) + eps)
    for r in range(rows):
        row, row_mean = x[r * n:(r + 1) * n], mean[r]
        rstd_t = x.dtype.type(rstd[r])
        target = out[r * n:(r + 1) * n]
        for k in range(n):
            centred = x.dtype.type(float(row[k]) - row_mean)
            target[k] = centred * rstd_t * scale[k] + offset[k]


def layer_norm_grad_split_cpu(x, weight, mean, rstd, grad_out, grad_x, rows, n, affine):
    blocks = _row_blocks(rows, n)
    if blocks is None:
        layer_norm_grad_cpu(x, weight, mean, rstd, grad_out, grad_x, rows, n, affine)
        return
    run_blocks([(layer_norm_grad_cpu, (x[a * n:b * n], weight, mean[a:b], rstd[a:b],
                                       grad_out[a * n:b * n], grad_x[a * n:b * n], b - a, n,
                                       affine)) for a, b in blocks])


@njit(**_ROW_LOOPS)
def layer_norm_grad_cpu(x, weight, mean, rstd, grad_out, grad_x, rows, n, affine):
    scale, _ = _affine_cpu(weight, weight, x, n, affine & HAS_WEIGHT)
    scaled = np.empty(n, x.dtype)
    xhat = np.empty(n, x.dtype)
    for r in range(rows):
        row = x[r * n:(r + 1) * n]
        g = grad_out[r * n:(r + 1) * n]
        row_mean, rstd_t = mean[r], x.dtype.type(rstd[r])
        # Σ g·w and Σ g·w·x̂, in float64
        total = 0.0
        total_xhat = 0.0
        for k in range(n):
            scaled[k] = g[k] * scale[k]
            xhat[k] = x.dtype.type(float(row[k]) - row_mean) * rstd_t
            total += float(scaled[k])
            total_xhat += float(scaled[k]) * float(xhat[k])
        total_t = x.dtype.type(total / n)
        total_xhat_t = x.dtype.type(total_xhat / n)
        target = grad_x[r * n:(r + 1) * n]
        for k in range(n):
            target[k] = rstd_t * (scaled[k] - total_t - xhat[k] * total_xhat_t)


@njit(inline="always")
def _fold_cpu(j, partials, grad_weight, grad_bias, which, lanes):
    """Column j's fold, in ``lanes`` (2, FOLD_LANES), a scratch its caller makes once."""
    lanes[:] = 0.0
    for c in range(partials.shape[1]):
        lanes[0, c % FOLD_LANES] += partials[0, c, j]
        lanes[1, c % FOLD_LANES] += partials[1, c, j]
    width = FOLD_LANES // 2
    while width > 0:
        for lane in range(width):
            lanes[0, lane] += lanes[0, lane + width]
            lanes[1, lane] += lanes[1, lane + width]
        width //= 2
    if which & HAS_WEIGHT:
        grad_weight[j] = lanes[0, 0]
    if which & HAS_BIAS:
        grad_bias[j] = lanes[1, 0]


def layer_norm_params_grad_cpu(x, mean, rstd, grad_out, partials, grad_weight, grad_bias,
                               rows, n, which):
    """The chunks' partials (in blocks of chunks across the threads), then their fold."""
    chunks = partials.shape[1]
    blocks = _row_blocks(rows, n, PARTIALS_SECONDS_PER_ELEMENT)
    if blocks is None:
        partial_sums_cpu(x, mean, rstd, grad_out, partials, rows, n, 0, chunks)
    else:
        run_blocks([(partial_sums_cpu, (x, mean, rstd, grad_out, partials, rows, n,
                                        a // PARAM_CHUNK, -(-b // PARAM_CHUNK)))
                    for a, b in blocks])
    fold_cpu(partials, grad_weight, grad_bias, n, which)


@njit(**CPU_KERNEL, nogil=True, error_model="numpy")
def partial_sums_cpu(x, mean, rstd, grad_out, partials, rows, n, first, last):
    """``ops.layer_norm._partial_sums``'s sums of chunks ``first`` to ``last``, row by row with the columns
    innermost (contiguous, so the loop vectorises: 152 -> 32 us for 768x128, one core), each
    partial still adding its rows in order from zero: the same bits as a column at a time,
    and as CUDA."""
    for c in range(first, last):
        total_xhat, total = partials[0, c], partials[1, c]
        total_xhat[:] = 0.0
        total[:] = 0.0
        for r in range(c * PARAM_CHUNK, min(rows, (c + 1) * PARAM_CHUNK)):
            row_mean, row_rstd = mean[r], rstd[r]
            row, g = x[r * n:(r + 1) * n], grad_out[r * n:(r + 1) * n]
            for j in range(n):
                total[j] += float(g[j])
                total_xhat[j] += float(g[j]) * (row[j] - row_mean) * row_rstd


@njit(**CPU_KERNEL, nogil=True, error_model="numpy")
def fold_cpu(partials, grad_weight, grad_bias, n, which):
    """dweight and dbias: each column's chunk partials folded (``_fold_cpu``)."""
    lanes = np.empty((2, FOLD_LANES))
    for j in range(n):
        _fold_cpu(j, partials, grad_weight, grad_bias, which, lanes)


layer_norm_split_cpu.__wrapped__ = layer_norm_cpu   # the compiled kernel behind each CPU side
layer_norm_grad_split_cpu.__wrapped__ = layer_norm_grad_cpu
layer_norm_params_grad_cpu.__wrapped__ = partial_sums_cpu
