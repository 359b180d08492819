"""Shape arithmetic and the int64 metadata the kernels read: broadcasting, reductions, axes.

Every kernel argument costs launch time (4-5 us each through Numba's path on the H200), so
the shapes and strides of a launch travel as one small int64 array, built here once per
distinct layout and cached: read-only NumPy arrays for the CPU kernels, device arrays for the
CUDA ones. The three layouts:

- broadcast (binary elementwise ops, and ``expand``, a reduction's gradient broadcast back):
  ``[ndim, shape, a strides, b strides]`` of the coalesced output, or ``[0]`` when both
  inputs have the output's shape, where ``broadcast_offsets`` reads element ``i`` of each
  (a kernel may test ``meta[0] == 0`` first to skip the call; none needs to);
- reduction: ``[n_reduced, n_kept_dims, n_reduced_dims, kept shape, kept strides,
  reduced shape, reduced strides]``;
- one axis (softmax): ``(rows, n, inner)``, the input seen as ``(outer, n, inner)``, passed
  as three scalars.

The kernels read the first two through ``broadcast_offsets`` and ``offset``, compiled below
for both devices on one index loop, ``unravel_offsets`` (also that of ``ops.compare``'s
where and ``ops.indexing``'s gathers and scatters).
"""
import functools
import math
from collections import OrderedDict

import numpy as np

from ops.cuda import device_reshape
from ops.device import to_device
from ops.twin import twin

_DEVICE_META_CACHE_SIZE = 4096
_device_meta = OrderedDict()


def flat(array):
    """A 1-D view of a C-contiguous host or device array (0-d arrays included)."""
    if array.ndim == 1:
        return array
    if type(array) is np.ndarray:
        return array.reshape(array.size)
    return device_reshape(array, (array.size,))


@functools.lru_cache(maxsize=4096)
def host_meta(values):
    """A cached read-only int64 NumPy array holding the tuple ``values``."""
    meta = np.array(values if values else (0,), dtype=np.int64)
    meta.flags.writeable = False
    return meta


def meta_on(device, values):
    """``values`` as a cached int64 array on ``device`` (``host_meta`` or ``device_meta``)."""
    return device_meta(values) if device == "cuda" else host_meta(values)


def device_meta(values):
    """A cached int64 device array holding the tuple ``values``."""
    meta = _device_meta.get(values)
    if meta is None:
        meta = _device_meta[values] = to_device(host_meta(values), "cuda")
        if len(_device_meta) > _DEVICE_META_CACHE_SIZE:
            _device_meta.popitem(last=False)
    else:
        _device_meta.move_to_end(values)
    return meta


# ------------------------------------------------------------------ shapes and strides

def broadcast_shape(a_shape, b_shape, op_name):
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if a_shape == b_shape:   # the common case without NumPy's general rule: 1.6 us a call,
        return a_shape       # made twice an eager binary op (its check and its forward)
    try:
        return np.broadcast_shapes(a_shape, b_shape)
    except ValueError:
        raise ValueError(
            f"{op_name}: shapes {a_shape} and {b_shape} cannot be broadcast together"
        ) from None


def contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def broadcast_strides(in_shape, out_shape):
    """Element strides of an input read as if it had ``out_shape`` (0 on broadcast dims)."""
    pad = len(out_shape) - len(in_shape)
    own = contiguous_strides(in_shape)
    return tuple(
        0 if i < pad or in_shape[i - pad] == 1 else own[i - pad] for i in range(len(out_shape))
    )


