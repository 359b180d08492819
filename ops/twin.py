"""``twin(fn)``: a device function written once, compiled for both devices.

Every shared piece of kernel arithmetic (a pointwise function, an optimizer's element
update, an index computation) is plain Python that CPU kernels inline (``@njit(inline=
"always")``, IEEE division: ``x / 0`` is inf or nan, as on the GPU, with no zero check per
division) and CUDA kernels call (``@cuda.jit(device=True)``)."""
from numba import njit

from ops.cuda_backend import cuda


def twin(fn):
    """``(cpu, cuda)``: ``fn`` compiled as an inlined CPU function and as a CUDA device
    function."""
    return njit(inline="always", error_model="numpy")(fn), cuda.jit(device=True)(fn)
