"""Reductions: sum, mean and max over no axis, one axis or several, with keepdims.

Layout: the input's dims are split into kept dims (one output element per combination) and
reduced dims; both travel to the kernel in one int64 ``meta`` array
``[n_reduced, n_kept_dims, n_reduced_dims, kept shape, kept strides, reduced shape,
reduced strides]``. Accumulation is in float64 on both devices. On the GPU each output
element is one block that reduces in a fixed order (strided per-thread sums, then a
shared-memory tree), so results are reproducible run to run: no float atomics.
"""
import functools
import math

import numpy as np
from numba import cuda, float64, njit

from ops.device import SIMULATOR, device_of
from ops.launch import device_meta, launch_blocks, run_kernel
from ops.layout import coalesce, contiguous_strides, flat
from ops.memory import empty
from ops.registry import Op, register

SUM, MAX = 0, 1
REDUCE_THREADS = 8 if SIMULATOR else 128   # a power of two (the tree halves it)


def _offset(index, meta, first, ndim):
    """Offset of the ``index``-th combination of the dims described at meta[first:]."""
    offset = 0
    for k in range(ndim - 1, -1, -1):
        size = meta[first + k]
        offset += (index % size) * meta[first + ndim + k]
        index //= size
    return offset


_offset_cpu = njit(inline="always", error_model="numpy")(_offset)
_offset_cuda = cuda.jit(device=True)(_offset)


@njit(cache=True, error_model="numpy")
def reduce_cpu(code, x, out, meta, scale):
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    # one contiguous reduced run per output (trailing axes, axis=None): no index arithmetic
    contiguous = reduced_dims == 1 and meta[reduced_first + 1] == 1
    for o in range(out.size):
        base = _offset_cpu(o, meta, 3, kept_dims)
        acc = 0.0 if code == SUM else -math.inf
        for r in range(n_reduced):
            offset = base + r if contiguous else base + _offset_cpu(r, meta, reduced_first,
                                                                     reduced_dims)
            value = x[offset]
            if code == SUM:
                acc += value
            elif value > acc or value != value:   # NaN wins, as in NumPy
                acc = value
        out[o] = acc * scale


@cuda.jit(cache=True)
def reduce_cuda(code, x, out, meta, scale):
    partial = cuda.shared.array(REDUCE_THREADS, float64)
    o = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    base = _offset_cuda(o, meta, 3, kept_dims)
    acc = 0.0 if code == SUM else -math.inf
    for r in range(t, n_reduced, REDUCE_THREADS):
        value = x[base + _offset_cuda(r, meta, reduced_first, reduced_dims)]
        if code == SUM:
            acc += value
        elif value > acc or value != value:
            acc = value
    partial[t] = acc
    cuda.syncthreads()
    step = REDUCE_THREADS // 2
    while step > 0:
        if t < step:
            other = partial[t + step]
            if code == SUM:
                partial[t] += other
            elif other > partial[t] or other != other:
                partial[t] = other
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[o] = partial[0] * scale


@njit(cache=True, error_model="numpy")
def max_backward_cpu(x, y, grad_out, grad_in, meta):
    """grad_in = grad_out on the maxima of each reduced group (split evenly among ties), else 0."""
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    for o in range(y.size):
        base = _offset_cpu(o, meta, 3, kept_dims)
        ties = 0
        for r in range(n_reduced):
            if x[base + _offset_cpu(r, meta, reduced_first, reduced_dims)] == y[o]:
                ties += 1
        share = grad_out[o] / max(ties, 1)
        for r in range(n_reduced):
            offset = base + _offset_cpu(r, meta, reduced_first, reduced_dims)
            grad_in[offset] = share if x[offset] == y[o] else share - share


@cuda.jit(cache=True)
def max_backward_cuda(x, y, grad_out, grad_in, meta):
    o = cuda.grid(1)
    if o >= y.size:
        return
    n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
    reduced_first = 3 + 2 * kept_dims
    base = _offset_cuda(o, meta, 3, kept_dims)
    ties = 0
    for r in range(n_reduced):
        if x[base + _offset_cuda(r, meta, reduced_first, reduced_dims)] == y[o]:
            ties += 1
    share = grad_out[o] / max(ties, 1)
    for r in range(n_reduced):
        offset = base + _offset_cuda(r, meta, reduced_first, reduced_dims)
        grad_in[offset] = share if x[offset] == y[o] else share - share


# ------------------------------------------------------------------ wrappers

