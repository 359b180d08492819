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


# The row loops' arithmetic is in x's dtype, which the vector lanes hold at full width, with
# float64 only per row (mean, rstd, the sums of whole blocks): 768x128 float32, one core of
# the 2-core Xeon, alternating, medians: the forward 57 -> 33 us, the backward's chunks with
# the partials 99 -> 68 (sums and centring in float64 had converted every element there and
# back). "reassoc" lets LLVM keep a sum in vector lanes (a fixed order of this code, the
# same bits every run).
_ROW_LOOPS = dict(CPU_KERNEL, nogil=True, error_model="numpy", fastmath={"reassoc"})
SUM_BLOCK = 256   # elements of a row summed in x's dtype before the sum joins the float64 one


@njit(inline="always", error_model="numpy")
def _affine_cpu(weight, bias, x, n, affine):
    """The scale and offset in x's dtype (ones and zeros for those absent): the row loops
    then carry no branch (a branch per element kept them scalar: 4 ns an element)."""
    scale = np.ones(n, x.dtype)
    offset = np.zeros(n, x.dtype)
    if affine & HAS_WEIGHT:
        _copy(scale, weight, n)
    if affine & HAS_BIAS:
        _copy(offset, bias, n)
    return scale, offset


@njit(inline="always")
def _copy(destination, source, n):
    """``destination[:n] = source[:n]`` (converted to the destination's dtype) as a loop: an
    array assigned to a slice compiled Numba's own copy machinery at a process's first use,
    2.1-3.1 s on the 2-core Xeon (the GPT's cold first CPU step compiled the fold in 2.8 s),
    a loop in 0.1."""
    for k in range(n):
        destination[k] = source[k]


@njit(inline="always", **_ROW_LOOPS)
def _centre(x, row_mean):
    """The row's mean as two numbers of x's dtype, ``hi`` nearest it and ``lo`` the rest:
    ``(x - hi) - lo`` is x - mean to x's own precision (``x - hi`` is exact for x near hi, a
    row far from zero, where x - float32(mean) would keep the mean's rounding)."""
    hi = x.dtype.type(row_mean)
    return hi, x.dtype.type(row_mean - float(hi))


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


@njit(inline="always", **_ROW_LOOPS)
def _shifted_sums(block, shift):
    """``Σ (x - shift)`` and ``Σ (x - shift)²`` over a block of a row, in its dtype (a
    block a call, over its own length: the loop a count from zero, it vectorises, where
    range(a, b) within the row kept it scalar: 768x128, 41 us against 13)."""
    s1 = s2 = block.dtype.type(0)
    for k in range(block.size):
        d = block[k] - shift
        s1 += d
        s2 += d * d
    return s1, s2


@njit(inline="always", **_ROW_LOOPS)
def _row_moments(row):
    """A row's ``Σ (x - x0)`` and ``Σ (x - x0)²`` (x0 its first element), block by block."""
    if row.size <= SUM_BLOCK:
        s1, s2 = _shifted_sums(row, row[0])
        return float(s1), float(s2)
    s1 = 0.0
    s2 = 0.0
    for block in range(0, row.size, SUM_BLOCK):
        b1, b2 = _shifted_sums(row[block:block + SUM_BLOCK], row[0])
        s1 += b1
        s2 += b2
    return s1, s2


@njit(**_ROW_LOOPS)
def layer_norm_cpu(x, weight, bias, out, mean, rstd, rows, n, eps, affine):
    scale, offset = _affine_cpu(weight, bias, x, n, affine)
    # every row's statistics, then every row's values: a row's values wait on its sums, the
    # next row's sums do not (768x128 float32, one core of the 2-core Xeon: 73 -> 54 us, the
    # same bits)
    for r in range(rows):
        row = x[r * n:(r + 1) * n]
        s1, s2 = _row_moments(row)
        m1 = s1 / n
        mean[r] = float(row[0]) + m1
        rstd[r] = 1.0 / math.sqrt(max(s2 / n - m1 * m1, 0.0) + eps)
    for r in range(rows):
        row, target = x[r * n:(r + 1) * n], out[r * n:(r + 1) * n]
        hi, lo = _centre(x, mean[r])
        row_rstd = x.dtype.type(rstd[r])
        for k in range(n):
            target[k] = ((row[k] - hi) - lo) * row_rstd * scale[k] + offset[k]


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


