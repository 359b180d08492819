"""Shape ops: reshape (a view: every array the engine makes is C-contiguous) and 2-D transpose."""
import math

from numba import cuda, njit

from ops.device import device_of
from ops.launch import run_kernel
from ops.memory import empty
from ops.registry import Op, register


def resolve_shape(shape, size, op_name="reshape"):
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"{op_name}: only one dimension can be -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or size % known:
            raise ValueError(f"{op_name}: cannot reshape {size} elements into {shape}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size or any(s < 0 for s in shape):
        raise ValueError(f"{op_name}: cannot reshape {size} elements into {shape}")
    return shape


@register
class Reshape(Op):
    """A view of the same memory: no kernel on either device."""
    name = "reshape"
    is_view = True

    def forward(self, x):
        self.x_shape = tuple(x.shape)
        return x.reshape(resolve_shape(self.params["shape"], x.size))

    def backward(self, grad_out, grad_dst):
        return (grad_out.reshape(self.x_shape),)


@njit(cache=True, error_model="numpy")
def transpose_cpu(x, out):
    rows, cols = x.shape
    for i in range(rows):
        for j in range(cols):
            out[j, i] = x[i, j]


@cuda.jit(cache=True)
def transpose_cuda(x, out):
    k = cuda.grid(1)
    rows, cols = x.shape
    if k < rows * cols:
        i = k // cols
        j = k - i * cols
        out[j, i] = x[i, j]


def transpose(x):
    if x.ndim != 2:
        raise ValueError(f"transpose: expects a 2-D input, got shape {tuple(x.shape)}")
    out = empty((x.shape[1], x.shape[0]), x.dtype, device_of(x))
    run_kernel(device_of(x), transpose_cpu, transpose_cuda, x.size, x, out)
    return out


@register
class Transpose(Op):
    name = "transpose"
    cpu_kernels = (transpose_cpu,)
    cuda_kernels = (transpose_cuda,)

    def forward(self, x):
        return transpose(x)

    def backward(self, grad_out, grad_dst):
        return (transpose(grad_out),)
