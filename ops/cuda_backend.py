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
        # the modules' globals, and the globals of kernels made from generated source
        # (ops.element_kernel execs its kernels in a namespace of their own)
        namespaces = {id(kernel._function.__globals__): kernel._function.__globals__
                      for kernel in _lazy_kernels}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                namespaces[id(namespace)] = namespace
        for namespace in namespaces.values():
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


# The NVIDIA driver library's names and folders, where numba-cuda 0.30 looks for it (its
# driver.py, locate_driver_and_loader): each name on the loader's search path, then in each
# folder; loaded as WinDLL on Windows (the only platform that has it), CDLL elsewhere.
DRIVER_NAMES, DRIVER_FOLDERS = {
    "win32": (("nvcuda.dll",), ("\\windows\\system32",)),
    "darwin": (("libcuda.dylib",), ("/usr/local/cuda/lib",)),
}.get(sys.platform, (("libcuda.so", "libcuda.so.1"), ("/usr/lib", "/usr/lib64")))
_load_library = getattr(ctypes, "WinDLL", ctypes.CDLL)


def driver_library_loads():
    """Whether the NVIDIA driver library loads, asked without importing numba.cuda: asking
    numba-cuda (``cuda.is_available()``) imports it first only to find no driver, which made
    ``check_device("auto")`` take 6.3 s on the 2-core CPU machine at load 9 (0.4 ms now)."""
    candidates = DRIVER_NAMES + tuple(os.path.join(folder, name)
                                      for folder in DRIVER_FOLDERS for name in DRIVER_NAMES)
    for candidate in candidates:
        try:
            _load_library(candidate)
        except OSError:
            continue
        return True
    return False


def gpu_usable():
    """True when Numba finds a CUDA driver and a device (never the simulator's answer); where
    the driver library does not load, without importing numba.cuda."""
    if SIMULATOR or not driver_library_loads():
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


def compute_capability():
    """(major, minor) of the current GPU; (0, 0) in the simulator, which runs no PTX."""
    return (0, 0) if SIMULATOR else tuple(cuda.get_current_device().compute_capability)


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
_dynamic_shared = {}      # dispatcher -> the bytes of dynamic shared memory of its launches
_function_shared = {}     # id of a cuda.core kernel -> the same, once it was allowed them


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


def device_address(array):
    """The address of a device array's first element."""
    return array.__cuda_array_interface__["data"][0]


def launch(kernel, grid, block, args):
    """Launch the ``@cuda.jit`` ``kernel`` on ``grid`` blocks of ``block`` threads."""
    function = direct_function(kernel, args)   # a shipped kernel too (see below)
    if kernel in _dynamic_shared and not SIMULATOR:
        if not function:   # compiled first: the function must ask for its shared memory
            kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
            function = _compiled[(kernel, _signature(args))] = _core_function(kernel, args)
        _asks_for_shared_memory(kernel, function)
    if not function:
        kernel[grid, block](*args)   # Numba compiles (or loads) the kernel and launches it
        signature = None if SIMULATOR else _signature(args)
        if signature is not None and (kernel, signature) not in _compiled:
            _compiled[(kernel, signature)] = _core_function(kernel, args)
        return
    if not getattr(_thread, "has_context", False):
        cuda.current_context()   # a new thread (torch's backward threads) needs it made current
        _thread.has_context = True
    _core_launch(_default_stream(), _launch_config(grid, block, function), function,
                 *kernel_params(args))


def direct_function(kernel, args):
    """The cuda.core kernel Numba compiled for the types of ``args``, once it has run them,
    or the one shipped for them (``python -m ops.build_kernels``); None before, and always in
    the simulator or for arguments only Numba can pass."""
    if SIMULATOR:
        return None
    signature = _signature(args)
    if signature is None:
        return None
    function = _compiled.get((kernel, signature))
    return _shipped_function(kernel, args, signature) if function is None else function


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
        node = node.launch(_launch_config(grid, block, function), function,
                           *kernel_params(args))
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
        body = body.launch(_launch_config(grid, block, function), function,
                           *kernel_params(args))
    body.launch(_launch_config(1, 1), count_down, *counter, condition)
    node = loop
    for function, grid, block, args in launches * tail:
        node = node.launch(_launch_config(grid, block, function), function,
                           *kernel_params(args))
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


def _launch_config(grid, block, function=None):
    """The launch config of ``function`` (a cuda.core kernel) on ``grid`` x ``block``, with
    the dynamic shared memory it was allowed (``set_dynamic_shared_bytes``)."""
    shared = _function_shared.get(id(function), 0)
    config_ = _configs.get((grid, block, shared))
    if config_ is None:
        config_ = _configs[(grid, block, shared)] = LaunchConfig(grid=grid, block=block,
                                                                 shmem_size=shared)
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


# ------------------------------------------------------------------ inline PTX

def inline_ptx_api():
    """numba-cuda's ``intrinsic`` decorator and its ``types``, for ``ops.tensor_core``'s
    inline-PTX instructions (imported there, on first use: only tensor-core kernels need
    them)."""
    from numba.cuda import types
    from numba.cuda.extending import intrinsic
    return intrinsic, types


