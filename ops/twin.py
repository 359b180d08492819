"""``twin(fn)``: a device function written once, compiled for both devices.

Every shared piece of kernel arithmetic (a pointwise function, an optimizer's element
update, an index computation) is plain Python that CPU kernels inline (``@njit(inline=
"always")``, IEEE division: ``x / 0`` is inf or nan, as on the GPU, with no zero check per
division) and CUDA kernels call (``@cuda.jit(device=True)``).

Shared arithmetic that calls other shared arithmetic must call each device's own compiled
version: ``twin(make, *pairs)`` compiles ``make(*helpers)`` for each device, handed that
device's half of each pair (``ops.layout`` builds its offset functions on one unravel loop
so)."""
from numba import njit

from ops.cuda import cuda


def twin(fn, *pairs):
    """``(cpu, cuda)``: ``fn`` compiled as an inlined CPU function and as a CUDA device
    function; with ``pairs`` (twins), ``fn(*halves)`` of each device's halves."""
    cpu_fn = fn(*(cpu for cpu, _ in pairs)) if pairs else fn
    cuda_fn = fn(*(gpu for _, gpu in pairs)) if pairs else fn
    return njit(inline="always", error_model="numpy")(cpu_fn), cuda.jit(device=True)(cuda_fn)
