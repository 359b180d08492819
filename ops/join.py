"""Concatenation along an axis (``engine.cat``; ``engine.stack`` is a cat of unsqueezed views).

Around the axis an input is ``(outer, n_i * inner)`` rows and the output
``(outer, sum n_i * inner)``, so each input is one block of the output's rows: one launch per
input copies it there (``copy_block``), and the backward copies the same blocks out of the
gradient. Every output element belongs to exactly one input's block, so the output is fully
written.
"""
import math

from numba import njit

from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel
from ops.layout import flat, normalize_axes
from ops.registry import register
from ops.shape import Movement


def _copy_block(j, source, destination, meta):
    """Element ``j`` of a block ``[rows, width, source row length, source start, destination
    row length, destination start]``."""
    width = meta[1]
    row = j // width
    column = j - row * width
    destination[row * meta[4] + meta[5] + column] = source[row * meta[2] + meta[3] + column]


_copy_block_cpu = njit(inline="always", error_model="numpy")(_copy_block)
_copy_block_cuda = cuda.jit(device=True)(_copy_block)


@njit(cache=True, error_model="numpy")
def copy_block_cpu(source, destination, meta):
    for j in range(meta[0] * meta[1]):
        _copy_block_cpu(j, source, destination, meta)


@cuda.jit(cache=True)
def copy_block_cuda(source, destination, meta):
    j = cuda.grid(1)
    if j < meta[0] * meta[1]:
        _copy_block_cuda(j, source, destination, meta)


def _block_elements(source, destination, meta):
    return min(source.size, destination.size)   # the block is the smaller side, whole


COPY_BLOCK = Kernel("copy_block", copy_block_cpu, copy_block_cuda, _block_elements)


@register
class Cat(Movement):
    """The inputs joined along ``params["axis"]`` (their other dims equal)."""
    name = "cat"
    kernels = (COPY_BLOCK,)

    def check(self, *inputs):
        if not inputs:
            raise ValueError("cat: needs at least one tensor")
        first = inputs[0]
        if first.ndim == 0:
            raise ValueError("cat: 0-d tensors have no axis to join along; stack them instead")
        (self.axis,) = normalize_axes(self.params.get("axis", 0), first.ndim, self.name)
        for k, x in enumerate(inputs):
            if x.ndim != first.ndim or any(
                    x.shape[i] != first.shape[i] for i in range(x.ndim) if i != self.axis):
                shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
                raise ValueError(f"cat: tensor {k} does not fit along axis {self.axis}: the "
                                 f"shapes ({shapes}) must be equal except on that axis")

    def onnx(self, graph, inputs):
        return graph.node("Concat", inputs, axis=int(self.axis))

    def forward(self, *inputs):
        first, axis = inputs[0], self.axis
        self.lengths = [x.shape[axis] for x in inputs]
        shape = first.shape[:axis] + (sum(self.lengths),) + first.shape[axis + 1:]
        self.outer = math.prod(first.shape[:axis])
        self.inner = math.prod(first.shape[axis + 1:])
        out = Out(shape, first.dtype)
        for x, meta in zip(inputs, self._blocks(to_output=True)):
            run(COPY_BLOCK, flat(x), out, meta)
        return out.array

    def backward(self, grad_out, grad_dst):
        return tuple(
            run(COPY_BLOCK, flat(grad_out), Out(self._shape_of(k, grad_out), grad_out.dtype),
                meta) if needed else None
            for k, (needed, meta) in enumerate(zip(self.needs_input_grad,
                                                   self._blocks(to_output=False))))

    def _blocks(self, to_output):
        """Per input, the block metadata copying it into the output (or back out of it)."""
        total = sum(self.lengths) * self.inner
        start = 0
        for length in self.lengths:
            width = length * self.inner
            if to_output:
                yield Meta((self.outer, width, width, 0, total, start))
            else:
                yield Meta((self.outer, width, total, start, width, 0))
            start += width

    def _shape_of(self, k, grad_out):
        shape = list(grad_out.shape)
        shape[self.axis] = self.lengths[k]
        return tuple(shape)
