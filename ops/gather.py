"""Batch gather: the rows of a data set that an index list picks, into fresh batch buffers.

This is the DataLoader's one kernel per batch. The whole data set lives on the loader's
device; a batch is ``x[order[start:start + count]]`` and ``y[...]`` of the same rows, copied
by one launch for both arrays (a launch costs ~20 us plus ~5 us per argument, more than
the copy itself at MNIST sizes). It is not a registered Op: it has no gradient and is never
recorded on the tape.
"""
from numba import njit

from ops.cuda_backend import cuda
from ops.device import device_of
from ops.dispatch import Out, run
from ops.launch import Kernel


@njit(cache=True)
def gather_rows_cpu(x, y, order, start, x_out, y_out):
    for b in range(x_out.shape[0]):
        row = order[start + b]
        for j in range(x_out.shape[1]):
            x_out[b, j] = x[row, j]
        for j in range(y_out.shape[1]):
            y_out[b, j] = y[row, j]


@cuda.jit(cache=True)
def gather_rows_cuda(x, y, order, start, x_out, y_out):
    # one thread per (row of the batch, column): consecutive threads read consecutive
    # elements of one source row, so the reads of a warp coalesce
    k = cuda.grid(1)
    x_cols = x_out.shape[1]
    y_cols = y_out.shape[1]
    cols = max(x_cols, y_cols)
    if k < x_out.shape[0] * cols:
        b = k // cols
        j = k - b * cols
        row = order[start + b]
        if j < x_cols:
            x_out[b, j] = x[row, j]
        if j < y_cols:
            y_out[b, j] = y[row, j]


def _threads(x, y, order, start, x_out, y_out):
    return x_out.shape[0] * max(x.shape[1], y.shape[1])


GATHER_ROWS = Kernel("gather_rows", gather_rows_cpu, gather_rows_cuda, _threads)


def gather_rows(x, y, order, start, count):
    """``x[order[start:start+count]]`` and ``y[...]`` as fresh arrays on the inputs' device.

    ``x`` and ``y`` are 2-D ``[N, columns]`` C-contiguous arrays on one device, ``order``
    a 1-D integer array there whose values are row indices below N (the caller's
    permutation: they are not range-checked per element, which would cost a pass)."""
    if len({device_of(a) for a in (x, y, order)}) > 1:
        shapes = ", ".join(f"{device_of(a)} {tuple(a.shape)}" for a in (x, y, order))
        raise ValueError(f"gather_rows: inputs live on different devices ({shapes})")
    if x.ndim != 2 or y.ndim != 2 or order.ndim != 1:
        raise ValueError(f"gather_rows: expects 2-D x and y and a 1-D order, got shapes "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(order.shape)}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"gather_rows: x has {x.shape[0]} rows but y has {y.shape[0]}")
    if start < 0 or count < 0 or start + count > order.shape[0]:
        raise ValueError(f"gather_rows: rows {start}..{start + count} are outside the "
                         f"order of length {order.shape[0]}")
    return run(GATHER_ROWS, x, y, order, start, Out((count, x.shape[1]), x.dtype, flat=False),
               Out((count, y.shape[1]), y.dtype, flat=False))

