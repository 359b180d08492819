"""Softmax and log-softmax along one axis, stable (the row maximum is subtracted first).

The input is seen as ``(outer, n, inner)`` with the softmax axis in the middle
(``ops.layout.axis_layout``), so any axis works without a transpose: row ``r = o * inner + i``
starts at ``o * n * inner + i`` and steps by ``inner``. Sums are in float64, in a fixed order,
so results are reproducible.

On the CPU one loop walks each row. On CUDA each row gets an aligned group of ``group``
threads of a ``REDUCE_THREADS``-thread block (``row_group``): lanes read the row strided by
``group`` (coalesced when rows are contiguous), and the row's maximum and sum go through
``ops.block_reduce.group_reduce_cuda``'s fixed tree. Wide contiguous rows get up to a whole
block (4096x1000: 128 lanes per row), narrow ones a few lanes, and rows strided by ``inner``
one thread each, since neighbouring rows are then neighbouring addresses. The row maximum is
cast back to the input's dtype, so ``x - max`` and its ``exp`` are computed in that dtype on
both devices.

Backward, from the saved output y:
- softmax:     dx = y * (g - Σ g·y)
- log_softmax: dx = g - exp(y) * Σ g

log_softmax is ``(x - max) - log Σ exp(x - max)``, never ``x - (max + log Σ ...)``: at huge
tied logits (1e17) the latter loses the log term to rounding and every tied class gets
probability 1.
"""
import functools
import math

import numpy as np
from numba import njit

from ops.block_reduce import MAX, REDUCE_THREADS, SUM, combine_cuda, group_reduce_cuda
from ops.cuda import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel
from ops.layout import axis_layout, flat
from ops.registry import Op, register


