"""Kernel launches, past Numba's launch path once a kernel is compiled.

Numba's own launch re-types every argument, wraps each array for the CUDA Array Interface
and looks the context up again: 60% of a ~34 us launch on the H200 profile, more than the
kernels of a small MLP take. After Numba has compiled and run a kernel once for a
signature (or a shipped kernel is found for it: ops.cuda.shipped), later launches with that
signature build the parameter list themselves (the same layout Numba passes: meminfo,
parent, size, itemsize, data, shape, strides per array) and call cuda.core's launch
directly.
"""
import ctypes
import threading

import numpy as np

import ops.cuda.runtime as runtime
from ops.cuda.runtime import SIMULATOR, cuda, is_cuda_ndarray
from ops.cuda.shipped import shipped_function

_ARRAY, _INT, _UINT64, _FLOAT64, _FLOAT32, _BOOL = range(6)
_SCALAR_KINDS = {int: _INT, np.int64: _INT, np.uint64: _UINT64, float: _FLOAT64,
                 np.float64: _FLOAT64, np.float32: _FLOAT32, bool: _BOOL, np.bool_: _BOOL}
_compiled = {}            # (kernel, signature) -> cuda.core kernel, or False: always via Numba
_configs = {}
_dynamic_shared = {}      # dispatcher -> the bytes of dynamic shared memory of its launches
_function_shared = {}     # id of a cuda.core kernel -> the same, once it was allowed them
_thread = threading.local()


def set_dynamic_shared_bytes(kernel, size):
    """Give every launch of ``kernel`` (a ``@cuda.jit`` dispatcher whose shared array is
    dynamic, ``cuda.shared.array(0, ...)``) ``size`` bytes of it. Above 48 KB a kernel must
    ask for it (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), which each compiled
    function does before its first launch."""
    _dynamic_shared[kernel] = size


def _asks_for_shared_memory(kernel, function):
    """``function`` (a cuda.core kernel of ``kernel``) allowed the dynamic shared memory that
    ``kernel``'s launches give."""
    size = _dynamic_shared.get(kernel, 0)
    if size and id(function) not in _function_shared:
        from cuda.bindings import driver
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        error, = driver.cuKernelSetAttribute(attribute, size, function.handle,
                                             cuda.get_current_device().id)
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{kernel}: this GPU cannot give a block {size} bytes of "
                               f"shared memory ({error.name})")
        _function_shared[id(function)] = size   # function lives on in _compiled
    return function


def launch(kernel, grid, block, args):
    """Launch the ``@cuda.jit`` ``kernel`` on ``grid`` blocks of ``block`` threads."""
    function = direct_function(kernel, args)   # a shipped kernel too
    if kernel in _dynamic_shared and not SIMULATOR:
        if not function:   # compiled first: the function must ask for its shared memory
            kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
            function = _compiled[(kernel, launch_signature(args))] = _core_function(kernel, args)
        _asks_for_shared_memory(kernel, function)
    if not function:
        kernel[grid, block](*args)   # Numba compiles (or loads) the kernel and launches it
        signature = None if SIMULATOR else launch_signature(args)
        if signature is not None and (kernel, signature) not in _compiled:
            _compiled[(kernel, signature)] = _core_function(kernel, args)
        return
    if not getattr(_thread, "has_context", False):
        cuda.current_context()   # a new thread (torch's backward threads) needs it made current
        _thread.has_context = True
    runtime.core_launch(default_stream(), launch_config(grid, block, function), function,
                        *kernel_params(args))


def direct_function(kernel, args):
    """The cuda.core kernel Numba compiled for the types of ``args``, once it has run them,
    or the one shipped for them (``python -m engine.cli.build_kernels``); None before, and
    always in the simulator or for arguments only Numba can pass."""
    if SIMULATOR:
        return None
    signature = launch_signature(args)
    if signature is None:
        return None
    function = _compiled.get((kernel, signature))
    if function is None:
        function = shipped_function(kernel, args, signature)
        if function is not None:
            _compiled[(kernel, signature)] = function
    return function


def kernel_params(args):
    """The kernel parameter list Numba would pass for ``args`` (each array expands to
    meminfo, parent, size, itemsize, data, shape, strides; a tuple, its members one by one)."""
    params = []
    for arg in args:
        if is_cuda_ndarray(arg):
            params += (0, 0, arg.size, arg.dtype.itemsize, arg.device_ctypes_pointer.value)
            params += arg.shape
            params += arg.strides
        elif type(arg) is tuple:
            params += kernel_params(arg)
        else:
            kind = _SCALAR_KINDS[type(arg)]
            params.append(ctypes.c_int64(arg) if kind == _INT else
                          ctypes.c_uint64(arg) if kind == _UINT64 else
                          ctypes.c_double(arg) if kind == _FLOAT64 else
                          ctypes.c_float(arg) if kind == _FLOAT32 else bool(arg))
    return params


def launch_signature(args):
    """A hashable key of the argument types, or None when only Numba's path can take them."""
    key = []
    for arg in args:
        if is_cuda_ndarray(arg):
            if not arg.is_c_contiguous():
                return None
            key.append((arg.dtype, arg.ndim))
        elif type(arg) is tuple:   # a geometry tuple (attention's): Numba passes its members
            members = launch_signature(arg)
            if members is None:
                return None
            key.append(members)
        elif type(arg) in _SCALAR_KINDS:
            key.append(type(arg))
        else:
            return None
    return tuple(key)


def _core_function(kernel, args):
    """The cuda.core kernel Numba compiled for ``args``, or False to keep Numba's path."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    overloads = kernel.overloads
    compiled = overloads.get(argtypes) or (next(iter(overloads.values()))
                                           if kernel.specialized else None)
    if compiled is None or compiled.debug or compiled.cooperative or compiled.extensions:
        return False
    return compiled._codelibrary.get_cufunc().kernel


def default_stream():
    """The cuda.core Stream of the engine's launches (the default stream), one per thread."""
    stream = getattr(_thread, "stream", None)
    if stream is None:
        stream = _thread.stream = runtime.to_core_stream(0)
    return stream


def launch_config(grid, block, function=None):
    """The launch config of ``function`` (a cuda.core kernel) on ``grid`` x ``block``, with
    the dynamic shared memory it was allowed (``set_dynamic_shared_bytes``)."""
    shared = _function_shared.get(id(function), 0)
    config_ = _configs.get((grid, block, shared))
    if config_ is None:
        config_ = _configs[(grid, block, shared)] = runtime.LaunchConfig(
            grid=grid, block=block, shmem_size=shared)
    return config_


def engine_stream():
    """The cuda.core Stream the engine's kernels launch on, for work that must follow them in
    order without a host sync (NCCL collectives in ``engine.distributed``)."""
    return default_stream()
