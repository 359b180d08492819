"""Argmax and argmin: the int64 position of the extremum over no axis (the flattened input)
or one, with keepdims; never differentiated. They read the input as ``ops.reduce``'s
reductions do (``ops.layout.reduction_layout``) and split few, long runs into the same chunks
(``ops.reduce.chunking``).

Argmax and argmin give the first position of the extremum, NaN counting as the extremum (as
NumPy and torch). On the GPU each thread keeps the first extremum of its strided share; two
passes of the block reduction then give the extremum and the smallest position holding it.
Chunked, each chunk's block writes that extremum and position, and the fold keeps the first
chunk holding the overall extremum.
"""
import math

import numpy as np
from numba import njit

from ops.block_reduce import MAX, REDUCE_THREADS, block_reduce_cuda
from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel
from ops.layout import (flat, normalize_axes, offset_cpu, offset_cuda, reduced_shape,
                        reduction_layout)
from ops.memory import empty
from ops.reduce import block_chunk_cuda, chunking, run_shape
from ops.registry import Op, register

ARGMAX, ARGMIN = 0, 1


def _beats(code, value, best):
    """True when ``value`` displaces ``best`` as the extremum seen so far: strictly larger
    (smaller) values, and the first NaN, which nothing displaces."""
    if value != value:
        return best == best
    return value > best if code == ARGMAX else value < best


_beats_cpu = njit(inline="always", error_model="numpy")(_beats)
_beats_cuda = cuda.jit(device=True)(_beats)


@cuda.jit(device=True)
def _first_holder_cuda(value, position):
    """``(top, first)``: the largest ``value`` over the block's threads (NaN the largest) and
    the smallest ``position`` among the threads holding it; a thread with ``position < 0``
    holds nothing."""
    mine = value if position >= 0 else -math.inf
    top = block_reduce_cuda(MAX, mine)
    holds_top = position >= 0 and (mine == top or (mine != mine and top != top))
    # the smallest position holding the extremum, as the largest of -position
    first = block_reduce_cuda(MAX, -float(position) if holds_top else -math.inf)
    return top, int(-first)


@cuda.jit(cache=True)
def arg_fold_cuda(extrema, positions, out, chunks):
    """Output o's position from the ``chunks`` partials of its chunks, in chunk order: the
    first chunk holding the largest signed extremum (NaN the largest)."""
    o = cuda.blockIdx.x
    t = cuda.threadIdx.x
    best = -math.inf
    best_at = -1
    for c in range(t, chunks, REDUCE_THREADS):   # ascending positions: a thread keeps its first
        value = extrema[o * chunks + c]
        if best_at < 0 or _beats_cuda(ARGMAX, value, best):
            best = value
            best_at = positions[o * chunks + c]
    _, first = _first_holder_cuda(best, best_at)
    if t == 0:
        out[o] = first


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
    def arg_cuda(x, out, meta, chunk_length, extrema):
        """Block b takes chunk ``b % chunks`` of output ``b // chunks`` (as ``reduce_cuda``):
        ``out[b]`` gets the first position of the chunk's extremum and, when ``extrema`` is
        not empty (partials for ``arg_fold_cuda``), ``extrema[b]`` that extremum, signed so
        that the largest wins."""
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        reduced_dims, reduced_first = meta[2], 3 + 2 * meta[1]
        first, stop, base = block_chunk_cuda(b, meta, chunk_length)
        stride = meta[reduced_first + 1] if reduced_dims == 1 else 0
        best = 0.0
        best_at = -1   # this thread's share may be empty
        for r in range(first + t, stop, REDUCE_THREADS):
            if reduced_dims == 1:   # one strided run: no index arithmetic per element
                value = x[base + r * stride]
            else:
                value = x[base + offset_cuda(r, meta, reduced_first, reduced_dims)]
            if best_at < 0 or _beats_cuda(code, value, best):
                best = value
                best_at = r
        top, first_at = _first_holder_cuda(sign * best, best_at)
        if t == 0:
            out[b] = first_at
            if extrema.size:
                extrema[b] = top

    def cuda_plan(args):
        x, out, meta = args
        outputs, n_reduced = run_shape(x, out)
        chunks, chunk_length = chunking(outputs, n_reduced)
        if chunks == 1:
            return ((arg_cuda, outputs, REDUCE_THREADS,
                     (x, out, meta, chunk_length, empty(0, np.float64, "cuda"))),)
        positions = empty(outputs * chunks, np.int64, "cuda")
        extrema = empty(outputs * chunks, np.float64, "cuda")
        return ((arg_cuda, outputs * chunks, REDUCE_THREADS,
                 (x, positions, meta, chunk_length, extrema)),
                (arg_fold_cuda, outputs, REDUCE_THREADS, (extrema, positions, out, chunks)))

    return Kernel(name, arg_cpu, cuda_plan=cuda_plan)


ARG = {ARGMAX: _arg_kernel(ARGMAX, "argmax"), ARGMIN: _arg_kernel(ARGMIN, "argmin")}


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
