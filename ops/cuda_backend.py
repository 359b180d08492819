"""The one module that imports numba-cuda.

It gives the kernel modules the ``cuda`` API they are written against (``@cuda.jit``,
``cuda.grid``, shared and local arrays) and holds every numba-cuda internal the engine relies
on: the launch fast path (the kernel parameter layout, ``_to_core_stream``, ``_codelibrary``),
device arrays built without a context lookup, mapped host memory, and the memory-manager base
class of the caching allocator. It imports numba-cuda on the first CUDA use, not at import
(the section below), so CPU work never pays for it.

numba-cuda is in maintenance mode; its successor numba-cuda-mlir keeps ``@cuda.jit`` but has
no simulator and no GraphBuilder launch. No other file imports ``numba.cuda``, so moving is a
change to this file alone.
"""
import ctypes
import functools
import math
import os
import sys
import threading

import numpy as np

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


# ------------------------------------------------------------------ numba-cuda, imported late
#
# Importing numba.cuda costs 1.5 s on the 2-core CPU machine (1.0 s of it ml_dtypes, which it
# imports when onnx has installed it), and every op module defines its @cuda.jit kernels at
# import. So the kernel modules get ``cuda``, a stand-in whose ``jit`` records the function
# and its options (a ``LazyKernel``), and numba-cuda is imported the first time anything
# else is asked of it: a launch, a device array, ``cuda.is_available()``. Numba reads a
# kernel's globals and closure cells when it types the kernel, and the simulator swaps the
# globals that *are* numba.cuda while a kernel runs, so that first import makes every lazy
# kernel a real dispatcher and puts the real objects into every module global and closure
# cell that held the stand-ins, before any kernel is typed or run. A LazyKernel that some
# object still holds (an ops.launch ``Kernel``) forwards to its dispatcher.

_import_lock = threading.RLock()
_numba_cuda = None        # the numba.cuda module once imported
_lazy_kernels = []        # the LazyKernels made before that
_on_import = []           # what runs right after that import (the caching allocator's install)


class LazyKernel:
    """What ``cuda.jit`` gives before numba-cuda is imported: the function and the jit
    options; indexing (a launch), calling or any attribute imports numba-cuda and uses the
    real dispatcher."""

    __slots__ = ("_function", "_options", "_dispatcher")

    def __init__(self, function, options):
        self._function, self._options, self._dispatcher = function, options, None

    def real(self):
        if self._dispatcher is None:
            import_numba_cuda()
        return self._dispatcher

    def __getitem__(self, launch_config):
        return self.real()[launch_config]

    def __call__(self, *args, **kwargs):
        return self.real()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real(), name)

    def __repr__(self):
        return f"LazyKernel({self._function.__qualname__})"


class _DeferredCuda:
    """``numba.cuda`` as the kernel modules see it at import (see above)."""

    def jit(self, function_or_signature=None, **options):
        if function_or_signature is None:
            return lambda function: self.jit(function, **options)
        if not callable(function_or_signature):   # a signature: Numba compiles it right away
            return import_numba_cuda().jit(function_or_signature, **options)
        with _import_lock:   # a module imported in another thread during the import
            if _numba_cuda is None:
                kernel = LazyKernel(function_or_signature, options)
                _lazy_kernels.append(kernel)
                return kernel
        return _numba_cuda.jit(function_or_signature, **options)

    def __getattr__(self, name):
        return getattr(import_numba_cuda(), name)


cuda = _DeferredCuda()   # the kernel modules' CUDA API; the real numba.cuda once imported


def when_numba_cuda_imported(callback):
    """Run ``callback()`` right after numba-cuda's import (now, if it is imported already)."""
    with _import_lock:
        if _numba_cuda is None:
            _on_import.append(callback)
            return
    callback()


def import_numba_cuda():
    """numba.cuda, imported on first call; the lazy kernels become real dispatchers."""
    global _numba_cuda, LaunchConfig, _core_launch, DeviceNDArray, _to_core_stream
    with _import_lock:
        if _numba_cuda is not None:
            return _numba_cuda
        from numba import config
        from numba import cuda as numba_cuda
        # Small models launch small grids on purpose (a 128x10 layer is 5 blocks): no warning.
        config.CUDA_LOW_OCCUPANCY_WARNINGS = False
        if not SIMULATOR:
            from cuda.core import LaunchConfig
            from cuda.core import launch as _core_launch
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            from numba.cuda.cudadrv.driver import _to_core_stream
        for kernel in _lazy_kernels:
            kernel._dispatcher = numba_cuda.jit(**kernel._options)(kernel._function)
        # by id: the stand-ins forward attribute look-ups, so no look-up may touch them
        real = {id(kernel): kernel._dispatcher for kernel in _lazy_kernels}
        real[id(cuda)] = numba_cuda
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                for name, value in list(namespace.items()):
                    if id(value) in real:
                        namespace[name] = real[id(value)]
        for kernel in _lazy_kernels:
            for cell in kernel._function.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:   # a cell not yet filled
                    continue
                if id(contents) in real:
                    cell.cell_contents = real[id(contents)]
        _lazy_kernels.clear()
        _numba_cuda = numba_cuda
        for callback in _on_import:
            callback()
        _on_import.clear()
        return numba_cuda


