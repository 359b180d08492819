"""The one way CUDA kernels are launched.

A host NumPy array passed to a kernel is copied to the device and synchronised on every
launch (191 us measured on the H200), so the launch path refuses it. Shapes and strides
travel as one small int64 device array per distinct layout, made once and cached, because
every kernel argument costs 4-5 us of launch time.
"""
import math
from collections import OrderedDict

import numpy as np
from numba import config, cuda

from ops.device import SIMULATOR

THREADS_PER_BLOCK = 256
# Small models launch small grids on purpose (a 128x10 layer is 5 blocks): no warning for it.
config.CUDA_LOW_OCCUPANCY_WARNINGS = False
_META_CACHE_SIZE = 4096
_meta_cache = OrderedDict()


def launch(kernel, n_threads, *args, threads_per_block=THREADS_PER_BLOCK):
    """Run ``kernel`` over ``n_threads`` threads in 1-D blocks (nothing for zero threads)."""
    for position, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            name = getattr(getattr(kernel, "py_func", kernel), "__name__", "kernel")
            raise TypeError(
                f"{name}: argument {position} is a host NumPy array of shape {arg.shape}; "
                "CUDA kernels take device arrays only (move it with Tensor.to('cuda'))"
            )
    if n_threads <= 0:
        return
    if SIMULATOR:   # the simulator runs one OS thread per CUDA thread: start no idle ones
        threads_per_block = min(threads_per_block, n_threads)
    blocks = (n_threads + threads_per_block - 1) // threads_per_block
    kernel[blocks, threads_per_block](*args)


def launch_blocks(kernel, blocks, threads_per_block, *args):
    """Run ``kernel`` on an explicit grid (tree reductions: one block per output)."""
    launch(kernel, 0, *args)   # validates the arguments, launches nothing
    if (math.prod(blocks) if isinstance(blocks, tuple) else blocks) > 0:   # np.prod: +2.7 us
        kernel[blocks, threads_per_block](*args)


def device_meta(values):
    """A cached int64 device array holding ``values`` (shapes, strides, sizes of one launch)."""
    key = tuple(int(v) for v in values)
    meta = _meta_cache.get(key)
    if meta is None:
        meta = cuda.to_device(np.array(key if key else (0,), dtype=np.int64))
        _meta_cache[key] = meta
        if len(_meta_cache) > _META_CACHE_SIZE:
            _meta_cache.popitem(last=False)
    else:
        _meta_cache.move_to_end(key)
    return meta
