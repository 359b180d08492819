"""The GPU: whether one is usable (asked without importing numba.cuda where no driver loads),
the current device's id, multiprocessors and compute capability, and its context's memory
manager."""
import ctypes
import os
import sys

from ops.cuda.runtime import SIMULATOR, cuda

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


def current_device_id():
    return cuda.get_current_device().id


def multiprocessor_count():
    return 1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def compute_capability():
    """(major, minor) of the current GPU; (0, 0) in the simulator, which runs no PTX."""
    return (0, 0) if SIMULATOR else tuple(cuda.get_current_device().compute_capability)


def install_memory_manager(manager_class):
    cuda.set_memory_manager(manager_class)


def current_memory_manager():
    return cuda.current_context().memory_manager
