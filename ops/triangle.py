"""``tril`` and ``triu``: the lower or upper triangle of the last two dims (a batch of
matrices), the rest zero, as torch's: ``tril`` keeps ``col - row <= diagonal``, ``triu``
keeps ``col - row >= diagonal``. The backward is the same mask on ``grad_out``, so one kernel
pair serves both directions: one thread per element, each element written (kept or zero).
"""
from numba import njit

from ops.cuda_backend import cuda
from ops.dispatch import Out, run
from ops.launch import CPU_KERNEL, Kernel, elements
from ops.layout import flat
from ops.registry import Op, register
from ops.twin import twin

LOWER, UPPER = 0, 1


def _masked(k, x, out, rows, cols, diagonal, upper):
    """``out[k]``: x's element where the triangle keeps it, else 0."""
    col = k % cols
    row = (k // cols) % rows
    offset = col - row
    keep = offset >= diagonal if upper else offset <= diagonal
    out[k] = x[k] if keep else 0


_masked_cpu, _masked_cuda = twin(_masked)


@njit(**CPU_KERNEL)
def triangle_cpu(x, out, rows, cols, diagonal, upper):
    for k in range(out.size):
        _masked_cpu(k, x, out, rows, cols, diagonal, upper)


@cuda.jit(cache=True)
def triangle_cuda(x, out, rows, cols, diagonal, upper):
    k = cuda.grid(1)
    if k < out.size:
        _masked_cuda(k, x, out, rows, cols, diagonal, upper)


TRIANGLE = Kernel("triangle", triangle_cpu, triangle_cuda, elements(1))


@register
class Triangle(Op):
    """params ``diagonal`` (int) and ``upper`` (False: tril, True: triu)."""
    name = "triangle"
    kernels = (TRIANGLE,)

    def check(self, x):
        which = "triu" if self.params["upper"] else "tril"
        if x.ndim < 2:
            raise ValueError(f"{which}: needs a tensor of 2 or more dims (a batch of "
                             f"matrices), got shape {tuple(x.shape)}")

    def _mask(self, x):
        rows, cols = tuple(x.shape)[-2], tuple(x.shape)[-1]
        return run(TRIANGLE, flat(x), Out(x.shape, x.dtype), rows, cols,
                   int(self.params["diagonal"]), UPPER if self.params["upper"] else LOWER)

    def forward(self, x):
        return self._mask(x)

    def backward(self, grad_out, grad_dst):
        return (self._mask(grad_out),)
