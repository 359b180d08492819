"""Reductions: sum, mean, max and min over no axis, one axis or several, with keepdims; and
argmax / argmin (int64 positions) over no axis or one.

The input's dims are split into kept dims (one output element per combination) and reduced
dims, described by ``ops.layout.reduction_layout``. Accumulation is in float64 on both
devices. On the GPU each output element is one block of ``REDUCE_THREADS`` threads that
reduces in a fixed order (strided per-thread folds, then ``block_reduce_cuda``), so results
are reproducible run to run: no float atomics.

Min is the max of ``-x``, negated: the block reduction has one extremum, and negation is
exact. Backward: sum and mean broadcast ``grad_out`` back over the reduced dims (``expand``,
one thread per input element, scaled by 1/count for the mean); max and min route
``grad_out`` to the extrema of each group, split evenly among ties.

Argmax and argmin give the first position of the extremum, NaN counting as the extremum (as
NumPy and torch). On the GPU each thread keeps the first extremum of its strided share; two
passes of the block reduction then give the extremum and the smallest position holding it.
"""
import math

import numpy as np
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

MIN = 2   # beside ops.block_reduce's SUM and MAX: reduced as MAX of -x


def _reduce_kernel(code, name):
    """The twin kernels of a sum (``code`` SUM), max or min over the reduced dims, times
    ``scale``."""
    fold = SUM if code == SUM else MAX
    sign = -1.0 if code == MIN else 1.0
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
                acc = combine_cpu(fold, acc, sign * x[at])
            out[o] = sign * acc * scale

    @cuda.jit(cache=True)
    def reduce_cuda(x, out, meta, scale):
        o = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        base = offset_cuda(o, meta, 3, kept_dims)
        acc = start
        for r in range(t, n_reduced, REDUCE_THREADS):
            acc = combine_cuda(fold, acc,
                               sign * x[base + offset_cuda(r, meta, reduced_first, reduced_dims)])
        total = block_reduce_cuda(fold, acc)
        if t == 0:
            out[o] = sign * total * scale

    return Kernel(name, reduce_cpu, reduce_cuda,
                  blocks_of(lambda x, out, meta, scale: out.size, REDUCE_THREADS))


REDUCE = {SUM: _reduce_kernel(SUM, "sum"), MAX: _reduce_kernel(MAX, "max"),
          MIN: _reduce_kernel(MIN, "min")}


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
    """grad_in = grad_out on the extrema ``y`` of each reduced group (split evenly among ties),
    else 0: the backward of max and of min."""
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


# ------------------------------------------------------------------ argmax, argmin

ARGMAX, ARGMIN = 0, 1


def _beats(code, value, best):
    """True when ``value`` displaces ``best`` as the extremum seen so far: strictly larger
    (smaller) values, and the first NaN, which nothing displaces."""
    if value != value:
        return best == best
    return value > best if code == ARGMAX else value < best


_beats_cpu = njit(inline="always", error_model="numpy")(_beats)
_beats_cuda = cuda.jit(device=True)(_beats)


def _arg_kernel(code, name):
    """The twin kernels of argmax (``code`` ARGMAX) or argmin over the reduced dims."""
    sign = 1.0 if code == ARGMAX else -1.0   # the block reduction looks for the largest

    @njit(cache=True, error_model="numpy")
    def arg_cpu(x, out, meta):
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        for o in range(out.size):
            base = offset_cpu(o, meta, 3, kept_dims)
            best = x[base + offset_cpu(0, meta, reduced_first, reduced_dims)]
            best_at = 0
            for r in range(1, n_reduced):
                value = x[base + offset_cpu(r, meta, reduced_first, reduced_dims)]
                if _beats_cpu(code, value, best):
                    best = value
                    best_at = r
            out[o] = best_at

    @cuda.jit(cache=True)
    def arg_cuda(x, out, meta):
        o = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        base = offset_cuda(o, meta, 3, kept_dims)
        best = 0.0
        best_at = -1   # this thread's share may be empty
        for r in range(t, n_reduced, REDUCE_THREADS):
            value = x[base + offset_cuda(r, meta, reduced_first, reduced_dims)]
            if best_at < 0 or _beats_cuda(code, value, best):
                best = value
                best_at = r
        mine = sign * best if best_at >= 0 else -math.inf
        top = block_reduce_cuda(MAX, mine)   # NaN wins, as in _beats
        holds_top = best_at >= 0 and (mine == top or (mine != mine and top != top))
        # the smallest position holding the extremum, as the largest of -position
        first = block_reduce_cuda(MAX, -float(best_at) if holds_top else -math.inf)
        if t == 0:
            out[o] = int(-first)

    return Kernel(name, arg_cpu, arg_cuda,
                  blocks_of(lambda x, out, meta: out.size, REDUCE_THREADS))


ARG = {ARGMAX: _arg_kernel(ARGMAX, "argmax"), ARGMIN: _arg_kernel(ARGMIN, "argmin")}


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


class _Extremum(_Reduce):
    """Max or min; the backward routes ``grad_out`` to the extrema either way."""
    code = None

    def check(self, x):
        super().check(x)
        if any(x.shape[i] == 0 for i in self.axes):
            raise ValueError(f"{self.name}: reducing an empty axis of shape {self.x_shape}")

    def forward(self, x):
        self.x = x
        self.y = reduce(self.code, x, self.axes, self.keepdims)
        return self.y

    def backward(self, grad_out, grad_dst):
        x = self.x
        meta = Meta(reduction_layout(self.x_shape, self.axes))
        return (run(MAX_BACKWARD, flat(x), flat(self.y), flat(grad_out), Out(x.shape, x.dtype),
                    meta),)


@register
class Max(_Extremum):
    name, code = "max", MAX
    kernels = (REDUCE[MAX], MAX_BACKWARD)


@register
class Min(_Extremum):
    name, code = "min", MIN
    kernels = (REDUCE[MIN], MAX_BACKWARD)


class _ArgReduce(Op):
    """The int64 position of the extremum over one axis, or over the flattened input for
    ``axis=None`` (with keepdims: every axis kept at size 1). Never differentiated."""
    code = None

    def check(self, x):
        axis = self.params.get("axis")
        if axis is not None and not isinstance(axis, (int, np.integer)):
            raise TypeError(f"{self.name}: axis must be an int or None, got {axis!r} "
                            "(NumPy and torch take one axis here)")
        self.axes = normalize_axes(axis, x.ndim, self.name)
        if any(x.shape[i] == 0 for i in self.axes) or x.size == 0:
            raise ValueError(f"{self.name}: an empty axis of shape {tuple(x.shape)} has no "
                             "extremum")

    def forward(self, x):
        shape = reduced_shape(x.shape, self.axes, self.params.get("keepdims", False))
        return run(ARG[self.code], flat(x), Out(shape, np.int64),
                   Meta(reduction_layout(tuple(x.shape), self.axes)))


@register
class ArgMax(_ArgReduce):
    name, code = "argmax", ARGMAX
    kernels = (ARG[ARGMAX],)


@register
class ArgMin(_ArgReduce):
    name, code = "argmin", ARGMIN
    kernels = (ARG[ARGMIN],)
