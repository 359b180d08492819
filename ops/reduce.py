"""Reductions: sum, mean, max and min over no axis, one axis or several, with keepdims
(argmax and argmin, the positions of the extrema: ``ops.arg_extrema``).

The input's dims are split into kept dims (one output element per combination) and reduced
dims, described by ``ops.layout.reduction_layout``. Accumulation is in float64 on both
devices. A single reduced dim after coalescing (trailing axes, ``axis=None``, one column
axis) is read as ``base + r * stride``, without per-element index arithmetic. On the CPU each
output folds its run in order; where the runs stride across the outputs (a leading axis) the
runs' r-th elements are folded together, reading memory as it lies, in the same order.

On the GPU a block of ``REDUCE_THREADS`` threads reduces one output element in a fixed order
(strided per-thread folds, then ``block_reduce_cuda``) where the outputs are many; where they
are very many and their runs short, a thread folds each output's run in order (the CPU's
order and bits: ``THREAD_RUNS_MIN_OUTPUTS``). Where they
are few and their runs long (a whole-array sum is one output), each run is split into chunks
(``chunking``): a first launch gives every (output, chunk) a block that writes one float64
partial into a scratch buffer from the caching allocator, a second folds each output's
partials in chunk order with one block per output. Every order is fixed by the shapes alone,
so results are reproducible bit for bit run to run: no float atomics.

Min is the max of ``-x``, negated: the block reduction has one extremum, and negation is
exact. Backward: sum and mean broadcast ``grad_out`` back over the reduced dims (``expand``,
one thread per input element, scaled by 1/count for the mean; reduced dims all of size 1 give
the same-shape layout, element ``i`` from element ``i``); max and min route
``grad_out`` to the extrema of each group, split evenly among ties.
"""
import functools
import math

import numpy as np
from numba import njit

from ops import cuda as cuda_runtime
from ops.block_reduce import (MAX, REDUCE_THREADS, SUM, block_reduce_cuda, combine_cpu,
                               combine_cuda)
from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, elements, threads_for
from ops.layout import (broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda,
                        device_meta, flat, normalize_axes, offset_cpu, offset_cuda,
                        reduced_shape, reduction_layout)
from ops.memory import empty
from ops.registry import Op, register
from ops.twin import twin

MIN = 2   # beside ops.block_reduce's SUM and MAX: reduced as MAX of -x

# Few outputs over long runs (a whole-array sum, a column of a tall matrix): a block per chunk
# of each output's run, then a fold of the chunks' partials. A chunk gives each thread at
# least 8 elements to fold (2048 on the GPU, 64 in the simulator, whose blocks have 8
# threads); 4 blocks per multiprocessor keep the whole GPU reading. Both are the design's
# first guess, not yet measured: bench.ops's 1024x1024 sum row is the measurement to take.
CHUNK_MIN = 8 * REDUCE_THREADS
BLOCKS_PER_MULTIPROCESSOR = 4
_multiprocessors = functools.cache(cuda_runtime.multiprocessor_count)
# Many outputs over short runs (a sum over a leading axis: the GPT's position embedding
# gradient, 64 x 98304 -> 98304) take a thread per output, which folds its run in order as
# the CPU does: a block per output left most of its threads idle (64 elements for 256) and
# took 419 us there on an H100
THREAD_RUNS_MIN_OUTPUTS = 16 * REDUCE_THREADS