def normalize_axes(axis, ndim, op_name):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    normalized = []
    for a in axes:
        if not -ndim <= a < max(ndim, 1) or (ndim == 0 and a not in (0, -1)):
            raise ValueError(f"{op_name}: axis {a} is out of range for a {ndim}-d input")
        normalized.append(int(a) % max(ndim, 1))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{op_name}: repeated axis in {axis}")
    return tuple(sorted(normalized)) if ndim else ()


def reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


@functools.lru_cache(maxsize=1024)
def _layout(shape, axes):
    strides = contiguous_strides(shape)
    kept = [i for i in range(len(shape)) if i not in axes]
    kept_shape, (kept_strides,) = coalesce([shape[i] for i in kept], [strides[i] for i in kept])
    red_shape, (red_strides,) = coalesce([shape[i] for i in axes], [strides[i] for i in axes])
    n_reduced = math.prod(shape[i] for i in axes)
    return ((n_reduced, len(kept_shape), len(red_shape))
            + kept_shape + kept_strides + red_shape + red_strides)


def _meta(x, axes):
    layout = _layout(tuple(x.shape), axes)
    if device_of(x) == "cuda":
        return device_meta(layout)
    return np.array(layout, dtype=np.int64)


def reduce(code, x, axes, keepdims=False, scale=1.0):
    out = empty(reduced_shape(x.shape, axes, keepdims), x.dtype, device_of(x))
    scale = float(scale)
    if device_of(x) == "cuda":
        launch_blocks(reduce_cuda, out.size, REDUCE_THREADS, code, flat(x), flat(out),
                      _meta(x, axes), scale)
    else:
        reduce_cpu(code, flat(x), flat(out), _meta(x, axes), scale)
    return out


def sum_to_shape(grad, shape):
    """Sum a broadcast gradient back down to an input's ``shape`` (identity when equal)."""
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    pad = grad.ndim - len(shape)
    axes = tuple(range(pad)) + tuple(
        pad + i for i, s in enumerate(shape) if s == 1 and grad.shape[pad + i] != 1)
    return reduce(SUM, grad, axes, keepdims=False).reshape(shape)


def expand_to(grad, x_shape, axes):
    """The inverse of reducing over ``axes``: ``grad`` broadcast back to ``x_shape``."""
    from ops.elementwise import MUL, binary
    keep_shape = reduced_shape(x_shape, axes, keepdims=True)
    ones = _ones(x_shape, grad.dtype, device_of(grad))
    return binary(MUL, ones, grad.reshape(keep_shape), op_name="expand")


def _ones(shape, dtype, device):
    from ops.fill import fill
    return fill(empty(shape, dtype, device), 1)


# ------------------------------------------------------------------ ops

class _Reduce(Op):
    cpu_kernels = (reduce_cpu,)
    cuda_kernels = (reduce_cuda,)

    def _axes(self, x):
        self.x_shape = tuple(x.shape)
        self.axes = normalize_axes(self.params.get("axis"), x.ndim, self.name)
        self.keepdims = self.params.get("keepdims", False)
        return self.axes


@register
class Sum(_Reduce):
    name = "sum"

    def forward(self, x):
        return reduce(SUM, x, self._axes(x), self.keepdims)

    def backward(self, grad_out, grad_dst):
        return (expand_to(grad_out, self.x_shape, self.axes),)


@register
class Mean(_Reduce):
    name = "mean"

    def forward(self, x):
        axes = self._axes(x)
        self.count = math.prod(x.shape[i] for i in axes)
        if self.count == 0:
            raise ValueError(f"mean: reducing an empty axis of shape {self.x_shape}")
        return reduce(SUM, x, axes, self.keepdims, scale=1.0 / self.count)

    def backward(self, grad_out, grad_dst):
        from ops.elementwise import MUL_SCALAR, unary
        return (unary(MUL_SCALAR, expand_to(grad_out, self.x_shape, self.axes), 1.0 / self.count),)


@register
class Max(_Reduce):
    name = "max"
    cpu_kernels = (reduce_cpu, max_backward_cpu)
    cuda_kernels = (reduce_cuda, max_backward_cuda)

    def forward(self, x):
        axes = self._axes(x)
        if any(x.shape[i] == 0 for i in axes):
            raise ValueError(f"max: reducing an empty axis of shape {self.x_shape}")
        self.x = x
        self.y = reduce(MAX, x, axes, self.keepdims)
        return self.y

    def backward(self, grad_out, grad_dst):
        x = self.x
        grad_in = empty(x.shape, x.dtype, device_of(x))
        args = (flat(x), flat(self.y), flat(grad_out), flat(grad_in), _meta(x, self.axes))
        run_kernel(device_of(x), max_backward_cpu, max_backward_cuda, self.y.size, *args)
        return (grad_in,)
