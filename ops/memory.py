"""Device memory: uninitialised allocation, the CUDA caching allocator and poison mode.

Every CUDA allocation of the process goes through the caching allocator of ``ops.cuda_pool``
(set ``ENGINE_CUDA_POOL=0`` to use Numba's own).

Poison mode fills every allocation with NaN (integers with their maximum value). A kernel
that forgets to write part of its output then produces NaN that the tests see.
"""
import math
import os
import threading

import numpy as np
from numba import cuda

from ops.device import SIMULATOR

_poison = os.environ.get("ENGINE_POISON", "0") not in ("", "0")


def set_poison(enabled):
    global _poison
    _poison = bool(enabled)


def poison_enabled():
    return _poison


def _poison_value(dtype):
    dtype = np.dtype(dtype)
    return np.nan if dtype.kind == "f" else np.iinfo(dtype).max


def empty(shape, dtype, device):
    """An uninitialised C-contiguous array (NaN-filled in poison mode)."""
    if device == "cuda":
        out = _device_empty(shape, dtype)
        if _poison and out.size:
            from ops.fill import fill

            fill(out, _poison_value(dtype))
        return out
    out = np.empty(shape, dtype)
    if _poison:
        out.fill(_poison_value(dtype))
    return out


_thread = threading.local()


def _device_empty(shape, dtype):
    """``cuda.device_array`` without its per-call context lookup (a third of an allocation's
    Python time on the H200): the context is looked up once per thread."""
    if SIMULATOR:
        return cuda.device_array(shape, dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    if size == 0:
        return cuda.device_array(shape, dtype)
    context = getattr(_thread, "context", None)
    if context is None:
        context = _thread.context = cuda.current_context()
    strides, step = [], dtype.itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return cuda.devicearray.DeviceNDArray(shape, tuple(reversed(strides)), dtype,
                                          gpu_data=context.memalloc(size * dtype.itemsize))


# ---------------------------------------------------------------- caching allocator

_POOL_ENABLED = not SIMULATOR and os.environ.get("ENGINE_CUDA_POOL", "1") != "0"
if _POOL_ENABLED:   # the simulator has no memory manager to replace
    from ops.cuda_pool import CachingMemoryManager
    cuda.set_memory_manager(CachingMemoryManager)


def allocator_stats():
    """``{"driver_allocations", "cached_bytes"}`` of the current CUDA context (zeros without one)."""
    from ops.device import cuda_available
    if not _POOL_ENABLED or not cuda_available():
        return {"driver_allocations": 0, "cached_bytes": 0}
    manager = cuda.current_context().memory_manager
    return {"driver_allocations": manager.driver_allocations, "cached_bytes": manager.cached_bytes}


def empty_cache():
    """Return every cached CUDA block to the driver."""
    if _POOL_ENABLED:
        cuda.current_context().memory_manager.empty_cache()
