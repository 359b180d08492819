"""The exact GELU's CUDA kernels, ``x Φ(x)`` and its derivative ``Φ(x) + x φ(x)``, in the
input's dtype.

``ops.pointwise`` writes GELU with float64 constants (the CPU's float32 path is
``ops.gelu_cpu``), so on the GPU a float32 input was computed in float64: libdevice's double
erf and exp, about 40 double FMAs an element. Here every constant takes the input's dtype, so
float32 runs libdevice's ``erff`` and ``expf`` (a few float32 ulps from the float64 values,
as the CPU's path); float64 is the same arithmetic as before.
"""
import math

from ops.cuda import cuda
from ops.pointwise import INV_SQRT_TWO_PI, SQRT_HALF


@cuda.jit(cache=True)
def gelu_cuda(x, out, p):
    """out = GELU(x) elementwise (``p``, the table's unused parameter, for the signature)."""
    i = cuda.grid(1)
    if i < out.size:
        dtype = x.dtype.type
        v = x[i]
        out[i] = dtype(0.5) * v * (dtype(1) + math.erf(v * dtype(SQRT_HALF)))


@cuda.jit(cache=True)
def gelu_grad_cuda(x, y, grad_out, grad_in, p):
    """grad_in = grad_out * GELU'(x) elementwise."""
    i = cuda.grid(1)
    if i < grad_in.size:
        dtype = x.dtype.type
        v = x[i]
        derivative = (dtype(0.5) * (dtype(1) + math.erf(v * dtype(SQRT_HALF)))
                      + v * dtype(INV_SQRT_TWO_PI) * math.exp(dtype(-0.5) * v * v))
        grad_in[i] = grad_out[i] * derivative