# ------------------------------------------------------------------ shipped kernels
#
# A cold start compiles every kernel a step launches: 11.4-12.4 s for the first CUDA step of
# the MLP or the CNN on the H200 with an empty Numba cache (issue 32), nearly all of it
# Numba's typing and lowering. `python -m ops.build_kernels` compiles the variants the CLI's
# models launch ahead of time into ops/kernels/ (a cubin per compute capability, named by a
# content hash); the first launch of a (kernel, argument types) pair looks for one there and
# loads it through cuda.core, without asking Numba to compile. The hash covers everything
# the kernel's code is made from (its source and that of every function it calls, the
# constants and closure values they read, its compile options, the numba and numba-cuda
# versions), so an artifact built from other code is never found: it cannot run. A variant
# not shipped compiles just in time, as before. ENGINE_SHIPPED_KERNELS=0 turns the lookup
# off.

SHIPPED_KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
MANIFEST_NAME = "manifest.json"
_PROJECT_PACKAGES = ("ops", "optim", "engine", "data")
_shipped = {}             # (kernel, signature) -> cuda.core kernel, or None: not shipped
_fingerprints = {}        # id of a function or dispatcher -> (the object, its content hash)


def shipped_kernels_enabled():
    return os.environ.get("ENGINE_SHIPPED_KERNELS", "1") != "0"


@functools.cache
def shipped_manifest():
    """The manifest of ops/kernels/, or None without one: ``{"kernels": {key: {"name",
    "argtypes", "cubins": {"sm_90": {"file", "entry"}, ...}}}}``."""
    import json
    try:
        with open(os.path.join(SHIPPED_KERNELS_DIR, MANIFEST_NAME)) as file:
            return json.load(file)
    except FileNotFoundError:
        return None


