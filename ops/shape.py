"""Shape ops: reshape (a view: every array the engine makes is C-contiguous), 2-D transpose,
N-D permute, and ``Movement``, the base of every op that only moves elements.

A movement op takes every storage dtype, since labels and masks are reshaped, indexed and
joined like floats. Bool arrays reach its kernels as their uint8 bytes (the same memory):
the kernels never see a bool array, and the outputs are allocated as uint8 (poison mode
fills them with 255) and seen as bool again on the way out.
"""
import functools
import math

import numpy as np
from numba import njit
from numba import uint64 as U

from ops.cast import BOOL, as_bytes, same_memory_as
from ops.cuda import SIMULATOR, cuda
from ops.device import device_of
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, elements, threads_for
from ops.layout import coalesce, contiguous_strides, flat
from ops.registry import Op, register


class Movement(Op):
    """An op that moves elements without arithmetic: any one dtype, on one device."""

    def __call__(self, *inputs):
        arrays = [x for x in inputs if hasattr(x, "shape")]
        if len({device_of(x) for x in arrays}) > 1:
            shapes = ", ".join(f"{device_of(x)} {tuple(x.shape)}" for x in arrays)
            raise ValueError(f"{self.name}: inputs live on different devices ({shapes}); "
                             "move them with .to(device)")
        dtypes = {np.dtype(x.dtype) for x in arrays}
        if len(dtypes) > 1:
            names = ", ".join(str(np.dtype(x.dtype)) for x in arrays)
            raise TypeError(f"{self.name}: inputs have different dtypes ({names}); cast them "
                            "to one with .astype(dtype)")
        if dtypes != {BOOL}:
            self.check(*inputs)
            return self.forward(*inputs)
        inputs = tuple(as_bytes(x) if hasattr(x, "shape") else x for x in inputs)
        self.check(*inputs)
        return same_memory_as(self.forward(*inputs), BOOL)