def is_cuda_ndarray(array):
    """numba.cuda's own test (``numba.cuda.cudadrv.devicearray``), without importing it: no
    device array exists before numba-cuda is imported."""
    return getattr(array, "__cuda_ndarray__", False)


_thread = threading.local()


def is_device_array(array):
    return is_cuda_ndarray(array)


def gpu_usable():
    """True when Numba finds a CUDA driver and a device (never the simulator's answer)."""
    if SIMULATOR:
        return False
    try:
        return cuda.is_available()
    except Exception:  # a broken driver install reads as "no GPU", not a crash at import
        return False


def _context():
    """The current CUDA context, looked up once per thread (torch's backward threads too)."""
    context = getattr(_thread, "context", None)
    if context is None:
        context = _thread.context = cuda.current_context()
    return context


# ------------------------------------------------------------------ device arrays

def device_empty(shape, dtype):
    """An uninitialised C-contiguous device array (through the installed memory manager).

    ``cuda.device_array`` looks the context up on every call, a third of an allocation's
    Python time on the H200; this looks it up once per thread."""
    if SIMULATOR:
        return cuda.device_array(shape, dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    layout = _c_layout(shape, dtype.itemsize)
    if layout[2] == 0:   # holds nothing, so one per shape serves every caller
        return _empty_device_array(shape, dtype)
    return _device_array(layout, dtype, _context().memalloc(layout[2] * dtype.itemsize), 0)


def device_reshape(array, shape):
    """``array`` (C-contiguous, on the device) seen in ``shape`` of the same size, no copy.

    Numba's own reshape re-derives the layout through its dummy array on every call: with
    the DeviceNDArray it builds, 40% of the Python time of a small add on the H200 (three
    reshapes an op: the flat views of its operands and output)."""
    if SIMULATOR:
        return array.reshape(shape)
    layout = _c_layout(shape, array.dtype.itemsize)
    if layout[2] != array.size or not array.is_c_contiguous():
        return array.reshape(shape)   # Numba's error for a size mismatch, a copy for strides
    if layout[2] == 0:
        return _empty_device_array(shape, array.dtype)
    return _device_array(layout, array.dtype, array.gpu_data, array.stream)


def device_view(array, dtype):
    """``array`` (on the device) seen as ``dtype`` of the same item size, no copy. Numba's own
    ``view`` fails on a 0-d array (its strides become a list, which it then hashes)."""
    dtype = np.dtype(dtype)
    if SIMULATOR or array.ndim:
        return array.view(dtype)
    return _device_array(_c_layout((), dtype.itemsize), dtype, array.gpu_data, array.stream)


def device_arrays_overlap(a, b):
    """True when the C-contiguous device arrays ``a`` and ``b`` share bytes."""
    if not a.size or not b.size:
        return False
    if SIMULATOR:   # its device arrays wrap host arrays
        return np.may_share_memory(a._ary, b._ary)
    start_a, start_b = a.device_ctypes_pointer.value, b.device_ctypes_pointer.value
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


@functools.lru_cache(maxsize=4096)
def _c_layout(shape, itemsize):
    """``(shape, strides, size, dummy)`` of a C-contiguous array: the descriptor Numba's
    DeviceNDArray keeps (``_dummy``), made once per shape."""
    from numba.cuda.cudadrv import dummyarray
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    strides = tuple(reversed(strides))
    dummy = dummyarray.Array.from_desc(0, shape, strides, itemsize)
    return shape, strides, math.prod(shape), dummy


def _device_array(layout, dtype, gpu_data, stream):
    """A DeviceNDArray with the attributes its __init__ sets, from a cached layout."""
    shape, strides, size, dummy = layout
    array = object.__new__(DeviceNDArray)
    array.__dict__.update(ndim=len(shape), _dummy=dummy, shape=shape, strides=strides,
                          dtype=dtype, size=size, alloc_size=size * dtype.itemsize,
                          gpu_data=gpu_data, stream=stream)
    return array


@functools.cache
def _empty_device_array(shape, dtype):
    return cuda.device_array(shape, dtype)


def host_to_device(array):
    """A new device array holding a copy of the host ``array``, with C strides.

    NumPy calls an array with a stride-0 axis of length 1 (``np.arange(3)[:, None]``)
    contiguous, but the device array made from it keeps that stride and cannot be reshaped:
    such an array is copied into canonical strides first."""
    array = np.ascontiguousarray(array)
    canonical, step = [], array.itemsize
    for extent in reversed(array.shape):
        canonical.append(step)
        step *= extent
    if array.strides != tuple(reversed(canonical)):
        array = array.copy(order="C")
    return cuda.to_device(array)


def mapped_pair(size, dtype):
    """``(host, device)``: one zeroed buffer of mapped memory seen as a NumPy array (read by the
    host at any time, without a sync) and as a device array a kernel may write. In the
    simulator kernels run synchronously, so a plain device array serves as both."""
    if SIMULATOR:
        device = cuda.to_device(np.zeros(size, dtype))
        return None, device
    host = cuda.mapped_array(size, dtype)
    host[:] = 0
    device = DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=host.gpu_data)
    return host, device


