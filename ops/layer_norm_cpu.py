"""LayerNorm's CPU kernels (``ops.layer_norm`` has the op, its math and the CUDA kernels):
the forward's row loop; the backward's loop over chunks of ``PARAM_CHUNK`` rows, each row's
dx and the chunk's partials of dweight and dbias in one pass; then the partials' fold, in
the order the CUDA kernels follow.

The forward and the backward's chunk loop run in blocks of whole chunks across the engine's
threads where their measured pace (``ops.kernel_pace``) makes a block worth a thread
(``MIN_BLOCK_SECONDS``), a worker's block handed over as a compiled call
(``ops.compiled_call``): a row's values, and a chunk's partials, are the same bits whichever
block computes them, so the results do not depend on the thread count.
"""
import math

import numpy as np
from numba import njit

from ops.cpu_threads import run_blocks, work_blocks
from ops.kernel_pace import Pace
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


def _row_blocks(pace, rows, n):
    """The ``(start, stop)`` blocks of rows, whole chunks of ``PARAM_CHUNK``, a call of the
    kernel of ``pace`` over ``rows`` rows of ``n`` runs in (None: one call)."""
    seconds = pace.per_unit(rows * n)
    return None if seconds is None else work_blocks(rows, rows * n * seconds, PARAM_CHUNK)


def layer_norm_split_cpu(x, weight, bias, out, mean, rstd, rows, n, eps, affine):
    blocks = _row_blocks(_FORWARD_PACE, rows, n)
    if blocks is None:
        _FORWARD_PACE.whole(rows * n, (x, weight, bias, out, mean, rstd, rows, n, eps, affine))
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


_FORWARD_PACE = Pace(layer_norm_cpu)


def layer_norm_backward_cpu(x, weight, mean, rstd, grad_out, grad_x, partials, grad_weight,
                            grad_bias, rows, n, affine, which):
    """dx (where ``grad_x`` has elements) and, for the parameters ``which`` names, the
    chunks' partials (in blocks of chunks across the threads), then their fold."""
    if grad_x.size == 0 and not which:
        return
    chunks = -(-rows // PARAM_CHUNK)
    blocks = _row_blocks(_BACKWARD_PACE, rows, n)
    args = (x, weight, mean, rstd, grad_out, grad_x, partials, rows, n, affine, which)
    if blocks is None:
        _BACKWARD_PACE.whole(rows * n, args + (0, chunks))
    else:
        run_blocks([(layer_norm_chunks_cpu, args + (a // PARAM_CHUNK, -(-b // PARAM_CHUNK)))
                    for a, b in blocks])
    if which:
        fold_cpu(partials, grad_weight, grad_bias, n, which)


@njit(**_ROW_LOOPS)
def layer_norm_chunks_cpu(x, weight, mean, rstd, grad_out, grad_x, partials, rows, n, affine,
                          which, first, last):
    """Chunks ``first`` to ``last``: each row's dx (``ops.layer_norm``'s formula) where
    ``grad_x`` has elements, and each chunk's partials ``ops.layer_norm._partial_sums``
    where ``which`` asks, each adding its rows in order from zero (the same bits as CUDA's
    thread a column). The columns are innermost and contiguous, so the loops vectorise; a
    row's x and g are read for both while they are in cache. dx's two row sums are taken as
    ``Σ g·w`` and ``rstd · (Σ g·w·x - mean · Σ g·w)`` (float64): a conversion, a multiply-add
    and an add an element where the sums over x̂ had taken seven operations (768x128, one
    core of the 2-core Xeon, CPU time, with the fold: 172-177 -> 166-171 us in three runs;
    and one call from Python where there were three)."""
    scale, _ = _affine_cpu(weight, weight, x, n, affine & HAS_WEIGHT)
    dx = grad_x.size > 0
    for c in range(first, last):
        partial_xhat, partial_g = _chunk_partials(partials, c, which)
        for r in range(c * PARAM_CHUNK, min(rows, (c + 1) * PARAM_CHUNK)):
            row, g = x[r * n:(r + 1) * n], grad_out[r * n:(r + 1) * n]
            row_mean, row_rstd = mean[r], rstd[r]
            if not dx:
                for k in range(n):
                    g_k = float(g[k])
                    partial_g[k] += g_k
                    partial_xhat[k] += g_k * (row[k] - row_mean) * row_rstd
                continue
            rstd_t = x.dtype.type(row_rstd)
            total = 0.0
            total_x = 0.0
            for k in range(n):
                scaled = float(g[k] * scale[k])
                total += scaled
                total_x += scaled * float(row[k])
            total_t = x.dtype.type(total / n)
            total_xhat_t = x.dtype.type(row_rstd * (total_x - row_mean * total) / n)
            target = grad_x[r * n:(r + 1) * n]
            if which:   # dx and the partials in one pass, from one centred x
                for k in range(n):
                    centred = float(row[k]) - row_mean
                    xhat = x.dtype.type(centred) * rstd_t
                    target[k] = rstd_t * (g[k] * scale[k] - total_t - xhat * total_xhat_t)
                    g_k = float(g[k])
                    partial_g[k] += g_k
                    partial_xhat[k] += g_k * centred * row_rstd
            else:
                for k in range(n):
                    xhat = x.dtype.type(float(row[k]) - row_mean) * rstd_t
                    target[k] = rstd_t * (g[k] * scale[k] - total_t - xhat * total_xhat_t)


@njit(inline="always")
def _chunk_partials(partials, c, which):
    """Chunk c's two rows of partials, zeroed (a scratch pair where ``which`` asks none)."""
    if not which:
        return np.empty(0), np.empty(0)
    partials[:, c] = 0.0
    return partials[0, c], partials[1, c]


_BACKWARD_PACE = Pace(layer_norm_chunks_cpu)


@njit(**CPU_KERNEL, nogil=True, error_model="numpy")
def fold_cpu(partials, grad_weight, grad_bias, n, which):
    """dweight and dbias: each column's chunk partials folded, every column at once, the
    columns innermost (the same sums as a column at a time, whose lanes were reset and chunks
    walked with a stride: the GPT's 24 chunks of 128 columns 9.5 -> 2.6 us, 512 of 384 612
    -> 127 us, on the 2-core Xeon, the same bits)."""
    lanes = np.zeros((2, FOLD_LANES, n))
    for c in range(partials.shape[1]):
        lane = c % FOLD_LANES
        for j in range(n):
            lanes[0, lane, j] += partials[0, c, j]
            lanes[1, lane, j] += partials[1, c, j]
    width = FOLD_LANES // 2
    while width > 0:
        for lane in range(width):
            for j in range(n):
                lanes[0, lane, j] += lanes[0, lane + width, j]
                lanes[1, lane, j] += lanes[1, lane + width, j]
        width //= 2
    if which & HAS_WEIGHT:
        grad_weight[:n] = lanes[0, 0]
    if which & HAS_BIAS:
        grad_bias[:n] = lanes[1, 0]


layer_norm_split_cpu.__wrapped__ = layer_norm_cpu   # the compiled kernel behind each CPU side
layer_norm_backward_cpu.__wrapped__ = layer_norm_chunks_cpu
