"""Softmax and log-softmax along one axis, stable (the row maximum is subtracted first).

The input is seen as ``(outer, n, inner)`` with the softmax axis in the middle, so any axis
works without a transpose: row ``r = o * inner + i`` starts at ``o * n * inner + i`` and
steps by ``inner``. One thread handles one row, in a fixed order (sums in float64), so the
CPU and CUDA kernels agree and results are reproducible.

Backward, from the saved output y:
- softmax:     dx = y * (g - Σ g·y)
- log_softmax: dx = g - exp(y) * Σ g
"""
import math

import numpy as np
from numba import cuda, njit

from ops.device import device_of
from ops.launch import device_meta, launch
from ops.layout import flat
from ops.memory import empty
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
        shift = top + math.log(total)
        for k in range(n):
            out[base + k * inner] = x[base + k * inner] - shift
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
_softmax_row_cuda = cuda.jit(device=True)(_softmax_row)
_softmax_grad_row_cpu = njit(inline="always", error_model="numpy")(_softmax_grad_row)
_softmax_grad_row_cuda = cuda.jit(device=True)(_softmax_grad_row)


@njit(cache=True, error_model="numpy")
def softmax_cpu(x, out, meta, log):
    rows, n, inner = meta[0], meta[1], meta[2]
    for r in range(rows):
        _softmax_row_cpu(r, x, out, n, inner, log)


@cuda.jit(cache=True)
def softmax_cuda(x, out, meta, log):
    r = cuda.grid(1)
    if r < meta[0]:
        _softmax_row_cuda(r, x, out, meta[1], meta[2], log)


@njit(cache=True, error_model="numpy")
def softmax_grad_cpu(y, g, grad_x, meta, log):
    rows, n, inner = meta[0], meta[1], meta[2]
    for r in range(rows):
        _softmax_grad_row_cpu(r, y, g, grad_x, n, inner, log)


@cuda.jit(cache=True)
def softmax_grad_cuda(y, g, grad_x, meta, log):
    r = cuda.grid(1)
    if r < meta[0]:
        _softmax_grad_row_cuda(r, y, g, grad_x, meta[1], meta[2], log)


def _layout(shape, axis, op_name):
    ndim = len(shape)
    if not isinstance(axis, (int, np.integer)) or not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"{op_name}: axis {axis!r} is out of range for shape {tuple(shape)}")
    if ndim == 0:
        return (1, 1, 1)
    axis = int(axis) % ndim
    n, inner = shape[axis], math.prod(shape[axis + 1:])
    return (math.prod(shape[:axis]) * inner, n, inner)


def _run(cpu_kernel, cuda_kernel, meta_values, arrays, log):
    rows = meta_values[0]
    if rows == 0 or meta_values[1] == 0:
        return
    if device_of(arrays[0]) == "cuda":
        launch(cuda_kernel, rows, *[flat(a) for a in arrays], device_meta(meta_values), log)
    else:
        cpu_kernel(*[flat(a) for a in arrays], np.array(meta_values, np.int64), log)


class _Softmax(Op):
    cpu_kernels = (softmax_cpu, softmax_grad_cpu)
    cuda_kernels = (softmax_cuda, softmax_grad_cuda)
    log = False

    def forward(self, x):
        self.meta = _layout(tuple(x.shape), self.params.get("axis", -1), self.name)
        self.y = empty(x.shape, x.dtype, device_of(x))
        _run(softmax_cpu, softmax_cuda, self.meta, (x, self.y), self.log)
        return self.y

    def backward(self, grad_out, grad_dst):
        grad_x = empty(self.y.shape, self.y.dtype, device_of(self.y))
        _run(softmax_grad_cpu, softmax_grad_cuda, self.meta, (self.y, grad_out, grad_x), self.log)
        return (grad_x,)


@register
class Softmax(_Softmax):
    """``exp(x - max) / Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "softmax"


@register
class LogSoftmax(_Softmax):
    """``x - max - log Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "log_softmax"
    log = True