def device_array_from_dlpack(producer):
    """A device array over the memory of a CUDA DLPack producer that has no CUDA Array
    Interface (no copy)."""
    from cuda.core.utils import StridedMemoryView   # numba-cuda's own dependency
    view = StridedMemoryView.from_dlpack(producer, stream_ptr=-1)
    itemsize = view.dtype.itemsize
    strides = None if view.strides is None else tuple(s * itemsize for s in view.strides)
    interface = {"shape": tuple(view.shape), "strides": strides, "typestr": view.dtype.str,
                 "data": (view.ptr, view.readonly), "version": 3}
    return cuda.from_cuda_array_interface(interface, owner=view, sync=False)


def dlpack_capsule(device_array, **options):
    """A DLPack capsule over a device array's memory (``options``: the ``__dlpack__``
    keywords)."""
    from cuda.core.utils import StridedMemoryView
    view = StridedMemoryView.from_cuda_array_interface(device_array, stream_ptr=-1)
    return view.__dlpack__(**options)


def as_device_array(obj):
    """A device array view of an object exposing ``__cuda_array_interface__`` (no copy)."""
    return cuda.as_cuda_array(obj)


def current_device_id():
    return cuda.get_current_device().id


def multiprocessor_count():
    return 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


# ------------------------------------------------------------------ memory managers

def install_memory_manager(manager_class):
    cuda.set_memory_manager(manager_class)


def current_memory_manager():
    return cuda.current_context().memory_manager


