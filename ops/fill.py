"""Filling a buffer with one value: poison mode, ``ones`` and the root gradient of backward."""
from numba import cuda, njit

from ops.device import device_of
from ops.launch import run_kernel


@njit(cache=True, error_model="numpy")
def fill_cpu(out, value):
    for i in range(out.size):
        out[i] = value


@cuda.jit(cache=True)
def fill_cuda(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value


def fill(out, value):
    """Set every element of ``out`` (any shape, C-contiguous) to ``value``; returns ``out``."""
    flat = out.reshape(out.size)
    value = out.dtype.type(value)
    run_kernel(device_of(out), fill_cpu, fill_cuda, out.size, flat, value)
    return out