def artifact_key(kernel, argtypes):
    """The content hash that names the artifact of ``kernel`` (a ``@cuda.jit`` dispatcher)
    compiled for ``argtypes`` (Numba types): the kernel's fingerprint, the argument types and
    the numba and numba-cuda release series it was compiled with."""
    import hashlib
    text = "\n".join((fingerprint(kernel), repr(tuple(str(t) for t in argtypes)),
                      _compiler_versions()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _compiler_versions():
    """The numba and numba-cuda release series (major.minor) the key holds. A cubin is
    machine code: what must match at run time is the argument layout of Numba's data model,
    which changes only between minor releases. Full versions matched nothing on the H200,
    whose image has numba 0.68.0 where the build had 0.68.1: every kernel compiled just in
    time again (0 of 16 lookups found)."""
    import importlib.metadata
    import numba

    def series(version):
        return ".".join(version.split(".")[:2])
    return (f"numba {series(numba.__version__)} "
            f"numba-cuda {series(importlib.metadata.version('numba-cuda'))}")


def fingerprint(function):
    """A hash of what the code of ``function`` (a Python function or a ``@cuda.jit``
    dispatcher) is made from: its source; its compile options; and, recursively, the values of
    its closure cells and of the globals its code names (functions and dispatchers by their
    own fingerprint, the project's modules by the attributes the code names, other modules by
    name, constants by value). A value without a stable description (an object's default repr
    holds its address) gives a hash no other process reproduces: never a false match."""
    return _fingerprint(function, frozenset(), [False])


def _fingerprint(function, active, cyclic):
    """``fingerprint`` inside the descriptions of the functions in ``active`` (a function
    that reaches itself again is described by name there, and its hash, which then depends on
    where the walk began, is not kept: ``cyclic[0]`` says so)."""
    known = _fingerprints.get(id(function))
    if known is not None and known[0] is function:
        return known[1]
    python_function = getattr(function, "py_func", function)
    if id(python_function) in active:
        cyclic[0] = True
        return f"<recursive {python_function.__qualname__}>"
    import hashlib
    inner_cyclic = [False]
    text = _function_description(function, active | {id(python_function)}, inner_cyclic)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if inner_cyclic[0]:
        cyclic[0] = True
    else:
        _fingerprints[id(function)] = (function, digest)
    return digest


@functools.lru_cache(maxsize=None)
def _source(code):
    """The dedented source of a code object (one per ``def``, shared by every closure made
    from it: the GEMM template's dozen device functions per tiling are read once)."""
    import inspect
    import textwrap
    try:
        return textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):   # no source file: the bytecode stands for it
        return repr(code.co_code) + repr(code.co_consts)


def _function_description(function, active, cyclic):
    python_function = getattr(function, "py_func", function)
    code = python_function.__code__
    parts = [f"{python_function.__module__}.{python_function.__qualname__}", _source(code)]
    options = getattr(function, "targetoptions", None)
    if options is not None:   # not how it is cached or linked: numba-cuda sets lto where it
        # finds nvJitLink, which a CPU machine lacks; the code linked is the same
        parts.append(repr(sorted((key, repr(value)) for key, value in options.items()
                                 if key not in ("cache", "lto"))))
    for name, cell in zip(code.co_freevars, python_function.__closure__ or ()):
        parts.append(f"closure {name} = "
                     f"{_value_description(cell.cell_contents, active, cyclic)}")
    names = _code_names(code)
    module_globals = python_function.__globals__
    for name in sorted(names):
        if name in module_globals:
            value = module_globals[name]
            parts.append(f"global {name} = "
                         f"{_value_description(value, active, cyclic, names)}")
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def _code_names(code):
    """Every global and attribute name the code and its nested code objects use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names


def _value_description(value, active, cyclic, names=()):
    import types
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] not in _PROJECT_PACKAGES:
            return f"module {value.__name__}"   # numba, math, numpy: their versions count
        attributes = [f"{name}: {_value_description(getattr(value, name), active, cyclic)}"
                      for name in sorted(names) if hasattr(value, name)]
        return f"module {value.__name__} {{{', '.join(attributes)}}}"
    if hasattr(value, "py_func") or (isinstance(value, types.FunctionType)
                                     and value.__module__.split(".")[0] in _PROJECT_PACKAGES):
        return f"function {_fingerprint(value, active, cyclic)}"
    if isinstance(value, types.FunctionType):
        return f"function {value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        inner = ", ".join(_value_description(item, active, cyclic) for item in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_value_description(item, active, cyclic)}"
                               for key, item in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    return f"{type(value).__name__} {value!r}"


def _shipped_function(kernel, args, signature):
    """The cuda.core kernel shipped for ``kernel`` and the types of ``args`` (``signature``,
    ``_signature``'s key of them), loaded once; None when there is none (lookup off, no
    manifest, no artifact for this device's compute capability)."""
    if not shipped_kernels_enabled():
        return None
    try:
        return _shipped[(kernel, signature)]
    except KeyError:
        pass
    function = None
    manifest = shipped_manifest()
    if manifest is not None:
        entry = manifest["kernels"].get(artifact_key(kernel, tuple(kernel.typeof_pyval(a)
                                                                  for a in args)))
        if entry is not None:
            try:
                function = _load_artifact(entry)
            except Exception as error:   # a driver that refuses the cubin: compile instead
                import warnings
                warnings.warn(f"ops.cuda_backend: the shipped kernel {entry['name']} did not "
                              f"load ({error}); Numba compiles it instead", stacklevel=2)
    _shipped[(kernel, signature)] = function
    if function is not None:
        _compiled[(kernel, signature)] = function
    return function


def _load_artifact(entry):
    """The cuda.core kernel of a manifest entry, from its cubin for this device's compute
    capability; None when it has none for this one."""
    from cuda.core import ObjectCode
    major, minor = cuda.get_current_device().compute_capability
    cubin = entry["cubins"].get(f"sm_{major}{minor}")
    if cubin is None:
        return None
    with open(os.path.join(SHIPPED_KERNELS_DIR, cubin["file"]), "rb") as file:
        code = ObjectCode.from_cubin(file.read())
    return code.get_kernel(cubin["entry"])


def compile_artifact(kernel, argtypes, compute_capability):
    """``(entry name, cubin bytes)`` of ``kernel`` compiled for ``argtypes`` and
    ``compute_capability`` (major, minor) as Numba compiles it at a first launch on such a
    GPU (its options, max_registers included; sm_90 and later as Numba's arch-specific
    ``sm_XYa``), without a GPU: for ``python -m ops.build_kernels``. None for a kernel that
    only Numba's launch can run (cooperative, debug, extensions, launch-config sensitive)."""
    import types
    from numba.cuda import codegen as cuda_codegen
    from numba.cuda import dispatcher as cuda_dispatcher
    major, minor = compute_capability
    target = (major, minor, "a" if (major, minor) >= (9, 0) else "")   # Numba's _ensure_cc
    device = types.SimpleNamespace(compute_capability=(major, minor))
    found = cuda_dispatcher.get_current_device, cuda_codegen.CUDACodeLibrary._ensure_cc
    cuda_dispatcher.get_current_device = lambda: device
    cuda_codegen.CUDACodeLibrary._ensure_cc = lambda library, cc: target if cc is None else cc
    from cuda.pathfinder import DynamicLibNotFoundError
    try:
        compiled = cuda_dispatcher._Kernel(kernel.py_func, tuple(argtypes),
                                           **kernel.targetoptions)
        if (compiled.debug or compiled.cooperative or compiled.extensions
                or compiled.launch_config_sensitive):
            return None
        cubin = compiled._codelibrary.get_cubin(cc=target)   # a cuda.core ObjectCode
        return compiled.entry_name, bytes(getattr(cubin, "code", cubin))
    except DynamicLibNotFoundError as error:
        raise RuntimeError(f"compiling a kernel needs NVVM, NVRTC and nvJitLink, not found "
                           f"here ({str(error).splitlines()[0]}): install them and set "
                           f"CUDA_HOME as ops/README.md, 'Shipped kernels', says") from None
    finally:
        cuda_dispatcher.get_current_device, cuda_codegen.CUDACodeLibrary._ensure_cc = found
