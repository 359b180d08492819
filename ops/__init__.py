"""Kernels and their differentiation rules.

Every op is written twice, as a Numba ``@njit`` CPU kernel and a ``@cuda.jit`` GPU kernel,
side by side in the module of its family. This package knows arrays (NumPy on the CPU, Numba
device arrays on CUDA) and nothing of Tensors or the tape; ``engine`` builds on it.
"""
from ops.numba_cache import apply_default as _cache_in_user_folder

_cache_in_user_folder()   # before Numba reads its configuration
# installs the CUDA caching allocator before any context exists
from ops import memory  # noqa: F401, E402
from ops.registry import REGISTRY, Op, register  # noqa: F401, E402
