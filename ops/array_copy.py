"""Copying one array into another of the same device, as a kernel pair.

A copy made by ``memcpy`` (NumPy's ``copyto``, a device-to-device ``copy_to_device``) runs no
kernel, so a captured step (``engine.capture``) would not record it and its replays would
skip it. The engine's same-device copies (``to_device``, gradient slots) run this kernel
instead; copies between the host and the device are refused inside a recording.
"""
from numba import njit

from ops.cuda_backend import cuda
from ops.launch import CPU_KERNEL, Kernel, elements


@njit(**CPU_KERNEL)
def copy_cpu(source, destination):
    for i in range(destination.size):
        destination[i] = source[i]


@cuda.jit(cache=True)
def copy_cuda(source, destination):
    i = cuda.grid(1)
    if i < destination.size:
        destination[i] = source[i]


COPY = Kernel("copy", copy_cpu, copy_cuda, elements(1))


def copy_array(destination, source):
    """Copy ``source`` into ``destination``: C-contiguous, one device, one size and dtype."""
    COPY(source.reshape(source.size), destination.reshape(destination.size))
    return destination
