"""What ``x[key]`` selects: the ``Plan`` that ``ops.indexing``'s gather, scatter and
assignment kernels run (host Python; no kernel here).

A key is read as PyTorch reads it: ints, slices (any step, negative ones as NumPy), ``None``
and ``...`` are basic indices; integer arrays and bool masks (a mask of d dims stands for
the d integer arrays of its ``nonzero()``) are advanced ones, broadcast together to one
shape B. Ints drop their axis before the advanced indices are placed, so ``x[0, :, idx]``
has shape ``(x.shape[1], len(idx))`` as in torch (NumPy moves B to the front there). B takes
the place of the advanced indices when they are adjacent, else it goes first (both agree).

Every index becomes one plan: the result is ``R`` dims (slices and new axes, each a size and
a stride into ``x``) and the B dims, and element ``(r, b)`` of it reads

    x[base + offset_R(r) + sum_j indices[j, b] * stride_j]

with ``indices`` the (m, P) int64 table of the m advanced indices broadcast to B (P
elements; ``ops.indexing``'s ``pack`` kernel writes it). A bad int, slice, mask shape or
broadcast raises here, naming the index, the axis and the size, before anything runs.
"""
import math
import numbers

import numpy as np

from ops.cuda import is_device_array
from ops.device import to_host
from ops.dispatch import Meta
from ops.layout import contiguous_strides


class Plan:
    """What a key selects from a tensor of ``x_shape`` (see the module docstring).

    ``r_dims``: per R dim ``(size, x stride, result axis)``; ``b_shape`` and ``b_axis``: the
    broadcast shape of the advanced indices and the result axis where it starts;
    ``advanced``: per advanced index ``(array, axis, size, x stride)``; ``shape``: the
    result's shape."""

    def __init__(self, x_shape, base, r_dims, advanced, b_shape, b_axis):
        self.x_shape, self.base, self.r_dims = x_shape, base, r_dims
        self.advanced, self.b_shape, self.b_axis = advanced, b_shape, b_axis
        sizes = [size for size, _, _ in r_dims]
        self.shape = tuple(sizes[:b_axis]) + b_shape + tuple(sizes[b_axis:])
        self.rows = math.prod(sizes)   # R combinations: the scatter threads

    def contiguous_block(self):
        """True when the result is one contiguous run of ``x``: a view can stand for it."""
        if self.advanced:
            return False
        kept = [(size, stride) for size, stride, _ in self.r_dims if size != 1]
        expected = contiguous_strides(tuple(size for size, _ in kept))
        return all(stride == want for (_, stride), want in zip(kept, expected))

    def meta(self, source_strides):
        """The kernels' metadata: ``[base, m, nR, R sizes, R x strides, R source strides, nB,
        B sizes, B source strides, advanced x strides]``; ``source_strides`` are those of
        the result (gather, backward) or of the value broadcast to it (assignment)."""
        r_sizes = tuple(size for size, _, _ in self.r_dims)
        r_x = tuple(stride for _, stride, _ in self.r_dims)
        r_source = tuple(source_strides[axis] for _, _, axis in self.r_dims)
        b_source = tuple(source_strides[self.b_axis:self.b_axis + len(self.b_shape)])
        adv_x = tuple(stride for _, _, _, stride in self.advanced)
        return Meta((self.base, len(self.advanced), len(r_sizes)) + r_sizes + r_x + r_source
                    + (len(self.b_shape),) + self.b_shape + b_source + adv_x)