def coalesce(shape, *stride_sets):
    """Drop size-1 dims and merge neighbours that are contiguous in every operand.

    Fewer dims means less index arithmetic per element in the kernels."""
    dims = [(s, [st[i] for st in stride_sets]) for i, s in enumerate(shape) if s != 1]
    merged = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(p == s * size for p, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    shape_out = tuple(size for size, _ in merged)
    strides_out = tuple(tuple(strides[k] for _, strides in merged) for k in range(len(stride_sets)))
    return shape_out, strides_out


SAME_SHAPE = (0,)   # the broadcast metadata of operands and output of one shape


@functools.lru_cache(maxsize=1024)
def broadcast_layout(out_shape, a_shape, b_shape):
    """The broadcast metadata of ``a <op> b`` into ``out_shape`` (see the module docstring)."""
    if tuple(a_shape) == tuple(b_shape) == tuple(out_shape):
        return SAME_SHAPE
    shape, (a_strides, b_strides) = coalesce(
        out_shape, broadcast_strides(a_shape, out_shape), broadcast_strides(b_shape, out_shape))
    return (len(shape),) + shape + a_strides + b_strides


# ------------------------------------------------------------------ reductions

def normalize_axes(axis, ndim, op_name):
    """``axis`` (None, an int or a tuple; negative counts from the end) as sorted axes."""
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
def reduction_layout(shape, axes):
    """The reduction metadata of reducing ``shape`` over ``axes`` (see the module docstring)."""
    strides = contiguous_strides(shape)
    kept = [i for i in range(len(shape)) if i not in axes]
    kept_shape, (kept_strides,) = coalesce([shape[i] for i in kept], [strides[i] for i in kept])
    red_shape, (red_strides,) = coalesce([shape[i] for i in axes], [strides[i] for i in axes])
    n_reduced = math.prod(shape[i] for i in axes)
    return ((n_reduced, len(kept_shape), len(red_shape))
            + kept_shape + kept_strides + red_shape + red_strides)


def axis_layout(shape, axis, op_name):
    """``(rows, n, inner)``: ``shape`` seen as ``(outer, n, inner)`` around ``axis``."""
    ndim = len(shape)
    if not isinstance(axis, (int, np.integer)) or not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"{op_name}: axis {axis!r} is out of range for shape {tuple(shape)}")
    if ndim == 0:
        return (1, 1, 1)
    axis = int(axis) % ndim
    n, inner = shape[axis], math.prod(shape[axis + 1:])
    return (math.prod(shape[:axis]) * inner, n, inner)


# ------------------------------------------------------------------ reading the metadata in kernels

def _unravel_offsets(index, meta, first, ndim, sets):
    """Offsets of the ``index``-th combination of the ``ndim`` dims described at
    ``meta[first:]``: their shape, then ``sets`` (1 to 3, a constant at every call) stride
    sets; one offset per set, the unused ones 0. The one index loop of the broadcast,
    reduction, where and indexing layouts."""
    offset_0 = 0
    offset_1 = 0
    offset_2 = 0
    for k in range(ndim - 1, -1, -1):
        size = meta[first + k]
        coord = index % size
        index //= size
        offset_0 += coord * meta[first + ndim + k]
        if sets > 1:
            offset_1 += coord * meta[first + 2 * ndim + k]
        if sets > 2:
            offset_2 += coord * meta[first + 3 * ndim + k]
    return offset_0, offset_1, offset_2


def _broadcast_offsets_with(unravel_offsets):
    def broadcast_offsets(i, meta):
        """Offsets into the two inputs of output element ``i`` of a broadcast layout; ``i``
        itself in both for the same-shape layout ``[0]`` (a sum over size-1 axes expands its
        gradient so: not a 0-d broadcast of the first element)."""
        if meta[0] == 0:
            return i, i
        offset_a, offset_b, _ = unravel_offsets(i, meta, 1, meta[0], 2)
        return offset_a, offset_b
    return broadcast_offsets


def _offset_with(unravel_offsets):
    def offset(index, meta, first, ndim):
        """Offset of the ``index``-th combination of the ``ndim`` dims described at
        meta[first:] (shape, then strides): a reduction layout's kept or reduced part."""
        return unravel_offsets(index, meta, first, ndim, 1)[0]
    return offset


unravel_offsets = twin(_unravel_offsets)   # the (cpu, cuda) pair, for twin(make, ...)
unravel_offsets_cpu, unravel_offsets_cuda = unravel_offsets
broadcast_offsets_cpu, broadcast_offsets_cuda = twin(_broadcast_offsets_with, unravel_offsets)
offset_cpu, offset_cuda = twin(_offset_with, unravel_offsets)
