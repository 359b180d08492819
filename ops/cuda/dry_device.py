"""A *dry device*: real numba-cuda without a GPU, whose device arrays hold no memory (reads
give zeros) and whose launches are recorded instead of run. The shipped-kernel build runs
the CLI's models on it to find the (kernel, argument types) pairs they launch; the launch
plans see the multiprocessor count of the GPU it stands for, so the GEMM tilings and split-K
choices are the ones that GPU makes."""
import contextlib
import ctypes
import functools
import itertools
import sys

import numpy as np

from ops.cuda.arrays import (c_layout, device_array_over, device_empty, device_reshape,
                             device_view, host_to_device, mapped_pair)
from ops.cuda.direct_launch import direct_function, launch, launch_signature
from ops.cuda.fingerprints import PROJECT_PACKAGES
from ops.cuda.gpu import compute_capability, current_device_id, gpu_usable, multiprocessor_count
from ops.cuda.runtime import cuda


class _DryMemory:
    """Device memory that is not there: an address range, for views and overlap checks."""
    __cuda_memory__ = True
    _addresses = itertools.count(1 << 40, 1 << 32)

    def __init__(self, size, address=None):
        self.size = self._cuda_memsize_ = size
        self.address = next(self._addresses) if address is None else address

    @property
    def device_ctypes_pointer(self):
        return ctypes.c_void_p(self.address)

    @property
    def device_pointer(self):
        return self.address

    def view(self, start, stop=None):
        stop = self.size if stop is None else stop
        return _DryMemory(stop - start, self.address + start)


class DryDevice:
    """Replaces ``ops.cuda``'s device functions, in every module that bound them, by ones
    that need no GPU: arrays without memory, launches recorded in ``launches``
    (``(dispatcher, argument types)``, first launch order) instead of run."""

    def __init__(self, multiprocessors):
        self.multiprocessors = multiprocessors
        self.launches = {}
        self.unpassable = set()   # kernels launched with arguments only Numba's path takes

    def device_empty(self, shape, dtype):
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        dtype = np.dtype(dtype)
        layout = c_layout(shape, dtype.itemsize)
        return device_array_over(layout, dtype, _DryMemory(layout[2] * dtype.itemsize), 0)

    def device_reshape(self, array, shape):
        layout = c_layout(tuple(shape), array.dtype.itemsize)
        return device_array_over(layout, array.dtype, array.gpu_data, 0)

    def device_view(self, array, dtype):
        dtype = np.dtype(dtype)
        layout = c_layout(array.shape, dtype.itemsize)
        return device_array_over(layout, dtype, array.gpu_data, 0)

    def host_to_device(self, array):
        array = np.asarray(array)
        return self.device_empty(array.shape, array.dtype)

    def mapped_pair(self, size, dtype):
        return np.zeros(size, dtype), self.device_empty(size, dtype)

    def launch(self, kernel, grid, block, args):
        if launch_signature(args) is None:
            self.unpassable.add(kernel.py_func.__qualname__)
            return
        argtypes = tuple(kernel.typeof_pyval(arg) for arg in args)
        self.launches.setdefault((id(kernel), argtypes), (kernel, argtypes))

    def replacements(self):
        return {device_empty: self.device_empty,
                device_reshape: self.device_reshape,
                device_view: self.device_view,
                host_to_device: self.host_to_device,
                mapped_pair: self.mapped_pair,
                launch: self.launch,
                direct_function: lambda kernel, args: None,
                gpu_usable: lambda: True,
                multiprocessor_count: lambda: self.multiprocessors,
                compute_capability: lambda: (9, 0),
                current_device_id: lambda: 0}

    @contextlib.contextmanager
    def installed(self):
        """The dry device in place of the real one in every loaded module of the project (a
        ``functools.cache`` of a replaced function is replaced by a cache of its
        replacement), and Numba's host/device copies made no-ops (reads give zeros)."""
        replacements = self.replacements()
        undo = []
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", None)   # sys.modules may hold stand-ins
            if not isinstance(name, str) or name.split(".")[0] not in PROJECT_PACKAGES:
                continue
            for name, value in list(vars(module).items()):
                try:
                    replacement = replacements.get(value)
                except TypeError:   # an unhashable value: no function of ours
                    continue
                wrapped = getattr(value, "__wrapped__", None)
                if replacement is None and callable(value) and wrapped is not None:
                    try:
                        inner = replacements.get(wrapped)
                    except TypeError:
                        inner = None
                    replacement = functools.cache(inner) if inner is not None else None
                if replacement is not None:
                    undo.append((module, name, value))
                    setattr(module, name, replacement)
        driver = cuda.cudadrv.driver
        copies = {"device_to_host": _zero_host_copy, "host_to_device": _no_copy,
                  "device_to_device": _no_copy, "device_memset": _no_copy}
        undo += [(driver, name, getattr(driver, name)) for name in copies]
        for name, replacement in copies.items():
            setattr(driver, name, replacement)
        numba_runtime = cuda.cudadrv.devices._runtime   # methods that ask for a context
        undo.append((numba_runtime, "ensure_context", numba_runtime.ensure_context))
        numba_runtime.ensure_context = contextlib.nullcontext
        try:
            yield self
        finally:
            for module, name, value in reversed(undo):
                setattr(module, name, value)


def _zero_host_copy(dst, src, size, stream=0):
    if isinstance(dst, np.ndarray):
        dst.fill(0)


def _no_copy(*args, **kwargs):
    pass
