"""How many threads the engine's CPU matrix products run on.

On the CPU every kernel is single-threaded except the GEMMs: ``np.dot`` inside ``@njit``,
which Numba hands to SciPy's BLAS (OpenBLAS in the SciPy wheels). BLAS starts one thread per
core by default, and its idle threads spin while they wait for work, so on a machine that is
doing anything else they fight the other processes: on the project's 2-core machine, beside
one busy process, ``python -m bench.mlp --device cpu`` took a median 6.4 s per epoch at 2
BLAS threads and 1.0 s at 1, and 0.48 and 0.60 s without it (the README's "CPU threads"
section has the commands and numbers).

So the engine runs BLAS on ``DEFAULT_THREADS`` threads, half the CPUs the process may use
(at least 1: one thread on the 2-core machine), unless the user chose through
one of ``USER_VARIABLES`` (which BLAS itself reads), which is then left alone. The default is
set on every BLAS library of the process (SciPy's, and NumPy's, which is subject to the same
contention) when SciPy's BLAS module is imported, which Numba does at the first CPU GEMM:
``import engine`` only arms that (importing SciPy's BLAS at once would add 0.15 s, a third of
``import engine``). ``set_num_threads(n)`` sets the count at any time; the limits go through
threadpoolctl, which finds the loaded libraries and calls each one's own setter.
"""
import importlib.abc
import importlib.util
import os
import sys

def _usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity call on this platform
        return os.cpu_count() or 1


# one thread on 2 cores (measured above); on the H200 host's 16 cores bench.mlp's CPU epoch
# took 1.0-1.2 s at 1 thread and 0.58 s at BLAS's default 16: half leaves room for the rest
DEFAULT_THREADS = max(1, _usable_cpus() // 2)
USER_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "BLIS_NUM_THREADS")
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


def set_num_threads(n):
    """Run the CPU GEMMs (every BLAS library in the process) on ``n`` threads, from now on.

    ``n`` is a positive integer; more threads than cores is allowed (BLAS may cap it at its
    own maximum, which ``get_num_threads`` then reports). Anything else is a ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"engine.set_num_threads: n must be a positive integer, got {n!r}")
    for library in _blas_libraries().lib_controllers:
        library.set_num_threads(n)


def get_num_threads():
    """The number of threads the CPU GEMMs run on: the largest count among the process's
    BLAS libraries (they agree after ``set_num_threads``)."""
    return max(library.num_threads for library in _blas_libraries().lib_controllers)


class _DefaultOnceLoaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports SciPy's BLAS module as usual, then sets the default thread count; once."""

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
        set_num_threads(DEFAULT_THREADS)


def apply_default():
    """Give the CPU GEMMs ``DEFAULT_THREADS`` threads from their first call on (now, when
    SciPy's BLAS is loaded already), unless one of ``USER_VARIABLES`` is set."""
    if any(os.environ.get(name) for name in USER_VARIABLES):
        return
    if SCIPY_BLAS in sys.modules:
        set_num_threads(DEFAULT_THREADS)
    elif not any(isinstance(finder, _DefaultOnceLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DefaultOnceLoaded())