@njit(inline="always", **_ROW_LOOPS)
def _grad_sums(x, grad_out, scale, hi, lo):
    """A row's ``Σ g·w`` and ``Σ g·w·(x - mean)``, in blocks as the forward's sums."""
    if x.size <= SUM_BLOCK:   # no slices: a flat loop had taken 0.92x the blocks (768x128)
        b1, b2 = _scaled_sums(x, grad_out, scale, hi, lo)
        return float(b1), float(b2)
    total = 0.0
    total_centred = 0.0
    for block in range(0, x.size, SUM_BLOCK):
        stop = block + SUM_BLOCK
        b1, b2 = _scaled_sums(x[block:stop], grad_out[block:stop], scale[block:stop], hi, lo)
        total += b1
        total_centred += b2
    return total, total_centred


@njit(inline="always", **_ROW_LOOPS)
def _scaled_sums(x, grad_out, scale, hi, lo):
    b1 = b2 = x.dtype.type(0)
    for k in range(x.size):
        scaled = grad_out[k] * scale[k]
        b1 += scaled
        b2 += scaled * ((x[k] - hi) - lo)
    return b1, b2


@njit(**_ROW_LOOPS)
def layer_norm_chunks_cpu(x, weight, mean, rstd, grad_out, grad_x, partials, rows, n, affine,
                          which, first, last):
    """Chunks ``first`` to ``last``: each row's dx (``ops.layer_norm``'s formula) where
    ``grad_x`` has elements, and each chunk's partials (``ops.layer_norm._partial_sums``:
    its rows added in order from zero in x's dtype, so Σ g is the same bits as CUDA's)
    where ``which`` asks. The columns are innermost and contiguous, so the loops vectorise;
    a row's x and g are read for both while they are in cache. A row is a slice indexed
    from zero: ``x[base + k]``, base from ``first``, kept the loops scalar (a negative index
    wraps, so each element was checked: 768x128 165 -> 35 us)."""
    scale, _ = _affine_cpu(weight, weight, x, n, affine & HAS_WEIGHT)
    partial_xhat, partial_g = np.empty(n, x.dtype), np.empty(n, x.dtype)   # zeroed a chunk
    for c in range(first, last):
        partial_xhat[:] = 0
        partial_g[:] = 0
        for r in range(c * PARAM_CHUNK, min(rows, (c + 1) * PARAM_CHUNK)):
            row, g = x[r * n:(r + 1) * n], grad_out[r * n:(r + 1) * n]
            hi, lo = _centre(x, mean[r])
            row_rstd = x.dtype.type(rstd[r])
            if grad_x.size == 0:
                for k in range(n):
                    partial_g[k] += g[k]
                    partial_xhat[k] += g[k] * (((row[k] - hi) - lo) * row_rstd)
                continue
            total, total_centred = _grad_sums(row, g, scale, hi, lo)
            mean_scaled = x.dtype.type(total / n)
            mean_scaled_xhat = x.dtype.type(rstd[r] * total_centred / n)
            target = grad_x[r * n:(r + 1) * n]
            for k in range(n):   # dx, and the partials (where unasked, as cheap as a branch)
                xhat = ((row[k] - hi) - lo) * row_rstd
                target[k] = row_rstd * (g[k] * scale[k] - mean_scaled - xhat * mean_scaled_xhat)
                partial_g[k] += g[k]
                partial_xhat[k] += g[k] * xhat
        if which:
            _copy(partials[0, c], partial_xhat, n)
            _copy(partials[1, c], partial_g, n)


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
        _copy(grad_weight, lanes[0, 0], n)
    if which & HAS_BIAS:
        _copy(grad_bias, lanes[1, 0], n)


layer_norm_split_cpu.__wrapped__ = layer_norm_cpu   # the compiled kernel behind each CPU side
layer_norm_backward_cpu.__wrapped__ = layer_norm_chunks_cpu
