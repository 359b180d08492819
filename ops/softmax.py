"""Softmax and log-softmax along one axis, stable (the row maximum is subtracted first).

The input is seen as ``(outer, n, inner)`` with the softmax axis in the middle
(``ops.layout.axis_layout``), so any axis works without a transpose: row ``r = o * inner + i``
starts at ``o * n * inner + i`` and steps by ``inner``. One thread handles one row, in a fixed order (sums in float64), so the
CPU and CUDA kernels agree and results are reproducible.

Backward, from the saved output y:
- softmax:     dx = y * (g - Σ g·y)
- log_softmax: dx = g - exp(y) * Σ g

log_softmax is ``(x - max) - log Σ exp(x - max)``, never ``x - (max + log Σ ...)``: at huge
tied logits (1e17) the latter loses the log term to rounding and every tied class gets
probability 1.
"""
import math

from numba import njit

from ops.cuda_backend import cuda
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
_softmax_row_cuda = cuda.jit(device=True)(_softmax_row)
_softmax_grad_row_cpu = njit(inline="always", error_model="numpy")(_softmax_grad_row)
_softmax_grad_row_cuda = cuda.jit(device=True)(_softmax_grad_row)


def _rows(*args):   # the grid rule: one thread per row (args[-3] is the row count)
    return args[-3]


def _softmax_kernels(log, name):
    """The forward and backward twins of softmax (``log`` False) or log_softmax, one thread
    per row, over ``rows`` rows of ``n`` elements strided by ``inner``."""

    @njit(cache=True, error_model="numpy")
    def softmax_cpu(x, out, rows, n, inner):
        for r in range(rows):
            _softmax_row_cpu(r, x, out, n, inner, log)

    @cuda.jit(cache=True)
    def softmax_cuda(x, out, rows, n, inner):
        r = cuda.grid(1)
        if r < rows:
            _softmax_row_cuda(r, x, out, n, inner, log)

    @njit(cache=True, error_model="numpy")
    def softmax_grad_cpu(y, g, grad_x, rows, n, inner):
        for r in range(rows):
            _softmax_grad_row_cpu(r, y, g, grad_x, n, inner, log)

    @cuda.jit(cache=True)
    def softmax_grad_cuda(y, g, grad_x, rows, n, inner):
        r = cuda.grid(1)
        if r < rows:
            _softmax_grad_row_cuda(r, y, g, grad_x, n, inner, log)

    return (Kernel(name, softmax_cpu, softmax_cuda, _rows),
            Kernel(f"{name}_grad", softmax_grad_cpu, softmax_grad_cuda, _rows))


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
class Softmax(_Softmax):
    """``exp(x - max) / Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "softmax"
    kernels = _softmax_kernels(False, "softmax")


@register
class LogSoftmax(_Softmax):
    """``(x - max) - log Σ exp(x - max)`` along ``axis`` (default -1)."""
    name = "log_softmax"
    kernels = _softmax_kernels(True, "log_softmax")
