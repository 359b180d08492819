"""Device memory: uninitialised allocation, the CUDA caching allocator and poison mode.

Every CUDA allocation of the process goes through the caching allocator of ``ops.cuda.pool``
(set ``ENGINE_CUDA_POOL=0`` to use Numba's own).

Poison mode fills every allocation with NaN (integers with their maximum value). A kernel
that forgets to write part of its output then produces NaN that the tests see.
"""
import os

import numpy as np

from ops import cuda as cuda_runtime
from ops.cuda import SIMULATOR
from ops.fill import fill

_poison = os.environ.get("ENGINE_POISON", "0") not in ("", "0")


def set_poison(enabled):
    global _poison
    _poison = bool(enabled)


def poison_enabled():
    return _poison


def _poison_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return True
    return np.nan if dtype.kind == "f" else np.iinfo(dtype).max


def shares_memory(a, b):
    """True when arrays ``a`` and ``b`` (host or device) occupy overlapping bytes: a view
    and its base, two views of one buffer that overlap. Arrays on different devices never
    do."""
    if type(a) is np.ndarray or type(b) is np.ndarray:
        return type(a) is type(b) and np.may_share_memory(a, b)
    return cuda_runtime.device_arrays_overlap(a, b)


def empty(shape, dtype, device):
    """An uninitialised C-contiguous array (NaN-filled in poison mode)."""
    if device == "cuda":
        out = cuda_runtime.device_empty(shape, dtype)
        if _poison and out.size:
            fill(out, _poison_value(dtype))
        return out
    out = np.empty(shape, dtype)
    if _poison:
        out.fill(_poison_value(dtype))
    return out


# ---------------------------------------------------------------- caching allocator

_POOL_ENABLED = not SIMULATOR and os.environ.get("ENGINE_CUDA_POOL", "1") != "0"


def _install_caching_allocator():
    from ops.cuda import CachingMemoryManager
    cuda_runtime.install_memory_manager(CachingMemoryManager)


if _POOL_ENABLED:   # the simulator has no memory manager to replace
    cuda_runtime.when_numba_cuda_imported(_install_caching_allocator)   # before any context


def allocator_stats():
    """``{"driver_allocations", "cached_bytes"}`` of the current CUDA context (zeros without one)."""
    if not _POOL_ENABLED or not cuda_runtime.gpu_usable():
        return {"driver_allocations": 0, "cached_bytes": 0}
    manager = cuda_runtime.current_memory_manager()
    return {"driver_allocations": manager.driver_allocations, "cached_bytes": manager.cached_bytes}


def empty_cache():
    """Return every cached CUDA block to the driver."""
    if _POOL_ENABLED:
        cuda_runtime.current_memory_manager().empty_cache()
