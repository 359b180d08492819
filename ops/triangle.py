"""``tril`` and ``triu``: the lower or upper triangle of the last two dims (a batch of
matrices), the rest zero, as torch's: ``tril`` keeps ``col - row <= diagonal``, ``triu``
keeps ``col - row >= diagonal``. The backward is the same mask on ``grad_out``, so one kernel
pair serves both directions: one thread per element, each element written (kept or zero).
"""
from ops.dispatch import Out, run
from ops.element_kernel import element_kernel
from ops.layout import flat
from ops.registry import Op, register

LOWER, UPPER = 0, 1


def _masked(i, x, out, rows, cols, diagonal, upper):
    """``out[i]``: x's element where the triangle keeps it, else 0."""
    col = i % cols
    row = (i // cols) % rows
    offset = col - row
    keep = offset >= diagonal if upper else offset <= diagonal
    out[i] = x[i] if keep else 0


TRIANGLE = element_kernel("triangle", _masked, size="out", positional=True)


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
