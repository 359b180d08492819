"""Indexing: ``x[key]`` (basic and advanced, bool masks; differentiable) and ``x[key] = value``.

``ops.index_plan`` reads the key into a ``Plan``: the result's R dims (slices and new axes)
and B dims (the advanced indices broadcast together), element ``(r, b)`` reading ``x`` at
``base + offset_R(r) + sum_j indices[j, b] * stride_j``. The ``pack`` kernel writes
``indices``, the (m, P) int64 table of the m advanced indices broadcast to B, on the tensor's
device, range-checked and made non-negative. The gather is one thread per result element. The
same plan drives the scatters: the backward (a zeroed gradient, then ``grad[x offset] +=
grad_out[...]``) and ``x[key] = value``. Their threads are the R combinations, each walking b
= 0, 1, ... in order: two threads never reach one element of ``x`` (their R coordinates
differ), and within a thread repeated indices accumulate (or the last assignment wins) in a
fixed order. No atomics.

Memory: a result that is one contiguous block of ``x`` is a view sharing its memory, as in
NumPy and torch: ``x[i]``, ``x[i:j]``, ``x[i, j:k]``, ``x[..., :]`` and the like (leading ints,
then at most one step-1 slice, then whole axes). Every other result is a copy.

Bad indices. Ints and host index arrays are checked on the host: an IndexError names the
index, the axis and the size before anything runs. Index tensors on the tensor's device are
checked by ``pack``; a bad one is read as 0 and recorded in a small buffer. On the CPU the
IndexError follows at once. On CUDA the buffer is mapped memory read without a sync at the
start of the next indexing call (or this one's backward), as cross-entropy's label check.
"""
import math
import numbers

import numpy as np
from numba import njit

from ops.array_copy import COPY, copy_array
from ops.cast import BOOL, as_bytes, cast
from ops.cuda import cuda, is_device_array
from ops.device import device_of, to_device
from ops.dispatch import Meta, Out, run
from ops.fill import FILL, fill
from ops.flag_buffer import flag_buffer
from ops.input_fault import fault_message, record_fault_cpu, record_fault_cuda
from ops.index_plan import plan
from ops.launch import Kernel, elements
from ops.layout import (broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda,
                        broadcast_strides, contiguous_strides, flat, unravel_offsets)
from ops.memory import empty
from ops.registry import register
from ops.shape import Movement
from ops.twin import twin


# ------------------------------------------------------------------ bad indices

_bad_index_message = fault_message("index {0} is out of bounds for axis {1} with size {2}",
                                   "an index tensor of a recent CUDA indexing call")


def _bad_indices(device):
    return flag_buffer("index", device, _bad_index_message, IndexError)


# ------------------------------------------------------------------ kernels

def _pack_one_with(record_fault):
    def pack_one(value, p, indices, row, size, axis, bad):
        """indices[row, p] = ``value`` made non-negative; one outside [-size, size) is
        recorded in ``bad`` and read as 0."""
        index = value + size if value < 0 else value
        if index < 0 or index >= size:
            record_fault(bad, value, axis, size)
            index = 0
        indices[row, p] = index
    return pack_one


_pack_one_cpu, _pack_one_cuda = twin(_pack_one_with, (record_fault_cpu, record_fault_cuda))


@njit(cache=True, error_model="numpy")
def pack_cpu(source, indices, row, size, axis, meta, bad):
    for p in range(indices.shape[1]):
        at = p if meta[0] == 0 else broadcast_offsets_cpu(p, meta)[0]
        _pack_one_cpu(source[at], p, indices, row, size, axis, bad)


@cuda.jit(cache=True)
def pack_cuda(source, indices, row, size, axis, meta, bad):
    p = cuda.grid(1)
    if p < indices.shape[1]:
        at = p if meta[0] == 0 else broadcast_offsets_cuda(p, meta)[0]
        _pack_one_cuda(source[at], p, indices, row, size, axis, bad)


PACK = Kernel("index_pack", pack_cpu, pack_cuda,
              lambda source, indices, *rest: indices.shape[1])


def _r_offsets_with(unravel_offsets):
    def r_offsets(r, meta):
        """(x offset, source offset) of R combination ``r`` (``Plan.meta``'s layout)."""
        at_x, at_source, _ = unravel_offsets(r, meta, 3, meta[2], 2)
        return meta[0] + at_x, at_source
    return r_offsets


