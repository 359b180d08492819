"""Where an array lives, and whether a CUDA device (or Numba's simulator) can be used."""
import functools

import numpy as np

from ops.cuda_backend import SIMULATOR, cuda, device_empty, host_to_device, is_device_array

DEVICES = ("cpu", "cuda")


@functools.cache
def cuda_available():
    """True when CUDA kernels can run: a usable GPU, or Numba's CUDA simulator (which the
    tests use; ``check_device("auto")`` never picks it)."""
    if SIMULATOR:
        return True
    try:
        return cuda.is_available()
    except Exception:  # a broken driver install reads as "no GPU", not a crash at import
        return False


def device_of(array):
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
    """A NumPy array with the contents of ``array`` (a copy when it lives on the GPU)."""
    if is_device_array(array):
        return array.copy_to_host()
    return np.asarray(array)


def to_device(array, device):
    """A fresh copy of a host or device array on ``device``."""
    if device == "cuda":
        if is_device_array(array):
            out = device_empty(array.shape, array.dtype)   # fully written: no poison needed
            out.copy_to_device(array)
            return out
        return host_to_device(array)
    return np.array(to_host(array), copy=True, order="C")
