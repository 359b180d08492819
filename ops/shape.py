"""Shape ops: reshape (a view: every array the engine makes is C-contiguous) and 2-D transpose."""
import math

from numba import njit

from ops.cuda_backend import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel, elements
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

    def check(self, x):
        self.shape = resolve_shape(self.params["shape"], x.size)

    def forward(self, x):
        self.x_shape = tuple(x.shape)
        return x.reshape(self.shape)

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


TRANSPOSE = Kernel("transpose", transpose_cpu, transpose_cuda, elements(0))


def transpose(x):
    return run(TRANSPOSE, x, Out((x.shape[1], x.shape[0]), x.dtype, flat=False))


@register
class Transpose(Op):
    name = "transpose"
    kernels = (TRANSPOSE,)

    def check(self, x):
        if x.ndim != 2:
            raise ValueError(f"transpose: expects a 2-D input, got shape {tuple(x.shape)}")

    def forward(self, x):
        return transpose(x)

    def backward(self, grad_out, grad_dst):
        return (transpose(grad_out),)