def _b_offsets_with(unravel_offsets):
    def b_offsets(b, indices, meta):
        """(x offset, source offset) of element ``b`` of the advanced indices' broadcast
        shape."""
        first = 3 + 3 * meta[2]
        n_b = meta[first]
        at_source = unravel_offsets(b, meta, first + 1, n_b, 1)[0]
        at_x = 0
        strides = first + 1 + 2 * n_b
        for j in range(meta[1]):
            at_x += indices[j, b] * meta[strides + j]
        return at_x, at_source
    return b_offsets


_r_offsets_cpu, _r_offsets_cuda = twin(_r_offsets_with, unravel_offsets)
_b_offsets_cpu, _b_offsets_cuda = twin(_b_offsets_with, unravel_offsets)


@njit(cache=True, error_model="numpy")
def gather_cpu(x, indices, out, meta):
    per_row = indices.shape[1]
    for t in range(out.size):
        r = t // per_row
        b = t - r * per_row
        x_r, out_r = _r_offsets_cpu(r, meta)
        x_b, out_b = _b_offsets_cpu(b, indices, meta)
        out[out_r + out_b] = x[x_r + x_b]


@cuda.jit(cache=True)
def gather_cuda(x, indices, out, meta):
    t = cuda.grid(1)
    if t < out.size:
        per_row = indices.shape[1]
        r = t // per_row
        b = t - r * per_row
        x_r, out_r = _r_offsets_cuda(r, meta)
        x_b, out_b = _b_offsets_cuda(b, indices, meta)
        out[out_r + out_b] = x[x_r + x_b]


GATHER = Kernel("index_gather", gather_cpu, gather_cuda, elements(2))

ADD, SET = 0, 1


def _scatter_row_with(r_offsets, b_offsets):
    def scatter_row(mode, r, source, indices, x, meta):
        """R combination ``r`` of ``x[plan] += source`` (``mode`` ADD) or ``= source``, its
        advanced elements in order."""
        x_r, source_r = r_offsets(r, meta)
        for b in range(indices.shape[1]):
            x_b, source_b = b_offsets(b, indices, meta)
            if mode == ADD:
                x[x_r + x_b] += source[source_r + source_b]
            else:
                x[x_r + x_b] = source[source_r + source_b]
    return scatter_row


# module functions the kernels call by name: a kernel closing over a compiled function would
# be compiled again in every process (Numba's cache keys a closure by its values' pickle)
_scatter_row_cpu, _scatter_row_cuda = twin(_scatter_row_with, (_r_offsets_cpu, _r_offsets_cuda),
                                           (_b_offsets_cpu, _b_offsets_cuda))


def _scatter_kernel(mode, name):
    """The twin kernels of ``x[plan] += source`` (``mode`` ADD, a constant of each) or
    ``x[plan] = source``: one thread per R combination, walking the advanced elements in
    order."""
    @njit(cache=True, error_model="numpy")
    def scatter_cpu(source, indices, x, meta, rows):
        for r in range(rows):
            _scatter_row_cpu(mode, r, source, indices, x, meta)

    @cuda.jit(cache=True)
    def scatter_cuda(source, indices, x, meta, rows):
        r = cuda.grid(1)
        if r < rows:
            _scatter_row_cuda(mode, r, source, indices, x, meta)

    return Kernel(name, scatter_cpu, scatter_cuda, lambda *args: args[4])


SCATTER_ADD = _scatter_kernel(ADD, "index_scatter_add")
SCATTER_SET = _scatter_kernel(SET, "index_scatter_set")


# ------------------------------------------------------------------ running a plan

def pack_indices(plan, device):
    """The (m, P) int64 table of the plan's advanced indices on ``device`` (checked there)."""
    count = math.prod(plan.b_shape)
    indices = empty((len(plan.advanced), count if plan.advanced else 1), np.int64, device)
    bad = _bad_indices(device)
    if bad.deferred:
        bad.raise_if_flagged()   # an earlier call's bad device index, read without a sync
    for row, (array, axis, size, _) in enumerate(plan.advanced):
        if not is_device_array(array):
            array = np.ascontiguousarray(array)
            _check_on_host(array, axis, size)
            if device == "cuda":
                array = to_device(array, device)
        shape = tuple(array.shape)
        run(PACK, flat(array), indices, row, size, axis,
            Meta(broadcast_layout(plan.b_shape, shape, shape)), bad.device)
    if plan.advanced and not bad.deferred:
        bad.raise_if_flagged()
    return indices


def _check_on_host(array, axis, size):
    bad = np.flatnonzero((array < -size) | (array >= size))
    if bad.size:
        raise IndexError(f"index {array.reshape(-1)[bad[0]]} is out of bounds for axis {axis} "
                         f"with size {size}")