def _softmax_row(r, x, out, n, inner, log):
    base = (r // inner) * n * inner + r % inner
    top = x[base]
    for k in range(1, n):
        value = x[base + k * inner]
        if value > top or value != value:   # NaN propagates
            top = value
    total = 0.0
    for k in range(n):   # each exp once: kept in out for softmax
        e = math.exp(x[base + k * inner] - top)
        total += e
        if not log:
            out[base + k * inner] = e
    if log:
        log_total = math.log(total)
        for k in range(n):
            out[base + k * inner] = (x[base + k * inner] - top) - log_total
    else:
        scale = 1.0 / total
        for k in range(n):
            out[base + k * inner] *= scale


def _softmax_grad_row(r, y, g, grad_x, n, inner, log):
    base = (r // inner) * n * inner + r % inner
    total = 0.0
    for k in range(n):
        if log:
            total += g[base + k * inner]
        else:
            total += g[base + k * inner] * y[base + k * inner]
    for k in range(n):
        at = base + k * inner
        if log:
            grad_x[at] = g[at] - math.exp(y[at]) * total
        else:
            grad_x[at] = y[at] * (g[at] - total)


_softmax_row_cpu = njit(inline="always", error_model="numpy")(_softmax_row)
_softmax_grad_row_cpu = njit(inline="always", error_model="numpy")(_softmax_grad_row)

# Lanes per row: the fewest (a power of two, at most a block) that leave each lane at most
# LANE_ELEMENTS elements of a contiguous row per pass. A first guess, not yet measured on the
# H200: bench.ops's softmax rows are the measurement to take.
LANE_ELEMENTS = 8


def row_group(n, inner, lane_elements=LANE_ELEMENTS):
    """Threads per row of ``n`` elements strided by ``inner`` (see the module docstring): for
    a contiguous row the fewest that leave each at most ``lane_elements`` per pass."""
    group = 1
    if inner == 1:
        while group < REDUCE_THREADS and group * lane_elements < n:
            group *= 2
    return group


def _row_launch(kernel, rows, group, args):
    """One launch of ``kernel`` over ``rows`` rows, ``REDUCE_THREADS // group`` rows a block."""
    return ((kernel, -(-rows // (REDUCE_THREADS // group)), REDUCE_THREADS, (*args, group)),)


@functools.cache
def _softmax_cuda(log, dtype):
    """The CUDA forward of softmax (``log`` False) or log_softmax for inputs of ``dtype``."""
    to_input_dtype = np.dtype(dtype).type

    @cuda.jit(cache=True)
    def softmax_cuda(x, out, rows, n, inner, group):
        t = cuda.threadIdx.x
        lane = t % group
        row = cuda.blockIdx.x * (REDUCE_THREADS // group) + t // group
        base = (row // inner) * n * inner + row % inner
        count = n if row < rows else 0   # a group past the last row still joins the reductions
        top = -math.inf
        for k in range(lane, count, group):
            top = combine_cuda(MAX, top, x[base + k * inner])   # NaN propagates
        top = to_input_dtype(group_reduce_cuda(MAX, top, group))
        total = 0.0
        for k in range(lane, count, group):   # each exp once: kept in out for softmax
            e = math.exp(x[base + k * inner] - top)
            total += float(e)   # float64 in the simulator too (NumPy's scalar rules)
            if not log:
                out[base + k * inner] = e
        total = group_reduce_cuda(SUM, total, group)
        if count:
            if log:
                log_total = math.log(total)
                for k in range(lane, count, group):
                    out[base + k * inner] = (x[base + k * inner] - top) - log_total
            else:
                scale = 1.0 / total
                for k in range(lane, count, group):
                    out[base + k * inner] *= scale

    return softmax_cuda


def _softmax_grad_cuda(log):
    """The CUDA backward of softmax (``log`` False) or log_softmax."""

    @cuda.jit(cache=True)
    def softmax_grad_cuda(y, g, grad_x, rows, n, inner, group):
        t = cuda.threadIdx.x
        lane = t % group
        row = cuda.blockIdx.x * (REDUCE_THREADS // group) + t // group
        base = (row // inner) * n * inner + row % inner
        count = n if row < rows else 0
        total = 0.0
        for k in range(lane, count, group):
            if log:
                total += float(g[base + k * inner])
            else:
                total += float(g[base + k * inner] * y[base + k * inner])
        total = group_reduce_cuda(SUM, total, group)
        for k in range(lane, count, group):
            at = base + k * inner
            if log:
                grad_x[at] = g[at] - math.exp(y[at]) * total
            else:
                grad_x[at] = y[at] * (g[at] - total)

    return softmax_grad_cuda


def _softmax_kernels(log, name):
    """The forward and backward twins of softmax (``log`` False) or log_softmax over ``rows``
    rows of ``n`` elements strided by ``inner``."""

    @njit(cache=True, error_model="numpy")
    def softmax_cpu(x, out, rows, n, inner):
        for r in range(rows):
            _softmax_row_cpu(r, x, out, n, inner, log)

    @njit(cache=True, error_model="numpy")
    def softmax_grad_cpu(y, g, grad_x, rows, n, inner):
        for r in range(rows):
            _softmax_grad_row_cpu(r, y, g, grad_x, n, inner, log)

    grad_cuda = _softmax_grad_cuda(log)

    def forward_plan(args):
        x, out, rows, n, inner = args
        return _row_launch(_softmax_cuda(log, x.dtype), rows, row_group(n, inner), args)

    def backward_plan(args):
        y, g, grad_x, rows, n, inner = args
        return _row_launch(grad_cuda, rows, row_group(n, inner), args)

    return (Kernel(name, softmax_cpu, cuda_plan=forward_plan),
            Kernel(f"{name}_grad", softmax_grad_cpu, cuda_plan=backward_plan))


class _Softmax(Op):
    def check(self, x):
        self.rows, self.n, self.inner = axis_layout(tuple(x.shape), self.params.get("axis", -1),
                                                    self.name)

    def forward(self, x):
        layout = (self.rows if x.size else 0, self.n, self.inner)   # empty: no row to run
        self.y = run(self.kernels[0], flat(x), Out(x.shape, x.dtype), *layout)
        return self.y

    def backward(self, grad_out, grad_dst):
        layout = (self.rows if self.y.size else 0, self.n, self.inner)
        return (run(self.kernels[1], flat(self.y), flat(grad_out),
                    Out(self.y.shape, self.y.dtype), *layout),)


@register
class SoftmaxOp(_Softmax):
    """``exp(x - max) / Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "softmax"

    def onnx(self, graph, inputs):   # ONNX's Softmax over one axis: opset 13 on
        return graph.node("Softmax", inputs, axis=int(self.params.get("axis", -1)))
    kernels = _softmax_kernels(False, "softmax")


@register
class LogSoftmaxOp(_Softmax):
    """``(x - max) - log Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "log_softmax"

    def onnx(self, graph, inputs):
        return graph.node("LogSoftmax", inputs, axis=int(self.params.get("axis", -1)))
    kernels = _softmax_kernels(True, "log_softmax")
