"""``topk`` along the last axis, and the row gather that turns its positions into values.

- ``topk`` (positions, never differentiated): per row of ``n``, the positions of the ``k``
  largest (or smallest) elements in order, as torch's ``topk(sorted=True)``: ties keep the
  lower position first and NaN counts as larger than every number (torch's order). A thread
  owns a row and picks each next element as the best one strictly after the previous pick
  in that order, so it needs no scratch: O(n k) a row, for the small k of sampling (top-k
  of 40 among a vocabulary).
- ``take_along_rows`` (differentiable): ``out[r, s] = x[r, positions[r, s]]``. Its backward
  gives each row to one thread, which zeroes the row and adds the row's gradients in order
  of s: repeated positions sum, in a fixed order, with no atomics.
"""
import numpy as np
from numba import njit

from ops.cuda_backend import cuda
from ops.dispatch import Out, run
from ops.launch import CPU_KERNEL, Kernel
from ops.layout import flat
from ops.registry import Op, register
from ops.twin import twin


def _before(values, i, j, largest):
    """True when element i comes before element j in topk's order."""
    a, b = values[i], values[j]
    a_nan, b_nan = a != a, b != b
    if a_nan or b_nan:
        if a_nan and b_nan:
            return i < j
        return a_nan == largest   # NaN is the largest element
    if a != b:
        return a > b if largest else a < b
    return i < j


_before_cpu, _before_cuda = twin(_before)


def _select_with(before):
    def select(r, x, positions, n, k, largest):
        """Row r's k first positions in topk's order, into ``positions[r * k:]``."""
        base = r * n
        previous = -1
        for s in range(k):
            best = -1
            for j in range(n):
                after = previous < 0 or before(x, base + previous, base + j, largest)
                if after and (best < 0 or before(x, base + j, base + best, largest)):
                    best = j
            positions[r * k + s] = best
            previous = best
    return select


_select_cpu, _select_cuda = twin(_select_with, (_before_cpu, _before_cuda))


@njit(**CPU_KERNEL)
def topk_cpu(x, positions, rows, n, k, largest):
    for r in range(rows):
        _select_cpu(r, x, positions, n, k, largest)


@cuda.jit(cache=True)
def topk_cuda(x, positions, rows, n, k, largest):
    r = cuda.grid(1)
    if r < rows:
        _select_cuda(r, x, positions, n, k, largest)


@njit(**CPU_KERNEL)
def take_along_rows_cpu(x, positions, out, n, k):
    for t in range(out.size):
        out[t] = x[(t // k) * n + positions[t]]


@cuda.jit(cache=True)
def take_along_rows_cuda(x, positions, out, n, k):
    t = cuda.grid(1)
    if t < out.size:
        out[t] = x[(t // k) * n + positions[t]]


def _scatter_row(r, grad_out, positions, grad_x, n, k):
    for j in range(n):
        grad_x[r * n + j] = 0
    for s in range(k):
        grad_x[r * n + positions[r * k + s]] += grad_out[r * k + s]


_scatter_row_cpu, _scatter_row_cuda = twin(_scatter_row)


@njit(**CPU_KERNEL)
def take_along_rows_grad_cpu(grad_out, positions, grad_x, n, k):
    for r in range(grad_x.size // n if n else 0):
        _scatter_row_cpu(r, grad_out, positions, grad_x, n, k)


@cuda.jit(cache=True)
def take_along_rows_grad_cuda(grad_out, positions, grad_x, n, k):
    r = cuda.grid(1)
    if n and r < grad_x.size // n:
        _scatter_row_cuda(r, grad_out, positions, grad_x, n, k)


TOPK = Kernel("topk", topk_cpu, topk_cuda, lambda x, positions, rows, *rest: rows)
TAKE_ALONG_ROWS = Kernel("take_along_rows", take_along_rows_cpu, take_along_rows_cuda,
                         lambda x, positions, out, *rest: out.size)
TAKE_ALONG_ROWS_GRAD = Kernel("take_along_rows_grad", take_along_rows_grad_cpu,
                              take_along_rows_grad_cuda,
                              lambda g, positions, grad_x, n, k: grad_x.size // n if n else 0)


@register
class TopK(Op):
    """The int64 positions of the ``k`` largest (``largest``) or smallest elements of each
    row of the last axis, in order."""
    name = "topk"
    kernels = (TOPK,)

    def check(self, x):
        k = self.params["k"]
        n = tuple(x.shape)[-1] if x.ndim else 1
        if not 0 <= k <= n:
            raise ValueError(f"topk: k {k} is outside [0, {n}] (the size of the dim, input "
                             f"of shape {tuple(x.shape)})")

    def forward(self, x):
        n = tuple(x.shape)[-1] if x.ndim else 1
        k = self.params["k"]
        rows = x.size // n if n else 0
        shape = (tuple(x.shape)[:-1] if x.ndim else ()) + ((k,) if x.ndim else ())
        return run(TOPK, flat(x), Out(shape, np.int64), rows, n, k, bool(self.params["largest"]))


@register
class TakeAlongRows(Op):
    """``x[..., positions]`` row by row: positions (..., k) int64 within the last axis of x
    (..., n), the leading dims equal."""
    name = "take_along_rows"
    kernels = (TAKE_ALONG_ROWS, TAKE_ALONG_ROWS_GRAD)
    integer_inputs = (1,)

    def check(self, x, positions):
        if x.ndim < 1 or tuple(x.shape)[:-1] != tuple(positions.shape)[:-1] \
                or positions.ndim != x.ndim:
            raise ValueError(f"take_along_rows: positions {tuple(positions.shape)} must match "
                             f"the leading dims of x {tuple(x.shape)}")

    def forward(self, x, positions):
        self.x_shape, self.positions = tuple(x.shape), positions
        return run(TAKE_ALONG_ROWS, flat(x), flat(positions), Out(positions.shape, x.dtype),
                   tuple(x.shape)[-1], tuple(positions.shape)[-1])

    def backward(self, grad_out, grad_dst):
        return (run(TAKE_ALONG_ROWS_GRAD, flat(grad_out), flat(self.positions),
                    Out(self.x_shape, grad_out.dtype), self.x_shape[-1],
                    tuple(self.positions.shape)[-1]), None)
