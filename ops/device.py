"""Where an array lives, and whether a CUDA device (or Numba's simulator) can be used."""
import functools

import numpy as np

from ops.array_copy import copy_array
from ops.cuda import SIMULATOR, device_empty, gpu_usable, host_to_device, is_device_array
from ops.flag_buffer import raise_pending
from ops.launch import note_unrecordable, recording

DEVICES = ("cpu", "cuda")


@functools.cache
def cuda_available():
    """True when CUDA kernels can run: a usable GPU, or Numba's CUDA simulator (which the
    tests use; ``check_device("auto")`` never picks it)."""
    return SIMULATOR or gpu_usable()


def device_of(array):
    if type(array) is np.ndarray:   # the common case first (an optimizer step asks three times)
        return "cpu"
    return "cuda" if is_device_array(array) else "cpu"


def check_device(device):
    """Normalise a device name ("cpu", "cuda", "cuda:0", "auto") or raise a clear error.

    "auto" is "cuda" when a real GPU is usable and "cpu" otherwise: never Numba's CUDA
    simulator, which runs one OS thread per CUDA thread (a 256-sample MNIST epoch did not
    finish in 300 s); "cuda" takes the simulator only when NUMBA_ENABLE_CUDASIM=1 asks."""
    name = str(device).lower()
    if name == "auto":
        return "cuda" if cuda_available() and not SIMULATOR else "cpu"
    if name.startswith("cuda:"):
        name = "cuda" if name == "cuda:0" else name
    if name not in DEVICES:
        raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'auto'")
    if name == "cuda" and not cuda_available():
        raise RuntimeError(
            "device 'cuda' requested but no CUDA GPU is usable here (a GPU needs an NVIDIA "
            "driver and the CUDA libraries of pip install -e '.[cuda]'); use 'cpu', or 'auto' "
            "to take a GPU only where there is one"
        )
    return name


def to_host(array):
    """A NumPy array with the contents of ``array`` (a copy when it lives on the GPU). The
    copy waits for the kernels before it, so an input fault they flagged (a bad label of a
    captured step) is raised here (``ops.flag_buffer``)."""
    if is_device_array(array):
        note_unrecordable("a device value read on the host (.item(), .numpy(), a check)")
        values = array.copy_to_host()
        raise_pending("cuda")
        return values
    return np.asarray(array)


def read_on_host(array, how):
    """``to_host(array)`` for a read of a tensor's values by the user's code (``how``:
    ".item()", "float()"): inside a captured step it is a decision the host makes from step
    data, which a replay would freeze, so the step runs eagerly, on the CPU as on CUDA."""
    if recording():
        note_unrecordable(f"a tensor's values read on the host ({how})")
    return to_host(array)


def to_device(array, device):
    """A fresh copy of a host or device array on ``device``.

    A copy within one device of a C-contiguous array is a kernel (``ops.array_copy``), so a
    captured step replays it; a copy between the host and the device is not."""
    on_device = is_device_array(array)
    if device == "cuda":
        if on_device and _c_contiguous(array):
            return copy_array(device_empty(array.shape, array.dtype), array)   # all written
        note_unrecordable("data copied between the host and the device")
        if on_device:
            out = device_empty(array.shape, array.dtype)
            out.copy_to_device(array)
            return out
        return host_to_device(array)
    if type(array) is np.ndarray and array.flags.c_contiguous:
        return copy_array(np.empty(array.shape, array.dtype), array)
    if not on_device:
        note_unrecordable("host data copied into a new array")
    return np.array(to_host(array), copy=True, order="C")


def copy_into(destination, source):
    """Copy ``source`` (host or device, same shape and dtype) into ``destination``; within one
    device a kernel, as ``to_device``."""
    if device_of(source) == device_of(destination) and _c_contiguous(source):
        copy_array(destination, source)
        return
    note_unrecordable("data copied between the host and the device")
    if is_device_array(destination):
        destination.copy_to_device(source if is_device_array(source)
                                   else np.ascontiguousarray(source))
    else:
        np.copyto(destination, to_host(source))


def _c_contiguous(array):
    return array.is_c_contiguous() if is_device_array(array) else array.flags.c_contiguous
