"""The GPU's facts the GEMM's pickers read (``ops.gemm.choices``, which imports this module at
its first pick so that it needs no Numba itself), each query made once.

``engine.cli.build_kernels``' dry device replaces these caches, in the modules loaded when it is
installed, by caches of its own target's answers; a cache made while it is installed would
keep the first target's count for the next. So ``ops.gemm.plans`` imports this module: it is
loaded with the GEMM, before any build installs a dry device."""
import functools

from ops import cuda as cuda_runtime

SIMULATOR = cuda_runtime.SIMULATOR   # the simulator runs the SIMULATED tiling
multiprocessors = functools.cache(cuda_runtime.multiprocessor_count)
compute_capability = functools.cache(cuda_runtime.compute_capability)
