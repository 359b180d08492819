"""Elementwise maximum and minimum of two arrays, with NumPy broadcasting (torch.maximum,
torch.minimum; ``engine.max(a, b)`` with a Tensor ``b`` is this, as torch's ``max(a, b)``).

NaN wins, as in torch and NumPy: either operand NaN gives NaN. The gradient follows torch's
rule: ``grad_out`` goes to the larger (maximum) or smaller (minimum) operand, split in halves
where the two are equal, and to both where a NaN made the comparison false; each input's
share is summed back to its shape. One backward kernel writes both shares at the output's
shape, reading the inputs through the broadcast layout.
"""
from numba import njit

from ops.cuda import cuda
from ops.dispatch import Meta, Out, run
from ops.launch import Kernel, elements
from ops.layout import broadcast_layout, broadcast_offsets_cpu, broadcast_offsets_cuda, \
    broadcast_shape, flat
from ops.reduce import REDUCE, SUM, sum_to_shape
from ops.registry import Op, register
from ops.twin import twin

MAXIMUM, MINIMUM = 0, 1
NAMES = {MAXIMUM: "maximum", MINIMUM: "minimum"}


def _pick(code, x, y):
    """max(x, y) or min(x, y); NaN when either is NaN."""
    if x != x:
        return x
    if code == MAXIMUM:
        return x if x > y else y
    return x if x < y else y


def _share_of_x(code, x, y):
    """The part of grad_out that goes to ``x`` (torch's rule: 1, 1/2 on a tie, 0 where
    ``y`` wins; 1 when a NaN makes every comparison false)."""
    if x == y:
        return 0.5
    loses = x < y if code == MAXIMUM else x > y
    return 0.0 if loses else 1.0


_pick_cpu, _pick_cuda = twin(_pick)
_share_cpu, _share_cuda = twin(_share_of_x)


def _kernels(code):
    name = NAMES[code]

    @njit(cache=True, error_model="numpy")
    def forward_cpu(a, b, out, meta):
        for i in range(out.size):
            at_a, at_b = broadcast_offsets_cpu(i, meta)
            out[i] = _pick_cpu(code, a[at_a], b[at_b])

    @cuda.jit(cache=True)
    def forward_cuda(a, b, out, meta):
        i = cuda.grid(1)
        if i < out.size:
            at_a, at_b = broadcast_offsets_cuda(i, meta)
            out[i] = _pick_cuda(code, a[at_a], b[at_b])

    @njit(cache=True, error_model="numpy")
    def backward_cpu(a, b, grad_out, grad_a, grad_b, meta):
        for i in range(grad_out.size):
            at_a, at_b = broadcast_offsets_cpu(i, meta)
            x, y = a[at_a], b[at_b]
            grad_a[i] = grad_out[i] * _share_cpu(code, x, y)
            grad_b[i] = grad_out[i] * _share_cpu(code, y, x)

    @cuda.jit(cache=True)
    def backward_cuda(a, b, grad_out, grad_a, grad_b, meta):
        i = cuda.grid(1)
        if i < grad_out.size:
            at_a, at_b = broadcast_offsets_cuda(i, meta)
            x, y = a[at_a], b[at_b]
            grad_a[i] = grad_out[i] * _share_cuda(code, x, y)
            grad_b[i] = grad_out[i] * _share_cuda(code, y, x)

    return (Kernel(name, forward_cpu, forward_cuda, elements(2)),
            Kernel(f"{name}_grad", backward_cpu, backward_cuda,
                   lambda a, b, grad_out, *rest: grad_out.size))


KERNELS = {code: _kernels(code) for code in NAMES}


class _Extremum(Op):
    code = None

    def check(self, a, b):
        self.shape = broadcast_shape(a.shape, b.shape, self.name)

    def forward(self, a, b):
        self.a, self.b = a, b
        self.meta = Meta(broadcast_layout(self.shape, tuple(a.shape), tuple(b.shape)))
        forward, _ = KERNELS[self.code]
        return run(forward, flat(a), flat(b), Out(self.shape, a.dtype), self.meta)

    def onnx(self, graph, inputs):   # ONNX's Max and Min broadcast as NumPy does
        return graph.node(self.name[:3].capitalize(), inputs)

    def backward(self, grad_out, grad_dst):
        _, backward = KERNELS[self.code]
        dtype = self.a.dtype
        grad_a, grad_b = run(backward, flat(self.a), flat(self.b), flat(grad_out),
                             Out(self.shape, dtype), Out(self.shape, dtype), self.meta)
        needs_a, needs_b = self.needs_input_grad
        return (sum_to_shape(grad_a, self.a.shape) if needs_a else None,
                sum_to_shape(grad_b, self.b.shape) if needs_b else None)


@register
class Maximum(_Extremum):
    name, code = "maximum", MAXIMUM
    kernels = KERNELS[MAXIMUM] + (REDUCE[SUM],)


@register
class Minimum(_Extremum):
    name, code = "minimum", MINIMUM
    kernels = KERNELS[MINIMUM] + (REDUCE[SUM],)
