"""The one way CUDA kernels are launched.

A host NumPy array passed to a kernel is copied to the device and synchronised on every
launch (191 us measured on the H200), so the launch path refuses it. Shapes and strides
travel as one small int64 device array per distinct layout, made once and cached, because
every kernel argument costs 4-5 us of launch time.
"""
import ctypes
import math
import threading
from collections import OrderedDict

import numpy as np
from numba import config, cuda
from numba.cuda.cudadrv.devicearray import is_cuda_ndarray

from ops.device import SIMULATOR

if not SIMULATOR:
    from cuda.core import LaunchConfig
    from cuda.core import launch as _core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream

THREADS_PER_BLOCK = 256
# Small models launch small grids on purpose (a 128x10 layer is 5 blocks): no warning for it.
config.CUDA_LOW_OCCUPANCY_WARNINGS = False
_META_CACHE_SIZE = 4096
_meta_cache = OrderedDict()


def launch(kernel, n_threads, *args, threads_per_block=THREADS_PER_BLOCK):
    """Run ``kernel`` over ``n_threads`` threads in 1-D blocks (nothing for zero threads)."""
    if n_threads <= 0:
        _refuse_host_arrays(kernel, args)
        return
    if SIMULATOR:   # the simulator runs one OS thread per CUDA thread: start no idle ones
        threads_per_block = min(threads_per_block, n_threads)
    blocks = (n_threads + threads_per_block - 1) // threads_per_block
    _run(kernel, blocks, threads_per_block, args)


def run_kernel(device, cpu_kernel, cuda_kernel, n_threads, *args):
    """The op contract's twin kernels take the same arguments: call the CPU one, or launch the
    CUDA one over ``n_threads`` threads."""
    if device == "cuda":
        launch(cuda_kernel, n_threads, *args)
    else:
        cpu_kernel(*args)


def launch_blocks(kernel, blocks, threads_per_block, *args):
    """Run ``kernel`` on an explicit grid (tree reductions: one block per output)."""
    if (math.prod(blocks) if isinstance(blocks, tuple) else blocks) > 0:   # np.prod: +2.7 us
        _run(kernel, blocks, threads_per_block, args)
    else:
        _refuse_host_arrays(kernel, args)


def _refuse_host_arrays(kernel, args):
    for position, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            name = getattr(getattr(kernel, "py_func", kernel), "__name__", "kernel")
            raise TypeError(
                f"{name}: argument {position} is a host NumPy array of shape {arg.shape}; "
                "CUDA kernels take device arrays only (move it with Tensor.to('cuda'))"
            )


# ------------------------------------------------------------------ the fast path
#
# Numba's own launch re-types every argument, wraps each array for the CUDA Array Interface
# and looks the context up again: 60% of a ~34 us launch on the H200 profile, more than the
# kernels of a small MLP take. After Numba has compiled and run a kernel once for a
# signature, later launches with that signature build the parameter list themselves (the
# same layout Numba passes: meminfo, parent, size, itemsize, data, shape, strides per array)
# and call cuda.core's launch directly.

_ARRAY, _INT, _FLOAT64, _FLOAT32, _BOOL = range(5)
_SCALAR_KINDS = {int: _INT, np.int64: _INT, float: _FLOAT64, np.float64: _FLOAT64,
                 np.float32: _FLOAT32, bool: _BOOL, np.bool_: _BOOL}
_compiled = {}            # (kernel, signature) -> cuda.core kernel, or None: always via Numba
_configs = {}
_thread = threading.local()


def _signature(args):
    """A hashable key of the argument types, or None when only Numba's path can take them."""
    key = []
    for arg in args:
        if is_cuda_ndarray(arg):
            if not arg.is_c_contiguous():
                return None
            key.append((arg.dtype, arg.ndim))
        elif type(arg) in _SCALAR_KINDS:
            key.append(type(arg))
        else:
            return None
    return tuple(key)


def _run(kernel, grid, block, args):
    _refuse_host_arrays(kernel, args)
    signature = None if SIMULATOR else _signature(args)
    key = (kernel, signature)
    function = _compiled.get(key)
    if not function:
        kernel[grid, block](*args)   # Numba compiles (or loads) the kernel and launches it
        if signature is not None and function is None:
            _compiled[key] = _core_function(kernel, args)
        return
    if not getattr(_thread, "has_context", False):
        cuda.current_context()   # a new thread (torch's backward threads) needs it made current
        _thread.has_context = True
    params = []
    for arg in args:
        if is_cuda_ndarray(arg):
            params += (0, 0, arg.size, arg.dtype.itemsize, arg.device_ctypes_pointer.value)
            params += arg.shape
            params += arg.strides
        else:
            kind = _SCALAR_KINDS[type(arg)]
            params.append(ctypes.c_int64(arg) if kind == _INT else
                          ctypes.c_double(arg) if kind == _FLOAT64 else
                          ctypes.c_float(arg) if kind == _FLOAT32 else bool(arg))
    _core_launch(_default_stream(), _launch_config(grid, block), function, *params)


def _core_function(kernel, args):
    """The cuda.core kernel Numba compiled for ``args``, or False to keep Numba's path."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    overloads = kernel.overloads
    compiled = overloads.get(argtypes) or (next(iter(overloads.values()))
                                           if kernel.specialized else None)
    if compiled is None or compiled.debug or compiled.cooperative or compiled.extensions:
        return False
    return compiled._codelibrary.get_cufunc().kernel


def _default_stream():
    stream = getattr(_thread, "stream", None)
    if stream is None:
        stream = _thread.stream = _to_core_stream(0)
    return stream


def _launch_config(grid, block):
    config_ = _configs.get((grid, block))
    if config_ is None:
        config_ = _configs[(grid, block)] = LaunchConfig(grid=grid, block=block, shmem_size=0)
    return config_


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