def chunking(outputs, n_reduced):
    """``(chunks, chunk_length)``: each output's run of ``n_reduced`` elements split into
    ``chunks`` chunks of ``chunk_length`` (the last takes the rest, none is empty), enough
    blocks to give every multiprocessor ``BLOCKS_PER_MULTIPROCESSOR`` of them, no chunk
    shorter than ``CHUNK_MIN``. One chunk (a block per output, no second pass) where the
    outputs alone fill the GPU or the runs are short."""
    if outputs == 0 or n_reduced < 2 * CHUNK_MIN:
        return 1, max(n_reduced, 1)
    wanted = -(-BLOCKS_PER_MULTIPROCESSOR * _multiprocessors() // outputs)
    chunks = min(wanted, n_reduced // CHUNK_MIN)
    chunk_length = -(-n_reduced // chunks)
    return -(-n_reduced // chunk_length), chunk_length


def run_shape(x, out):
    """``(outputs, n_reduced)`` of a reduction of ``x`` into ``out``."""
    return out.size, (x.size // out.size if out.size else 0)


@cuda.jit(device=True)
def block_chunk_cuda(b, meta, chunk_length):
    """``(first, stop, base)`` of block ``b`` of a chunked reduction (``chunking``): it takes
    reduced elements ``first`` to ``stop`` of output ``b // chunks``, whose kept-dim offset
    is ``base``."""
    n_reduced, kept_dims = meta[0], meta[1]
    chunks = max(1, (n_reduced + chunk_length - 1) // chunk_length)
    o = b // chunks
    first = (b - o * chunks) * chunk_length
    return first, min(first + chunk_length, n_reduced), offset_cuda(o, meta, 3, kept_dims)


def _run_total_with(offset, combine):
    def run_total(x, meta, base, stride, fold, sign, start):
        """The reduced run from ``base`` folded in order from ``start`` (``sign · x`` in
        float64): its elements ``stride`` apart, or (stride 0) at the reduced dims' offsets.
        ``float()``: the simulator would otherwise add float32 elements in float32 (NumPy's
        scalar rules), where the compiled kernels add in float64."""
        n_reduced, reduced_dims, reduced_first = meta[0], meta[2], 3 + 2 * meta[1]
        acc = start
        for r in range(n_reduced):
            at = base + r * stride if stride else base + offset(r, meta, reduced_first,
                                                                reduced_dims)
            acc = combine(fold, acc, sign * float(x[at]))
        return acc
    return run_total


_run_total_cpu, _run_total_cuda = twin(_run_total_with, (offset_cpu, offset_cuda),
                                       (combine_cpu, combine_cuda))


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
        # one strided reduced run per output (contiguous for trailing axes and axis=None):
        # no index arithmetic per element
        stride = meta[reduced_first + 1] if reduced_dims == 1 else 0
        if reduced_dims == 1 and stride != 1 and out.size > 1:
            # runs strided across the outputs (a sum over a leading axis): the runs' r-th
            # elements together, each output's run still in order (the same bits), reading
            # memory as it lies; output by output the 64 x 98304 -> 98304 sum took 40.9 ms
            # on the 2-core Xeon, NumPy's float64 sum 4.3
            totals = np.full(out.size, start)
            if kept_dims == 1:   # the outputs one strided run too: no table of their offsets
                step = meta[4]
                for r in range(n_reduced):
                    row = x[r * stride:]
                    for o in range(out.size):
                        totals[o] = combine_cpu(fold, totals[o], sign * row[o * step])
            else:
                bases = np.empty(out.size, np.int64)
                for o in range(out.size):
                    bases[o] = offset_cpu(o, meta, 3, kept_dims)
                for r in range(n_reduced):
                    for o in range(out.size):
                        totals[o] = combine_cpu(fold, totals[o],
                                                sign * x[bases[o] + r * stride])
            for o in range(out.size):
                out[o] = sign * totals[o] * scale
            return
        for o in range(out.size):
            out[o] = sign * _run_total_cpu(x, meta, offset_cpu(o, meta, 3, kept_dims), stride,
                                           fold, sign, start) * scale

    @cuda.jit(cache=True)
    def reduce_cuda(x, out, meta, scale, chunk_length):
        """Block b folds chunk ``b % chunks`` (``chunk_length`` reduced elements) of output
        ``b // chunks`` into ``out[b]``: the outputs themselves when there is one chunk per
        output, else the partials that a second launch of this kernel folds."""
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        reduced_dims, reduced_first = meta[2], 3 + 2 * meta[1]
        first, stop, base = block_chunk_cuda(b, meta, chunk_length)
        acc = start
        # float(): the simulator would otherwise add float32 elements in float32 (NumPy's
        # scalar rules), where the compiled kernel adds in float64
        if reduced_dims == 1:   # one strided run: consecutive threads read consecutive elements
            stride = meta[reduced_first + 1]
            for r in range(first + t, stop, REDUCE_THREADS):
                acc = combine_cuda(fold, acc, sign * float(x[base + r * stride]))
        else:
            for r in range(first + t, stop, REDUCE_THREADS):
                at = base + offset_cuda(r, meta, reduced_first, reduced_dims)
                acc = combine_cuda(fold, acc, sign * float(x[at]))
        total = block_reduce_cuda(fold, acc)
        if t == 0:
            out[b] = sign * total * scale

    @cuda.jit(cache=True)
    def reduce_runs_cuda(x, out, meta, scale):
        """Thread o folds output o's run in order, as the CPU kernel does (the same bits)."""
        o = cuda.grid(1)
        if o < out.size:
            kept_dims = meta[1]
            stride = meta[4 + 2 * kept_dims] if meta[2] == 1 else 0
            out[o] = sign * _run_total_cuda(x, meta, offset_cuda(o, meta, 3, kept_dims),
                                            stride, fold, sign, start) * scale

    def cuda_plan(args):
        x, out, meta, scale = args
        outputs, n_reduced = run_shape(x, out)
        if outputs >= THREAD_RUNS_MIN_OUTPUTS and n_reduced < CHUNK_MIN:
            threads = threads_for(outputs)
            return ((reduce_runs_cuda, -(-outputs // threads), threads, (x, out, meta, scale)),)
        chunks, chunk_length = chunking(outputs, n_reduced)
        if chunks == 1:
            return ((reduce_cuda, outputs, REDUCE_THREADS, (x, out, meta, scale, chunk_length)),)
        # the partials of max and min hold each chunk's extremum, so the second pass is the
        # same reduction over them (min: the max of their negatives, negated)
        partials = empty(outputs * chunks, np.float64, "cuda")
        fold_meta = device_meta(reduction_layout((outputs, chunks), (1,)))
        return ((reduce_cuda, outputs * chunks, REDUCE_THREADS,
                 (x, partials, meta, 1.0, chunk_length)),
                (reduce_cuda, outputs, REDUCE_THREADS, (partials, out, fold_meta, scale, chunks)))

    return Kernel(name, reduce_cpu, cuda_plan=cuda_plan)


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


def _route_to_extrema_with(offset):
    def route_to_extrema(o, x, y, grad_out, grad_in, meta):
        """grad_in over output ``o``'s reduced group = grad_out[o] on its extrema ``y[o]``
        (split evenly among ties), else 0."""
        n_reduced, kept_dims, reduced_dims = meta[0], meta[1], meta[2]
        reduced_first = 3 + 2 * kept_dims
        base = offset(o, meta, 3, kept_dims)
        ties = 0
        for r in range(n_reduced):
            if x[base + offset(r, meta, reduced_first, reduced_dims)] == y[o]:
                ties += 1
        share = grad_out[o] / max(ties, 1)
        for r in range(n_reduced):
            at = base + offset(r, meta, reduced_first, reduced_dims)
            grad_in[at] = share if x[at] == y[o] else share - share
    return route_to_extrema


_route_to_extrema_cpu, _route_to_extrema_cuda = twin(_route_to_extrema_with,
                                                     (offset_cpu, offset_cuda))


@njit(cache=True, error_model="numpy")
def max_backward_cpu(x, y, grad_out, grad_in, meta):
    """The backward of max and of min: grad_out routed to each group's extrema."""
    for o in range(y.size):
        _route_to_extrema_cpu(o, x, y, grad_out, grad_in, meta)


@cuda.jit(cache=True)
def max_backward_cuda(x, y, grad_out, grad_in, meta):
    o = cuda.grid(1)
    if o < y.size:
        _route_to_extrema_cuda(o, x, y, grad_out, grad_in, meta)


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

    # ONNX's reductions: ReduceSum takes its axes as an input from opset 13, the others from 18
    ONNX_REDUCE = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax",
                   "min": "ReduceMin"}

    def onnx(self, graph, inputs):
        operator = self.ONNX_REDUCE.get(self.name)
        if operator is None:
            graph.refuse(f"{self.name} has no ONNX reduction")
        axes, keepdims = [int(axis) for axis in self.axes], int(bool(self.keepdims))
        if operator == "ReduceSum" or graph.opset >= 18:
            return graph.node(operator, [inputs[0], graph.constant(np.array(axes, np.int64),
                                                                   "reduce.axes")],
                              keepdims=keepdims)
        return graph.node(operator, inputs, axes=axes, keepdims=keepdims)


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
