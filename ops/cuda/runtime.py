"""numba-cuda, imported on the first CUDA use, and what the kernel modules see until then.

Importing numba.cuda costs 1.5 s on the 2-core CPU machine (1.0 s of it ml_dtypes, which it
imports when onnx has installed it), and every op module defines its @cuda.jit kernels at
import. So the kernel modules get ``cuda``, a stand-in whose ``jit`` records the function
and its options (a ``LazyKernel``), and numba-cuda is imported the first time anything
else is asked of it: a launch, a device array, ``cuda.is_available()``. Numba reads a
kernel's globals and closure cells when it types the kernel, and the simulator swaps the
globals that *are* numba.cuda while a kernel runs, so that first import makes every lazy
kernel a real dispatcher and puts the real objects into every module global and closure
cell that held the stand-ins, before any kernel is typed or run. A LazyKernel that some
object still holds (an ops.launch ``Kernel``) forwards to its dispatcher.
"""
import os
import sys
import threading

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

_import_lock = threading.RLock()
_numba_cuda = None        # the numba.cuda module once imported
_lazy_kernels = []        # the LazyKernels made before that
_on_import = []           # what runs right after that import (the caching allocator's install)

# numba-cuda's and cuda.core's names that the array and launch paths use, set by that import
# (never in the simulator): ops.cuda.arrays builds DeviceNDArrays, ops.cuda.direct_launch
# launches through cuda.core
LaunchConfig = core_launch = DeviceNDArray = to_core_stream = None


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
    global _numba_cuda, LaunchConfig, core_launch, DeviceNDArray, to_core_stream
    with _import_lock:
        if _numba_cuda is not None:
            return _numba_cuda
        from numba import config
        from numba import cuda as numba_cuda
        # Small models launch small grids on purpose (a 128x10 layer is 5 blocks): no warning.
        config.CUDA_LOW_OCCUPANCY_WARNINGS = False
        if not SIMULATOR:
            from cuda.core import LaunchConfig
            from cuda.core import launch as core_launch
            from numba.cuda.cudadrv.devicearray import DeviceNDArray
            from numba.cuda.cudadrv.driver import _to_core_stream as to_core_stream
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


def is_device_array(array):
    return is_cuda_ndarray(array)


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
