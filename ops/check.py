"""Finite-value check behind ``engine.detect_anomaly``.

Never compiled with ``fastmath``: that flag lets LLVM assume no NaN or Inf exists and would
fold this whole check to "all finite"."""
import math

import numpy as np
from numba import cuda, njit

from ops.device import device_of
from ops.launch import launch
from ops.layout import flat
from ops.memory import empty


@njit(cache=True, fastmath=False, error_model="numpy")
def count_nonfinite_cpu(x):
    count = 0
    for i in range(x.size):
        if not math.isfinite(x[i]):
            count += 1
    return count


@cuda.jit(cache=True, fastmath=False)
def zero_count_cuda(count):
    count[0] = 0


@cuda.jit(cache=True, fastmath=False)
def count_nonfinite_cuda(x, count):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        cuda.atomic.add(count, 0, 1)   # an integer count: the order of adds cannot change it


def count_nonfinite(array):
    """How many elements of a float array are NaN or +-Inf (0 for integer arrays)."""
    if np.dtype(array.dtype).kind != "f" or array.size == 0:
        return 0
    if device_of(array) == "cuda":
        count = empty(1, np.int64, "cuda")
        launch(zero_count_cuda, 1, count)   # its own launch: syncthreads orders one block only
        launch(count_nonfinite_cuda, array.size, flat(array), count)
        return int(count.copy_to_host()[0])
    return int(count_nonfinite_cpu(flat(array)))
