"""Step counters on the device: the per-step state a captured step advances itself.

A replayed CUDA graph runs the kernels it recorded with the arguments it recorded, so a
value that changes every step (an optimizer's step count, the loader's batch position, a
dropout seed's step) cannot be a kernel argument: it lives in a one-element int64 array on
the step's device, the kernels that need it read it there, and one single-thread kernel
(``advance``) moves it on, in the same stream order as the kernels around it. The eager
step runs the same kernels, so eager and replayed steps compute the same values.
"""
import numpy as np
from numba import njit

from ops.cuda_backend import cuda
from ops.fill import fill
from ops.launch import Kernel
from ops.memory import empty


@njit(cache=True)
def advance_cpu(counter, amount):
    counter[0] += amount


@cuda.jit(cache=True)
def advance_cuda(counter, amount):
    if cuda.grid(1) == 0:
        counter[0] += amount


ADVANCE = Kernel("advance_counter", advance_cpu, advance_cuda, lambda *args: 1)


def new_counter(device, value=0):
    """A one-element int64 counter on ``device`` holding ``value``."""
    return fill(empty(1, np.int64, device), value)


def advance(counter, amount=1):
    """Add ``amount`` to ``counter`` on its device (one launch, no host sync)."""
    ADVANCE(counter, int(amount))


def set_counter(counter, value):
    """Write ``value`` into ``counter`` on its device, after the kernels launched before."""
    fill(counter, value)
