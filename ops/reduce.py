"""Reductions: sum, mean and max over no axis, one axis or several, with keepdims.

The input's dims are split into kept dims (one output element per combination) and reduced
dims, described by ``ops.layout.reduction_layout``. Accumulation is in float64 on both
devices. On the GPU each output element is one block of ``REDUCE_THREADS`` threads that
reduces in a fixed order (strided per-thread folds, then ``block_reduce_cuda``), so results
are reproducible run to run: no float atomics.

Backward: sum and mean broadcast ``grad_out`` back over the reduced dims (``expand``, one
thread per input element, scaled by 1/count for the mean); max routes ``grad_out`` to the
maxima of each group, split evenly among ties.
"""
import math

from numba import njit

from ops.block_reduce import (MAX, REDUCE_THREADS, SUM, block_reduce_cuda, combine_cpu,
                               combine_cuda)
from ops.cuda_backend import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, blocks_of, elements
from ops.layout import (broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda, flat,
                        normalize_axes, offset_cpu, offset_cuda, reduced_shape,
                        reduction_layout)
from ops.registry import Op, register

def _reduce_kernel(code, name):
    """The twin kernels of a sum (``code`` SUM) or max over the reduced dims, times ``scale``."""
    start = 0.0 if code == SUM else -math.inf

    @njit(cache=True, error_model="numpy")
    def reduce_cpu(x, out, meta, scale):
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        # one contiguous reduced run per output (trailing axes, axis=None): no index arithmetic
        contiguous = reduced_dims == 1 and meta[reduced_first + 1] == 1
        for o in range(out.size):
            base = offset_cpu(o, meta, 3, kept_dims)
            acc = start
            for r in range(n_reduced):
                at = base + r if contiguous else base + offset_cpu(r, meta, reduced_first,
                                                                   reduced_dims)
                acc = combine_cpu(code, acc, x[at])
            out[o] = acc * scale

    @cuda.jit(cache=True)
    def reduce_cuda(x, out, meta, scale):
        o = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        base = offset_cuda(o, meta, 3, kept_dims)
        acc = start
        for r in range(t, n_reduced, REDUCE_THREADS):
            acc = combine_cuda(code, acc,
                                x[base + offset_cuda(r, meta, reduced_first, reduced_dims)])
        total = block_reduce_cuda(code, acc)
        if t == 0:
            out[o] = total * scale

    return Kernel(name, reduce_cpu, reduce_cuda,
                  blocks_of(lambda x, out, meta, scale: out.size, REDUCE_THREADS))


REDUCE = {SUM: _reduce_kernel(SUM, "sum"), MAX: _reduce_kernel(MAX, "max")}


@njit(cache=True, error_model="numpy")
def expand_cpu(g, out, meta, scale):
    for i in range(out.size):
        at, _ = broadcast_offsets_cpu(i, meta)
        out[i] = g[at] * scale


@cuda.jit(cache=True)
def expand_cuda(g, out, meta, scale):
    i = cuda.grid(1)
    if i < out.size:
        at, _ = broadcast_offsets_cuda(i, meta)
        out[i] = g[at] * scale


EXPAND = Kernel("expand", expand_cpu, expand_cuda, elements(1))


@njit(cache=True, error_model="numpy")
def max_backward_cpu(x, y, grad_out, grad_in, meta):
    """grad_in = grad_out on the maxima of each reduced group (split evenly among ties), else 0."""
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    for o in range(y.size):
        base = offset_cpu(o, meta, 3, kept_dims)
        ties = 0
        for r in range(n_reduced):
            if x[base + offset_cpu(r, meta, reduced_first, reduced_dims)] == y[o]:
                ties += 1
        share = grad_out[o] / max(ties, 1)
        for r in range(n_reduced):
            at = base + offset_cpu(r, meta, reduced_first, reduced_dims)
            grad_in[at] = share if x[at] == y[o] else share - share


@cuda.jit(cache=True)
def max_backward_cuda(x, y, grad_out, grad_in, meta):
    o = cuda.grid(1)
    if o >= y.size:
        return
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    base = offset_cuda(o, meta, 3, kept_dims)
    ties = 0
    for r in range(n_reduced):
        if x[base + offset_cuda(r, meta, reduced_first, reduced_dims)] == y[o]:
            ties += 1
    share = grad_out[o] / max(ties, 1)
    for r in range(n_reduced):
        at = base + offset_cuda(r, meta, reduced_first, reduced_dims)
        grad_in[at] = share if x[at] == y[o] else share - share


MAX_BACKWARD = Kernel("max_backward", max_backward_cpu, max_backward_cuda, elements(1))


# ------------------------------------------------------------------ array-level functions

def reduce(code, x, axes, keepdims=False, scale=1.0):
    meta = Meta(reduction_layout(tuple(x.shape), axes))
    return run(REDUCE[code], flat(x), Out(reduced_shape(x.shape, axes, keepdims), x.dtype), meta,
               float(scale))


def sum_to_shape(grad, shape):
    """Sum a broadcast gradient back down to an input's ``shape`` (identity when equal)."""
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    pad = grad.ndim - len(shape)
    axes = tuple(range(pad)) + tuple(
        pad + i for i, s in enumerate(shape) if s == 1 and grad.shape[pad + i] != 1)
    return reduce(SUM, grad, axes, keepdims=False).reshape(shape)


def expand(grad, x_shape, axes, scale=1.0):
    """The inverse of reducing over ``axes``: ``grad * scale`` broadcast back to ``x_shape``."""
    keep_shape = reduced_shape(x_shape, axes, keepdims=True)
    meta = Meta(broadcast_layout(tuple(x_shape), keep_shape, keep_shape))
    return run(EXPAND, flat(grad), Out(x_shape, grad.dtype), meta, grad.dtype.type(scale))


# ------------------------------------------------------------------ ops

class _Reduce(Op):
    def check(self, x):
        self.x_shape = tuple(x.shape)
        self.axes = normalize_axes(self.params.get("axis"), x.ndim, self.name)
        self.keepdims = self.params.get("keepdims", False)


@register
class Sum(_Reduce):
    name = "sum"
    kernels = (REDUCE[SUM], EXPAND)

    def forward(self, x):
        return reduce(SUM, x, self.axes, self.keepdims)

    def backward(self, grad_out, grad_dst):
        return (expand(grad_out, self.x_shape, self.axes),)


@register
class Mean(_Reduce):
    name = "mean"
    kernels = (REDUCE[SUM], EXPAND)

    def check(self, x):
        super().check(x)
        self.count = math.prod(x.shape[i] for i in self.axes)
        if self.count == 0:
            raise ValueError(f"mean: reducing an empty axis of shape {self.x_shape}")

    def forward(self, x):
        return reduce(SUM, x, self.axes, self.keepdims, scale=1.0 / self.count)

    def backward(self, grad_out, grad_dst):
        return (expand(grad_out, self.x_shape, self.axes, scale=1.0 / self.count),)


@register
class Max(_Reduce):
    name = "max"
    kernels = (REDUCE[MAX], MAX_BACKWARD)

    def check(self, x):
        super().check(x)
        if any(x.shape[i] == 0 for i in self.axes):
            raise ValueError(f"max: reducing an empty axis of shape {self.x_shape}")

    def forward(self, x):
        self.x = x
        self.y = reduce(MAX, x, self.axes, self.keepdims)
        return self.y

    def backward(self, grad_out, grad_dst):
        x = self.x
        meta = Meta(reduction_layout(self.x_shape, self.axes))
        return (run(MAX_BACKWARD, flat(x), flat(self.y), flat(grad_out), Out(x.shape, x.dtype),
                    meta),)
