"""How many threads the engine's CPU kernels run on: one setting for the engine's GEMM
split, its other kernels' blocks and BLAS.

The count lives in ``ops.cpu_threads``: a large CPU GEMM is split into row blocks across that
many threads, each block one single-threaded BLAS call, and the convolution, pooling and
BatchNorm kernels run blocks of their samples, planes or channels on the same threads
(Numba's own thread pool is never started). BLAS itself (``np.dot`` inside
``@njit`` calls SciPy's OpenBLAS) stays on one thread: its idle threads spin while they wait
for work, so on a machine doing anything else they fight the other processes (on the
project's 2-core machine, beside one busy process, ``python -m bench.mlp --device cpu`` took
6.4 s per epoch at 2 BLAS threads and 1.0 s at 1), and a split GEMM's blocks are BLAS calls
already.

By default the count follows the machine: the CPUs the process may use
(``os.sched_getaffinity``) less those other processes kept busy, re-read at most once a
second by the kernel that asks (``ops.cpu_threads``; no thread of its own). A quiet 2-core
machine runs on 2, beside one busy process on 1. ``set_num_threads(n)`` fixes the count.

BLAS's one thread is set on every BLAS library of the process (SciPy's, and NumPy's) when
SciPy's BLAS module is imported, which Numba does at the first CPU GEMM: ``import engine``
only arms that (importing SciPy's BLAS at once would add 0.15 s, a third of
``import engine``), and imports neither Numba nor threadpoolctl. A BLAS count chosen in the
environment (one of ``ops.cpu_threads.USER_VARIABLES``, which BLAS itself reads) is left
alone, and the engine's own count is then 1 (BLAS threads the GEMMs) until
``set_num_threads`` is called. This module imports ``ops`` (and so Numba) only when a
function of it runs.
"""
import importlib.abc
import importlib.util
import sys

BLAS_THREADS = 1   # BLAS's own pool; the engine's threads split the GEMMs
SCIPY_BLAS = "scipy.linalg.cython_blas"   # the module through which Numba reaches BLAS


def _blas_libraries():
    """threadpoolctl's controller of the process's BLAS libraries, SciPy's loaded first."""
    importlib.import_module(SCIPY_BLAS)
    from threadpoolctl import ThreadpoolController

    libraries = ThreadpoolController().select(user_api="blas")
    if not libraries.lib_controllers:
        raise RuntimeError("engine.set_num_threads: threadpoolctl finds no BLAS library in "
                           "this process (SciPy's BLAS, which the CPU GEMMs call, should be one)")
    return libraries


def _set_blas_threads(n):
    for library in _blas_libraries().lib_controllers:
        library.set_num_threads(n)


def set_num_threads(n):
    """Run the engine's CPU kernels on ``n`` threads from now on: large GEMMs split into
    ``n`` row blocks, the other kernels' blocks on as many threads, every BLAS library of
    the process on one thread.

    ``n`` is a positive integer; more threads than cores is allowed. Anything else is a
    ValueError. The count no longer follows the machine's load."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"engine.set_num_threads: n must be a positive integer, got {n!r}")
    from ops import cpu_threads
    _set_blas_threads(BLAS_THREADS)
    cpu_threads.set_threads(n)


def get_num_threads():
    """The number of threads the engine's CPU kernels run on now: ``set_num_threads``'s,
    else the usable CPUs less those other processes keep busy."""
    from ops import cpu_threads
    return cpu_threads.threads()


def blas_thread_counts():
    """The thread count of each BLAS library in the process."""
    return [library.num_threads for library in _blas_libraries().lib_controllers]


class _DefaultOnceLoaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports SciPy's BLAS module as usual, then sets BLAS's thread count; once."""

    def find_spec(self, name, path=None, target=None):
        if name != SCIPY_BLAS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _apply_blas_default()


def _apply_blas_default():
    from ops.cpu_threads import blas_threads_chosen_in_environment
    if not blas_threads_chosen_in_environment():
        _set_blas_threads(BLAS_THREADS)


def apply_default():
    """Give BLAS one thread from its first call on (now, when SciPy's BLAS is loaded
    already), unless one of ``ops.cpu_threads.USER_VARIABLES`` is set."""
    if SCIPY_BLAS in sys.modules:
        _apply_blas_default()
    elif not any(isinstance(finder, _DefaultOnceLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DefaultOnceLoaded())