def plan(x_shape, key, device):
    """The ``Plan`` of ``x[key]`` for an array of ``x_shape`` on ``device``; raises IndexError
    (or TypeError for what is no index) naming the index, the axis and the size."""
    items = _expand(x_shape, key if isinstance(key, tuple) else (key,), device)
    base, axis = 0, 0
    strides = contiguous_strides(x_shape)
    r_dims, advanced, positions = [], [], []   # positions: of advanced items among R items
    for kind, item in items:
        if kind == "new":
            r_dims.append((1, 0))
            continue
        size, stride = x_shape[axis], strides[axis]
        if kind == "int":
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for axis {axis} with size {size}")
            base += (item % size) * stride
        elif kind == "slice":
            start, stop, step = item.indices(size)
            count = len(range(start, stop, step))
            r_dims.append((count, step * stride))
            base += start * stride if count else 0
        else:   # an integer array
            positions.append(len(r_dims) + len(positions))
            advanced.append((item, axis, size, stride))
        axis += 1
    b_shape, b_axis = (), len(r_dims)
    if advanced:
        shapes = [tuple(array.shape) for array, _, _, _ in advanced]
        try:
            b_shape = tuple(np.broadcast_shapes(*shapes))
        except ValueError:
            raise IndexError(f"index: the index arrays of shapes {', '.join(map(str, shapes))} "
                             "cannot be broadcast together") from None
        adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
        b_axis = positions[0] if adjacent else 0
    numbered = [(size, stride, axis if axis < b_axis else axis + len(b_shape))
                for axis, (size, stride) in enumerate(r_dims)]
    return Plan(tuple(x_shape), base, numbered, advanced, b_shape, b_axis)


def _expand(x_shape, key, device):
    """The key as ``(kind, item)`` pairs, one per input axis plus the new axes: kinds "int",
    "slice", "new" and "array" (masks expanded to their nonzero() arrays, ``...`` to whole
    slices, and whole slices appended for the axes the key leaves out)."""
    ndim = len(x_shape)
    classified = [(None, None) if item is Ellipsis else _classify(item, device) for item in key]
    if sum(kind is None for kind, _ in classified) > 1:
        raise IndexError("index: an index can only have a single ellipsis ('...')")
    consumed = sum(item.ndim if kind == "mask" else 1 for kind, item in classified
                   if kind not in (None, "new"))
    if consumed > ndim:
        raise IndexError(f"index: too many indices for a tensor of dimension {ndim} "
                         f"({consumed} given)")
    whole = [("slice", slice(None))] * (ndim - consumed)
    at = next((k for k, (kind, _) in enumerate(classified) if kind is None), len(classified))
    items, axis = [], 0
    for kind, item in classified[:at] + whole + classified[at + 1:]:
        if kind != "mask":
            items.append((kind, item))
            axis += kind != "new"
            continue
        indexed = tuple(x_shape[axis:axis + item.ndim])
        if tuple(item.shape) != indexed:
            raise IndexError(f"index: the bool mask of shape {tuple(item.shape)} does not match "
                             f"the indexed axes {indexed} of a tensor of shape "
                             f"{tuple(x_shape)} (from axis {axis})")
        items += [("array", positions) for positions in np.nonzero(to_host(item))]
        axis += item.ndim
    return items


def _classify(item, device):
    if item is None:
        return "new", None
    if isinstance(item, slice):
        for part in (item.start, item.stop, item.step):
            if part is not None and not isinstance(part, numbers.Integral):
                raise TypeError(f"index: slice bounds must be integers or None, got {item}")
        if item.step == 0:
            raise ValueError("index: slice step cannot be zero")
        return "slice", item
    if isinstance(item, (bool, np.bool_)):
        raise IndexError("index: a bool scalar is not an index; index with a bool mask tensor")
    if isinstance(item, numbers.Integral):
        return "int", int(item)
    if isinstance(item, list):
        item = np.asarray(item)
        if item.size == 0:   # x[[]]: no positions, whatever dtype NumPy guessed
            item = item.astype(np.int64)
    if not hasattr(item, "dtype") or not hasattr(item, "shape"):
        raise TypeError(f"index: {type(item).__name__} is not an index (ints, slices, None, "
                        "..., integer arrays or tensors, bool masks)")
    if is_device_array(item) and device != "cuda":
        raise ValueError(f"index: the index of shape {tuple(item.shape)} lives on cuda and the "
                         "tensor on the cpu; move the index with .to('cpu')")
    kind = np.dtype(item.dtype).kind
    if kind == "b":
        if item.ndim == 0:
            raise IndexError("index: a 0-d bool mask is not an index; use a mask of the "
                             "indexed axes' shape")
        return "mask", item
    if kind not in "iu":
        raise IndexError(f"index: index arrays must be integers or bools, got {item.dtype}")
    if not is_device_array(item) and item.ndim == 0:
        return "int", int(item)
    return "array", item
