"""Finite-value check behind ``engine.detect_anomaly``.

Never compiled with ``fastmath``: that flag lets LLVM assume no NaN or Inf exists and would
fold this whole check to "all finite"."""
import math

import numpy as np
from numba import njit

from ops.cuda import cuda
from ops.device import device_of, to_host
from ops.launch import Kernel, elements
from ops.layout import flat
from ops.memory import empty


@njit(cache=True, fastmath=False, error_model="numpy")
def count_nonfinite_cpu(x, count):
    total = 0
    for i in range(x.size):
        if not math.isfinite(x[i]):
            total += 1
    count[0] = total


@cuda.jit(cache=True, fastmath=False)
def count_nonfinite_cuda(x, count):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        cuda.atomic.add(count, 0, 1)   # an integer count: the order of adds cannot change it


@njit(cache=True)
def zero_count_cpu(count):
    count[0] = 0


@cuda.jit(cache=True)
def zero_count_cuda(count):
    count[0] = 0


# the CUDA count starts at zero in a launch of its own: syncthreads orders one block only
ZERO_COUNT = Kernel("zero_count", zero_count_cpu, zero_count_cuda, elements(0))
COUNT_NONFINITE = Kernel("count_nonfinite", count_nonfinite_cpu, count_nonfinite_cuda,
                         elements(0))


def count_nonfinite(array):
    """How many elements of a float array are NaN or +-Inf (0 for integer arrays)."""
    if np.dtype(array.dtype).kind != "f" or array.size == 0:
        return 0
    count = empty(1, np.int64, device_of(array))
    ZERO_COUNT(count)
    COUNT_NONFINITE(flat(array), count)
    return int(to_host(count)[0])
