"""Device arrays: allocation, reshapes and views without Numba's per-call overhead, copies
from the host, mapped host memory, and the exchange with other libraries (the CUDA Array
Interface, DLPack)."""
import functools
import math
import threading

import numpy as np

import ops.cuda.runtime as runtime
from ops.cuda.runtime import SIMULATOR, cuda

_thread = threading.local()


def _context():
    """The current CUDA context, looked up once per thread (torch's backward threads too)."""
    context = getattr(_thread, "context", None)
    if context is None:
        context = _thread.context = cuda.current_context()
    return context


def device_empty(shape, dtype):
    """An uninitialised C-contiguous device array (through the installed memory manager).

    ``cuda.device_array`` looks the context up on every call, a third of an allocation's
    Python time on the H200; this looks it up once per thread."""
    if SIMULATOR:
        return cuda.device_array(shape, dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    layout = c_layout(shape, dtype.itemsize)
    if layout[2] == 0:   # holds nothing, so one per shape serves every caller
        return _empty_device_array(shape, dtype)
    return device_array_over(layout, dtype, _context().memalloc(layout[2] * dtype.itemsize), 0)


def device_reshape(array, shape):
    """``array`` (C-contiguous, on the device) seen in ``shape`` of the same size, no copy.

    Numba's own reshape re-derives the layout through its dummy array on every call: with
    the DeviceNDArray it builds, 40% of the Python time of a small add on the H200 (three
    reshapes an op: the flat views of its operands and output)."""
    if SIMULATOR:
        return array.reshape(shape)
    layout = c_layout(shape, array.dtype.itemsize)
    if layout[2] != array.size or not array.is_c_contiguous():
        return array.reshape(shape)   # Numba's error for a size mismatch, a copy for strides
    if layout[2] == 0:
        return _empty_device_array(shape, array.dtype)
    return device_array_over(layout, array.dtype, array.gpu_data, array.stream)


def device_view(array, dtype):
    """``array`` (on the device) seen as ``dtype`` of the same item size, no copy. Numba's own
    ``view`` fails on a 0-d array (its strides become a list, which it then hashes)."""
    dtype = np.dtype(dtype)
    if SIMULATOR or array.ndim:
        return array.view(dtype)
    return device_array_over(c_layout((), dtype.itemsize), dtype, array.gpu_data, array.stream)


def device_arrays_overlap(a, b):
    """True when the C-contiguous device arrays ``a`` and ``b`` share bytes."""
    if not a.size or not b.size:
        return False
    if SIMULATOR:   # its device arrays wrap host arrays
        return np.may_share_memory(a._ary, b._ary)
    start_a, start_b = a.device_ctypes_pointer.value, b.device_ctypes_pointer.value
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


@functools.lru_cache(maxsize=4096)
def c_layout(shape, itemsize):
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


def device_array_over(layout, dtype, gpu_data, stream):
    """A DeviceNDArray of ``layout`` (``c_layout``'s) over the memory ``gpu_data``, with the
    attributes its __init__ sets."""
    shape, strides, size, dummy = layout
    array = object.__new__(runtime.DeviceNDArray)
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
    device = runtime.DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=host.gpu_data)
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


def device_address(array):
    """The address of a device array's first element."""
    return array.__cuda_array_interface__["data"][0]
