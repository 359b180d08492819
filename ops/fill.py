"""Filling a buffer with one value: poison mode, ``ones`` and the root gradient of backward."""
from numba import njit

from ops.cuda import cuda
from ops.launch import CPU_KERNEL, Kernel, elements


@njit(**CPU_KERNEL, error_model="numpy")
def fill_cpu(out, value):
    for i in range(out.size):
        out[i] = value


@cuda.jit(cache=True)
def fill_cuda(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


FILL = Kernel("fill", fill_cpu, fill_cuda, elements(0))


def fill(out, value):
    """Set every element of ``out`` (any shape, C-contiguous) to ``value``; returns ``out``."""
    FILL(out.reshape(out.size), out.dtype.type(value))
    return out
