"""Batch gather: the rows of a data set that an index list picks, into fresh batch buffers.

This is the DataLoader's one kernel per batch. The whole data set lives on the loader's
device; a batch is ``x[order[start:start + count]]`` and ``y[...]`` of the same rows, copied
by one launch for both arrays (a launch costs ~20 us plus ~5 us per argument, more than
the copy itself at MNIST sizes). It is not a registered Op: it has no gradient and is never
recorded on the tape.

The batch's first position is ``cursor[0] + start``: ``cursor`` a one-element device counter
(``ops.step_counter``). A plain batch passes a counter holding 0 and its start; a captured
training step passes the loader's epoch cursor, which it advances on the device, so each
replay of the step gathers the next batch without Python between them.
"""
import numpy as np

from ops.cuda import cuda
from ops.device import device_of
from ops.dispatch import Out, run
from ops.flag_buffer import flag_buffer
from ops.launch import Kernel
from ops.step_counter import new_counter


def gather_rows_cpu(x, y, order, cursor, start, x_out, y_out, flags):
    """The CPU side: NumPy's ``take`` of the batch's rows, as fast as the ``@njit`` loop it
    replaced (74-79 us for an MNIST batch of 128 rows) and nothing to compile, where the loop
    cost 0.32-0.36 s of the cold first step. The indices are clipped, never read past x."""
    first = int(cursor[0]) + start
    if first < 0 or first + x_out.shape[0] > order.shape[0]:   # a cursor run past the order
        flags[0], flags[1], flags[2], flags[3] = 1, first, x_out.shape[0], order.shape[0]
        x_out[:] = 0
        y_out[:] = 0
        return
    rows = order[first:first + x_out.shape[0]]
    np.take(x, rows, axis=0, out=x_out, mode="clip")
    np.take(y, rows, axis=0, out=y_out, mode="clip")


@cuda.jit(cache=True)
def gather_rows_cuda(x, y, order, cursor, start, x_out, y_out, flags):
    # one thread per (row of the batch, column): consecutive threads read consecutive
    # elements of one source row, so the reads of a warp coalesce
    k = cuda.grid(1)
    x_cols = x_out.shape[1]
    y_cols = y_out.shape[1]
    cols = max(x_cols, y_cols)
    if k < x_out.shape[0] * cols:
        b = k // cols
        j = k - b * cols
        first = cursor[0] + start
        if first < 0 or first + x_out.shape[0] > order.shape[0]:   # past the order
            if k == 0:
                flags[1], flags[2], flags[3] = first, x_out.shape[0], order.shape[0]
                flags[0] = 1
            if j < x_cols:
                x_out[b, j] = 0
            if j < y_cols:
                y_out[b, j] = 0
            return
        row = order[first + b]
        if j < x_cols:
            x_out[b, j] = x[row, j]
        if j < y_cols:
            y_out[b, j] = y[row, j]


def _threads(x, y, order, cursor, start, x_out, y_out, flags):
    return x_out.shape[0] * max(x.shape[1], y.shape[1])


GATHER_ROWS = Kernel("gather_rows", gather_rows_cpu, gather_rows_cuda, _threads)


def gather_rows(x, y, order, start, count, cursor=None):
    """``x[order[p:p+count]]`` and ``y[...]`` as fresh arrays on the inputs' device, with
    ``p = start``, or ``p = cursor[0] + start`` for a device ``cursor``.

    ``x`` and ``y`` are 2-D ``[N, columns]`` C-contiguous arrays on one device, ``order``
    a 1-D integer array there whose values are row indices below N (the caller's
    permutation: they are not range-checked per element, which would cost a pass). With a
    cursor the caller keeps ``p .. p+count`` inside ``order``: its value is on the device,
    so it is not checked here."""
    if len({device_of(a) for a in (x, y, order)}) > 1:
        shapes = ", ".join(f"{device_of(a)} {tuple(a.shape)}" for a in (x, y, order))
        raise ValueError(f"gather_rows: inputs live on different devices ({shapes})")
    if x.ndim != 2 or y.ndim != 2 or order.ndim != 1:
        raise ValueError(f"gather_rows: expects 2-D x and y and a 1-D order, got shapes "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(order.shape)}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"gather_rows: x has {x.shape[0]} rows but y has {y.shape[0]}")
    if cursor is None:
        if start < 0 or count < 0 or start + count > order.shape[0]:
            raise ValueError(f"gather_rows: rows {start}..{start + count} are outside the "
                             f"order of length {order.shape[0]}")
        cursor = _zero_cursor(device_of(x))
    bad = flag_buffer("gather_rows", device_of(x), _past_the_order, IndexError)
    if bad.deferred:
        bad.raise_if_flagged()   # an earlier batch's cursor, read without a sync
    batch = run(GATHER_ROWS, x, y, order, cursor, start,
                Out((count, x.shape[1]), x.dtype, flat=False),
                Out((count, y.shape[1]), y.dtype, flat=False), bad.device)
    if not bad.deferred:
        bad.raise_if_flagged()
    return batch


def _past_the_order(values, deferred):
    when = " (an earlier batch; CUDA reports it one call late)" if deferred else ""
    return (f"gather_rows: the batch of {values[2]} rows at position {values[1]} runs past "
            f"the order of length {values[3]}{when}: the cursor was not set to the epoch's "
            "batches (EpochCursor.start_epoch / seek)")


_zero_cursors = {}


def _zero_cursor(device):
    """The counter holding 0 that plain batches gather at (one per device, never advanced)."""
    cursor = _zero_cursors.get(device)
    if cursor is None:
        cursor = _zero_cursors[device] = new_counter(device, 0)
    return cursor