def gather(x, plan, indices):
    """``x[plan]`` as a new array (or a view of ``x`` where the result is a block of it)."""
    if plan.contiguous_block():
        size = math.prod(plan.shape)
        return flat(x)[plan.base:plan.base + size].reshape(plan.shape)
    meta = plan.meta(contiguous_strides(plan.shape))
    return run(GATHER, flat(x), indices, Out(plan.shape, x.dtype), meta)


@register
class Index(Movement):
    """``x[key]``: ``params["key"]`` holds ints, slices, None, ..., and host or device
    integer and bool arrays (a Tensor's storage)."""
    name = "index"
    kernels = (PACK, GATHER, FILL, SCATTER_ADD, COPY)

    def check(self, x):
        self.device = device_of(x)
        self.plan = plan(tuple(x.shape), self.params["key"], self.device)

    def onnx(self, graph, inputs):   # ints (Gather) and slices (Slice), axis by axis
        key = self.params["key"]
        value, axis, shape = inputs[0], 0, graph.input_shapes[0]
        for part in key if isinstance(key, tuple) else (key,):
            if isinstance(part, numbers.Integral) and not isinstance(part, bool):
                index = graph.constant(np.array(int(part), np.int64), "index.at")
                value = graph.node("Gather", [value, index], axis=axis)   # drops the axis
                shape = shape[:axis] + shape[axis + 1:]
            elif isinstance(part, slice) and part == slice(None):   # the whole axis: no cut
                axis += 1
            elif isinstance(part, slice):
                start, stop, step = part.indices(shape[axis])
                if step < 0 and stop < 0:   # to the front: past index 0
                    stop = -shape[axis] - 1
                bounds = [graph.constant(np.array([bound], np.int64), f"index.{what}")
                          for what, bound in (("starts", start), ("ends", stop),
                                              ("axes", axis), ("steps", step))]
                value = graph.node("Slice", [value, *bounds])
                shape = shape[:axis] + (len(range(start, stop, step)),) + shape[axis + 1:]
                axis += 1
            else:
                graph.refuse(f"index: only integers and slices export (x[0], x[:, 2:5]), "
                             f"got the key {key!r}")
        return value

    def forward(self, x):
        self.indices = pack_indices(self.plan, self.device)
        self.is_view = self.plan.contiguous_block()   # gather returns a view of x then
        return gather(x, self.plan, self.indices)

    def backward(self, grad_out, grad_dst):
        bad = _bad_indices(self.device)
        if bad.deferred:
            bad.raise_if_flagged()
        grad = fill(empty(self.plan.x_shape, grad_out.dtype, self.device), 0)
        if self.is_view:   # a block of x (attention's x[0] of q, k, v): one plain copy
            size = math.prod(self.plan.shape)
            if size:
                copy_array(flat(grad)[self.plan.base:self.plan.base + size], flat(grad_out))
            return (grad,)
        run(SCATTER_ADD, flat(grad_out), self.indices, flat(grad), self.plan.meta(
            contiguous_strides(self.plan.shape)), self.plan.rows)
        return (grad,)


def assign(x, key, value):
    """``x[key] = value`` in place: ``value`` a Python number or an array (host or on x's
    device) that broadcasts to the selection; it is cast to x's dtype, and copied first, so
    a value overlapping ``x`` (a view of it) reads what ``x`` held before."""
    device = device_of(x)
    target = plan(tuple(x.shape), key, device)
    indices = pack_indices(target, device)
    dtype = np.dtype(x.dtype)
    if isinstance(value, numbers.Number):
        source = fill(empty((), np.uint8 if dtype == BOOL else dtype, device),
                      bool(value) if dtype == BOOL else value)
    else:
        if is_device_array(value) and device != "cuda":
            raise ValueError(f"setitem: the value of shape {tuple(value.shape)} lives on cuda "
                             "and the tensor on the cpu; move it with .to('cpu')")
        source = value if is_device_array(value) else np.asarray(value)
        source = cast(to_device(source, device), dtype) if source.dtype != dtype else \
            to_device(source, device)
        source = as_bytes(source)
    try:
        np.broadcast_shapes(tuple(source.shape), target.shape)
        fits = np.broadcast_shapes(tuple(source.shape), target.shape) == target.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"setitem: a value of shape {tuple(source.shape)} cannot be broadcast "
                         f"to the selection's shape {target.shape}")
    meta = target.meta(broadcast_strides(tuple(source.shape), target.shape))
    run(SCATTER_SET, flat(source), indices, flat(as_bytes(x)), meta, target.rows)
