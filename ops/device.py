"""Where an array lives, and whether a CUDA device (or Numba's simulator) can be used."""
import functools
import os

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.devicearray import is_cuda_ndarray

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
DEVICES = ("cpu", "cuda")


@functools.cache
def cuda_available():
    """True when CUDA kernels can run: a usable GPU, or Numba's CUDA simulator."""
    if SIMULATOR:
        return True
    try:
        return cuda.is_available()
    except Exception:  # a broken driver install reads as "no GPU", not a crash at import
        return False


def device_of(array):
    return "cuda" if is_cuda_ndarray(array) else "cpu"


def check_device(device):
    """Normalise a device name ("cpu", "cuda", "cuda:0", "auto") or raise a clear error."""
    name = str(device).lower()
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name.startswith("cuda:"):
        name = "cuda" if name == "cuda:0" else name
    if name not in DEVICES:
        raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'auto'")
    if name == "cuda" and not cuda_available():
        raise RuntimeError(
            "device 'cuda' requested but no CUDA GPU is usable here "
            "(set NUMBA_ENABLE_CUDASIM=1 to run CUDA kernels in Numba's simulator)"
        )
    return name


def to_host(array):
    """A NumPy array with the contents of ``array`` (a copy when it lives on the GPU)."""
    if is_cuda_ndarray(array):
        return array.copy_to_host()
    return np.asarray(array)


def to_device(array, device):
    """A fresh copy of a host or device array on ``device``."""
    if device == "cuda":
        if is_cuda_ndarray(array):
            from ops.memory import empty

            out = empty(array.shape, array.dtype, "cuda")
            out.copy_to_device(array)
            return out
        return cuda.to_device(np.ascontiguousarray(array))
    return np.array(to_host(array), copy=True, order="C")