def resolve_shape(shape, size, op_name="reshape"):
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"{op_name}: only one dimension can be -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or size % known:
            raise ValueError(f"{op_name}: cannot reshape {size} elements into {shape}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size or any(s < 0 for s in shape):
        raise ValueError(f"{op_name}: cannot reshape {size} elements into {shape}")
    return shape


@register
class ReshapeOp(Movement):
    """A view of the same memory: no kernel on either device."""
    name = "reshape"

    def onnx(self, graph, inputs):   # the shape the trace saw (the export's shapes are fixed)
        shape = graph.constant(np.array(graph.output_shape, np.int64), "reshape.shape")
        return graph.node("Reshape", [inputs[0], shape])
    is_view = True

    def check(self, x):
        self.shape = resolve_shape(self.params["shape"], x.size,
                                   self.params.get("op_name", "reshape"))

    def forward(self, x):
        self.x_shape = tuple(x.shape)
        return x.reshape(self.shape)

    def backward(self, grad_out, grad_dst):
        return (grad_out.reshape(self.x_shape),)


# ------------------------------------------------------------------ 2-D transpose

@njit(cache=True, error_model="numpy")
def transpose_cpu(x, out):
    rows, cols = x.shape
    for i in range(rows):
        for j in range(cols):
            out[j, i] = x[i, j]


@cuda.jit(cache=True)
def transpose_cuda(x, out):
    k = cuda.grid(1)
    rows, cols = x.shape
    if k < rows * cols:
        i = k // cols
        j = k - i * cols
        out[j, i] = x[i, j]


TRANSPOSE = Kernel("transpose", transpose_cpu, transpose_cuda, elements(0))


def transpose(x):
    return run(TRANSPOSE, x, Out((x.shape[1], x.shape[0]), x.dtype, flat=False))


@register
class Transpose(Movement):
    name = "transpose"
    kernels = (TRANSPOSE,)

    def check(self, x):
        if x.ndim != 2:
            raise ValueError(f"transpose: expects a 2-D input, got shape {tuple(x.shape)}")

    def forward(self, x):
        return transpose(x)

    def onnx(self, graph, inputs):
        return graph.node("Transpose", inputs, perm=[1, 0])

    def backward(self, grad_out, grad_dst):
        return (transpose(grad_out),)


# ------------------------------------------------------------------ N-D permute

def permute_cpu(x, out, meta):
    """Rows the input holds contiguously (the last output axis of stride 1, as the GPT's
    heads of 32): ``_permute_rows``; others: the compiled element loop."""
    ndim = meta[0]
    if ndim and meta[2 * ndim] == 1 and meta[ndim] >= CONTIGUOUS_ROW_MIN:
        _permute_rows(x, out, meta)
    else:
        _permute_elements(x, out, meta)


CONTIGUOUS_ROW_MIN = 8   # the rows a block copy pays for (shorter: the loop)


@njit(cache=True, nogil=True, error_model="numpy")
def _permute_rows(x, out, meta):
    """Each output row a copy between two 1-D slices (an index into a slice needs no sign
    test, so the copy vectorises); the rows of the next-to-last axis a stride apart, the
    axes before walked as an odometer. The GPT's attention permutes (one thread, float32):
    (12, 64, 3, 4, 32) -> (3, 12, 4, 64, 32) 41.6 us against 86.7 for NumPy's copy of the
    strided view (and 252 for the element loop, whose row of unknown stride LLVM cannot
    vectorise); (12, 4, 64, 32) -> (12, 64, 4, 32) 12.7 against 29.2."""
    ndim = meta[0]
    row = meta[ndim]
    rows, step = (meta[ndim - 1], meta[2 * ndim - 1]) if ndim > 1 else (1, 0)
    outer = out.size // (row * rows) if out.size else 0
    index = np.zeros(max(ndim - 2, 1), np.int64)
    offset = 0
    at = 0
    for _ in range(outer):
        start = offset
        for _ in range(rows):
            source, target = x[start:start + row], out[at:at + row]
            for c in range(row):
                target[c] = source[c]
            at += row
            start += step
        offset = _next_offset(index, meta, ndim - 2, offset)


@njit(cache=True, error_model="numpy")
def _permute_elements(x, out, meta):
    # rows of the last output axis, the others walked as an odometer: a stride added per
    # row instead of a division and a remainder per axis per element (the GPT's attention
    # permutes of 295k elements took 7.6 ms each the other way, 26 ns an element)
    ndim = meta[0]
    if out.size == 0:
        return
    if ndim == 0:   # a scalar
        out[0] = x[0]
        return
    row, row_stride = meta[ndim], meta[2 * ndim]
    index = np.zeros(max(ndim - 1, 1), np.int64)
    offset = 0
    for start in range(0, out.size, row):
        for j in range(row):
            out[start + j] = x[offset + j * row_stride]
        offset = _next_offset(index, meta, ndim - 1, offset)


@njit(inline="always")
def _next_offset(index, meta, axes, offset):
    """The odometer ``index`` over the first ``axes`` output axes advanced by one: the input
    offset of its next position (meta's shape and input strides)."""
    ndim = meta[0]
    for k in range(axes - 1, -1, -1):
        index[k] += 1
        offset += meta[1 + ndim + k]
        if index[k] < meta[1 + k]:
            return offset
        offset -= meta[1 + ndim + k] * meta[1 + k]
        index[k] = 0
    return offset


# Output elements a CUDA thread copies: the first one's input offset takes a division a dim,
# the next ones in its row a stride added; the arithmetic is unsigned (one division a dim,
# where a signed index took Python's floor division and remainder apiece, each with sign
# fix-ups and a 64-bit path). The GPT's 24 head permutes of a step took 6.74 ms of H200 time
# with a thread an element and signed offsets (PTX: 10 divisions and remainders an element).
PERMUTE_RUN = 4


@cuda.jit(device=True)
def _permute_offset(index, meta, ndim):
    """The input offset of output element ``index`` under permute's metadata (unsigned)."""
    offset = U(0)
    for j in range(ndim):
        k = ndim - U(1) - U(j)
        size = U(meta[U(1) + k])
        quotient = index // size
        offset += (index - quotient * size) * U(meta[U(1) + ndim + k])
        index = quotient
    return offset


@cuda.jit(device=True)
def _permute_run(x, out, meta, first, size):
    """Output elements ``first`` .. ``first + PERMUTE_RUN - 1`` (those below ``size``)."""
    ndim = U(meta[0])
    if ndim == U(0):   # a scalar
        out[0] = x[0]
        return
    row, row_stride = U(meta[ndim]), U(meta[ndim + ndim])
    column = first % row
    offset = _permute_offset(first, meta, ndim)
    for j in range(PERMUTE_RUN):
        i = first + U(j)
        if i < size:
            if j > 0:
                if column + U(1) < row:
                    column += U(1)
                    offset += row_stride
                else:   # the first element of the next row
                    column = U(0)
                    offset = _permute_offset(i, meta, ndim)
            out[i] = x[offset]


@cuda.jit(cache=True)
def permute_cuda(x, out, meta):
    first = U(cuda.grid(1)) * U(PERMUTE_RUN)
    if first < U(out.size):
        _permute_run(x, out, meta, first, U(out.size))


@functools.cache
def _permute_vectors_cuda():
    """``permute_cuda`` for float32 that copies a thread's 4 elements as one 16-byte load and
    store where they lie in one input row of stride 1, 16-byte aligned at both ends (the
    GPT's head permutes keep the head dim innermost), built on first use (``ops.cuda.ptx``
    is GPU code): a quarter of the loads and stores, and one offset computed a thread."""
    from ops.cuda import ptx
    assert PERMUTE_RUN == 4, "a thread's run is one 16-byte vector of float32"
    load_float4, store_float4, address_of = ptx.load_float4, ptx.store_float4, ptx.address_of

    @cuda.jit(cache=True)
    def permute_vectors_cuda(x, out, meta):
        first = U(cuda.grid(1)) * U(PERMUTE_RUN)
        size = U(out.size)
        if first >= size:
            return
        ndim = U(meta[0])
        if (ndim > U(0) and first + U(4) <= size and U(meta[ndim + ndim]) == U(1)
                and U(meta[ndim]) % U(4) == U(0) and address_of(x) % U(16) == U(0)
                and address_of(out) % U(16) == U(0)):
            offset = _permute_offset(first, meta, ndim)
            if offset % U(4) == U(0):
                x0, x1, x2, x3 = load_float4(x, offset)
                store_float4(out, first, x0, x1, x2, x3)
                return
        _permute_run(x, out, meta, first, size)
    return permute_vectors_cuda


def _permute_plan(args):
    x, out, _ = args
    kernel = (_permute_vectors_cuda() if not SIMULATOR and x.dtype == np.float32
              else permute_cuda)
    count = -(-out.size // PERMUTE_RUN)
    threads = threads_for(count)
    return ((kernel, -(-count // threads), threads, args),)


permute_cpu.__wrapped__ = _permute_elements   # the compiled kernel behind the CPU side
PERMUTE = Kernel("permute", permute_cpu, cuda_plan=_permute_plan)


def permute(x, axes):
    """A copy of ``x`` with its axes in the order ``axes`` (a permutation of range(ndim)).

    The metadata is ``[ndim, output shape, input strides in output order]``, coalesced: the
    CPU copies rows, a CUDA thread ``PERMUTE_RUN`` consecutive output elements."""
    out_shape = tuple(x.shape[a] for a in axes)
    strides = contiguous_strides(tuple(x.shape))
    shape, (in_strides,) = coalesce(out_shape, tuple(strides[a] for a in axes))
    return run(PERMUTE, flat(x), Out(out_shape, x.dtype), Meta((len(shape),) + shape + in_strides))


def normalize_permutation(axes, ndim, op_name):
    """``axes`` (ints, negative from the end) as a permutation of range(ndim), or ValueError."""
    if len(axes) != ndim or not all(isinstance(a, (int, np.integer)) for a in axes):
        raise ValueError(f"{op_name}: axes {tuple(axes)} are not a permutation of the "
                         f"{ndim} axes of the input")
    normalized = tuple(int(a) % ndim if -ndim <= a < ndim else None for a in axes)
    if None in normalized or sorted(normalized) != list(range(ndim)):
        raise ValueError(f"{op_name}: axes {tuple(axes)} are not a permutation of the "
                         f"{ndim} axes of the input")
    return normalized


@register
class Permute(Movement):
    name = "permute"

    def onnx(self, graph, inputs):
        axes = [int(axis) % len(graph.output_shape) for axis in self.params["axes"]]
        return graph.node("Transpose", inputs, perm=axes)
    kernels = (PERMUTE,)

    def check(self, x):
        self.axes = normalize_permutation(self.params["axes"], x.ndim, self.name)

    def forward(self, x):
        return permute(x, self.axes)

    def backward(self, grad_out, grad_dst):
        inverse = tuple(sorted(range(len(self.axes)), key=self.axes.__getitem__))
        return (permute(grad_out, inverse),)