def __getattr__(name):
    """The driver's memory-manager names (``ops.cuda_pool`` subclasses and raises them), from
    numba-cuda's driver when first asked for (module ``__getattr__``, PEP 562). Not through
    ``import_numba_cuda``: its callbacks install ``ops.cuda_pool``'s allocator, which would
    then be imported from inside its own import."""
    if SIMULATOR or name not in ("MemoryManagerBase", "MemoryPointer", "CudaAPIError",
                                 "OUT_OF_MEMORY"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from numba.cuda.cudadrv import driver
    return {"MemoryManagerBase": driver.NumbaCUDAMemoryManager,
            "MemoryPointer": driver.MemoryPointer, "CudaAPIError": driver.CudaAPIError,
            "OUT_OF_MEMORY": driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY}[name]


# ------------------------------------------------------------------ launching
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
_compiled = {}            # (kernel, signature) -> cuda.core kernel, or False: always via Numba
_configs = {}


def launch(kernel, grid, block, args):
    """Launch the ``@cuda.jit`` ``kernel`` on ``grid`` blocks of ``block`` threads."""
    function = direct_function(kernel, args)
    if not function:
        kernel[grid, block](*args)   # Numba compiles (or loads) the kernel and launches it
        signature = None if SIMULATOR else _signature(args)
        if signature is not None and (kernel, signature) not in _compiled:
            _compiled[(kernel, signature)] = _core_function(kernel, args)
        return
    if not getattr(_thread, "has_context", False):
        cuda.current_context()   # a new thread (torch's backward threads) needs it made current
        _thread.has_context = True
    _core_launch(_default_stream(), _launch_config(grid, block), function,
                 *kernel_params(args))


def direct_function(kernel, args):
    """The cuda.core kernel Numba compiled for the types of ``args``, once it has run them
    (None before, and always in the simulator or for arguments only Numba can pass)."""
    if SIMULATOR:
        return None
    signature = _signature(args)
    return _compiled.get((kernel, signature)) if signature is not None else None


def kernel_params(args):
    """The kernel parameter list Numba would pass for ``args`` (each array expands to
    meminfo, parent, size, itemsize, data, shape, strides)."""
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
    return params


# ------------------------------------------------------------------ CUDA graphs

def build_graph(launches):
    """An executable CUDA graph of ``launches`` (``(function, grid, block, args)`` with
    ``function`` from ``direct_function``) in one chain, each after the one before. Its
    nodes never change: what changes between replays is device memory the kernels read."""
    from cuda.core.graph import GraphDefinition
    definition = GraphDefinition()
    node = definition
    for function, grid, block, args in launches:
        node = node.launch(_launch_config(grid, block), function, *kernel_params(args))
    return definition.instantiate()


def build_loop_graph(launches, remaining, unroll, tail):
    """An executable CUDA graph that runs ``launches`` (a step, as ``build_graph`` chains
    them) ``unroll * remaining[0] + tail`` times: a one-thread kernel sets a condition from
    the one-element int64 device array ``remaining``, a WHILE conditional node runs ``unroll``
    chained copies of the step and a kernel that counts ``remaining`` down and sets the
    condition again (``cudaGraphSetConditional``, from the CUDA device runtime library), then
    ``tail`` more copies follow. Set ``remaining`` before a launch: n steps in one launch.
    A WHILE pass costs ~3-5 us of its own on the H200 (two tiny kernels looped: 5.0 us a
    pass), so the body holds several steps. None where the device runtime library cannot
    be found or linked (the caller then chains n copies)."""
    kernels = _condition_kernels()
    if kernels is None:
        return None
    start, count_down = kernels
    from cuda.core.graph import GraphDefinition
    definition = GraphDefinition()
    condition = definition.create_condition(default_value=0)
    counter = kernel_params((remaining,))
    node = definition.launch(_launch_config(1, 1), start, *counter, condition)
    loop = node.while_loop(condition)
    body = loop.body
    for function, grid, block, args in launches * unroll:
        body = body.launch(_launch_config(grid, block), function, *kernel_params(args))
    body.launch(_launch_config(1, 1), count_down, *counter, condition)
    node = loop
    for function, grid, block, args in launches * tail:
        node = node.launch(_launch_config(grid, block), function, *kernel_params(args))
    return definition.instantiate()


@functools.cache
def _condition_kernels():
    """``(start, count_down)``: cuda.core kernels that set a graph condition to
    ``remaining[0] > 0``, the second after counting it down; None without the library."""
    library = _device_runtime_library()
    if library is None:
        return None
    set_conditional = cuda.declare_device("cudaGraphSetConditional", "void(uint64, uint32)",
                                          link=[library], abi="c")

    @cuda.jit("void(int64[::1], uint64)")
    def start(remaining, condition):
        if cuda.grid(1) == 0:
            more = 0
            if remaining[0] > 0:
                more = 1
            set_conditional(condition, more)

    @cuda.jit("void(int64[::1], uint64)")
    def count_down(remaining, condition):
        if cuda.grid(1) == 0:
            remaining[0] -= 1
            more = 0
            if remaining[0] > 0:
                more = 1
            set_conditional(condition, more)

    try:
        return tuple(next(iter(kernel.overloads.values()))._codelibrary.get_cufunc().kernel
                     for kernel in (start, count_down))
    except Exception:   # a toolkit whose linker cannot take the library: chain copies instead
        return None


def _device_runtime_library():
    """``libcudadevrt.a``: from CUDA_HOME, the system toolkit or NVIDIA's runtime wheels."""
    import glob
    import site
    roots = [os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    patterns = [f"{root}/lib64/libcudadevrt.a" for root in roots if root]
    patterns += [f"{path}/nvidia/*/lib/libcudadevrt.a" for path in site.getsitepackages()]
    found = [match for pattern in patterns for match in sorted(glob.glob(pattern))]
    return found[0] if found else None


def launch_graph(graph):
    """Launch ``graph`` on the engine's stream, after the kernels launched before it."""
    graph.launch(_default_stream())


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


def is_cuda_kernel(kernel):
    """True for a ``@cuda.jit`` dispatcher (the simulator's fake one in the simulator), lazy
    or real."""
    if isinstance(kernel, LazyKernel):
        kernel = kernel.real()
    if SIMULATOR:
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        return isinstance(kernel, FakeCUDAKernel)
    from numba.cuda.dispatcher import CUDADispatcher
    return isinstance(kernel, CUDADispatcher)


def engine_stream():
    """The cuda.core Stream the engine's kernels launch on, for work that must follow them in
    order without a host sync (NCCL collectives in ``engine.distributed``)."""
    return _default_stream()
