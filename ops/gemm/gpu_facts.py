"""The GPU's facts the GEMM's pickers read (``ops.gemm.choices``, which imports this module at
its first pick so that it needs no Numba itself), each query made once: the dry device of
``ops.build_kernels`` replaces these caches with its own."""
import functools

from ops import cuda_backend

SIMULATOR = cuda_backend.SIMULATOR   # the simulator runs the SIMULATED tiling
multiprocessors = functools.cache(cuda_backend.multiprocessor_count)
compute_capability = functools.cache(cuda_backend.compute_capability)
