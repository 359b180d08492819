"""``maximum(a, b)`` and ``minimum(a, b)``: the elementwise larger or smaller of two tensors
broadcast together, NaN propagating (torch's ``maximum``/``minimum``, NumPy's too).

The gradient goes to the operand that was chosen; where the two are equal it is split in
half between them, and where one is NaN both get it, as torch does. The backward kernel writes both operands' gradients at the
output's shape, then a fixed-order sum undoes broadcasting (``ops.reduce.sum_to_shape``).
"""
import math

from numba import njit

from ops.cuda_backend import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, elements
from ops.layout import (broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda,
                        broadcast_shape, flat)
from ops.reduce import REDUCE, SUM, sum_to_shape
from ops.registry import Op, register
from ops.twin import twin

MAXIMUM, MINIMUM = 0, 1
NAMES = {MAXIMUM: "maximum", MINIMUM: "minimum"}


def _pick(code, x, y):
    if x != x or y != y:
        return math.nan
    if code == MAXIMUM:
        return x if x >= y else y
    return x if x <= y else y


def _shares(code, x, y):
    """The gradient shares of (a, b): 1 to the chosen one, half each on a tie, and 1 to both
    where one is NaN (torch's rule: an operand gets none only where it lost)."""
    if x == y:
        return 0.5, 0.5
    a_lost = x < y if code == MAXIMUM else x > y
    b_lost = x > y if code == MAXIMUM else x < y
    return (0.0 if a_lost else 1.0), (0.0 if b_lost else 1.0)


_pick_cpu, _pick_cuda = twin(_pick)
_shares_cpu, _shares_cuda = twin(_shares)


def _kernels(code):
    name = NAMES[code]

    @njit(cache=True, error_model="numpy")
    def extremum_cpu(a, b, out, meta):
        for i in range(out.size):
            at_a, at_b = (i, i) if meta[0] == 0 else broadcast_offsets_cpu(i, meta)
            out[i] = _pick_cpu(code, a[at_a], b[at_b])

    @cuda.jit(cache=True)
    def extremum_cuda(a, b, out, meta):
        i = cuda.grid(1)
        if i < out.size:
            at_a, at_b = (i, i) if meta[0] == 0 else broadcast_offsets_cuda(i, meta)
            out[i] = _pick_cuda(code, a[at_a], b[at_b])

    @njit(cache=True, error_model="numpy")
    def extremum_grad_cpu(a, b, grad_out, grad_a, grad_b, meta):
        for i in range(grad_out.size):
            at_a, at_b = (i, i) if meta[0] == 0 else broadcast_offsets_cpu(i, meta)
            share_a, share_b = _shares_cpu(code, a[at_a], b[at_b])
            grad_a[i] = grad_out[i] * share_a
            grad_b[i] = grad_out[i] * share_b

    @cuda.jit(cache=True)
    def extremum_grad_cuda(a, b, grad_out, grad_a, grad_b, meta):
        i = cuda.grid(1)
        if i < grad_out.size:
            at_a, at_b = (i, i) if meta[0] == 0 else broadcast_offsets_cuda(i, meta)
            share_a, share_b = _shares_cuda(code, a[at_a], b[at_b])
            grad_a[i] = grad_out[i] * share_a
            grad_b[i] = grad_out[i] * share_b

    return (Kernel(name, extremum_cpu, extremum_cuda, elements(2)),
            Kernel(f"{name}_grad", extremum_grad_cpu, extremum_grad_cuda, elements(2)))


class _PairwiseExtremum(Op):
    code = None

    def check(self, a, b):
        self.shape = broadcast_shape(a.shape, b.shape, self.name)

    def forward(self, a, b):
        self.a, self.b = a, b
        self.meta = Meta(broadcast_layout(self.shape, tuple(a.shape), tuple(b.shape)))
        return run(self.kernels[0], flat(a), flat(b), Out(self.shape, a.dtype), self.meta)

    def backward(self, grad_out, grad_dst):
        grad_a, grad_b = run(self.kernels[1], flat(self.a), flat(self.b), flat(grad_out),
                             Out(self.shape, grad_out.dtype), Out(self.shape, grad_out.dtype),
                             self.meta)
        needs_a, needs_b = self.needs_input_grad
        return (sum_to_shape(grad_a, self.a.shape) if needs_a else None,
                sum_to_shape(grad_b, self.b.shape) if needs_b else None)


@register
class Maximum(_PairwiseExtremum):
    name = "maximum"
    kernels = _kernels(MAXIMUM) + (REDUCE[SUM],)


@register
class Minimum(_PairwiseExtremum):
    name = "minimum"
    kernels = _kernels(MINIMUM) + (REDUCE[SUM],)
