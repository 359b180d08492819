"""Matrix products: the ``matmul`` op and ``gemm``, the array-level GEMM every other product calls.

CPU: BLAS (``ops.gemm.cpu``), a large product in row blocks across the engine's threads.
CUDA: our own tiled, register-blocked GEMM template (``ops.gemm.template``), whose tiling and
split-K count ``ops.gemm.choices`` picks and whose launches ``ops.gemm.plans`` makes; the
same template carries Dense's fused kernels (``ops.dense``) and the convolutions
(``ops.conv``); batched products are ``ops.batched_matmul``'s. How a call flows from here
to a kernel: ops/gemm/README.md."""
import math

import numpy as np

from ops.batched_matmul import BATCHED_GEMM, BatchedProduct
from ops.dispatch import Out, run
from ops.gemm.cpu import gemm_split_cpu
from ops.gemm.plans import gemm_plan
from ops.gemm.tilings import PLAIN
from ops.launch import Kernel
from ops.pointwise import IDENTITY
from ops.reduce import REDUCE, SUM
from ops.registry import Op, register


def _gemm_plan(args):
    a, b, out, trans_a, trans_b = args
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    return gemm_plan(PLAIN, m, n, k, a.dtype, trans_a, trans_b, IDENTITY, (a, b, out))


GEMM = Kernel("gemm", gemm_split_cpu, cuda_plan=_gemm_plan)


def gemm(a, b, trans_a=False, trans_b=False, out=None):
    """``op(a) @ op(b)`` for 2-D arrays of one device and dtype, ``op`` a transpose when asked.

    ``out`` (C-contiguous, the right shape) receives the result when given."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul: gemm takes 2-D arrays, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k_b:
        raise ValueError(f"matmul: inner dimensions differ: {tuple(a.shape)}{'ᵀ' * bool(trans_a)} @ "
                         f"{tuple(b.shape)}{'ᵀ' * bool(trans_b)}")
    flags = (bool(trans_a), bool(trans_b))
    if out is None:
        return run(GEMM, a, b, Out((m, n), a.dtype, flat=False), *flags)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: output buffer has shape {tuple(out.shape)}, expected {(m, n)}")
    run(GEMM, a, b, out, *flags)
    return out


@register
class MatMul(Op):
    """``a @ b`` with torch.matmul's rules: a 1-D operand is a row (a) or a column (b), its
    dim dropped from the result; a (..., K) @ (K, N) product is one GEMM over a's rows;
    otherwise the batch dims broadcast and every product runs in one batched GEMM. The
    backward runs the transposed products, summing a broadcast operand's gradient over the
    batches it was broadcast along (a fixed-order reduction: no float atomics)."""
    name = "matmul"
    kernels = (GEMM, BATCHED_GEMM, REDUCE[SUM])

    def onnx(self, graph, inputs):   # ONNX's MatMul: numpy.matmul's rules, torch.matmul's
        return graph.node("MatMul", inputs)

    def check(self, a, b):
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if not a_shape or not b_shape:
            raise ValueError(f"matmul: both operands need at least 1 dim, got shapes "
                             f"{a_shape} and {b_shape} (multiply by a scalar with *)")
        k_b = b_shape[0] if len(b_shape) == 1 else b_shape[-2]
        if a_shape[-1] != k_b:
            raise ValueError(f"matmul: inner dimensions differ: {a_shape} @ {b_shape} (a's "
                             f"last dim {a_shape[-1]} against b's "
                             f"{'only' if len(b_shape) == 1 else 'second-to-last'} {k_b})")
        try:
            np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
        except ValueError:
            raise ValueError(f"matmul: the batch dims of {a_shape} @ {b_shape} do not "
                             f"broadcast ({a_shape[:-2]} against {b_shape[:-2]})") from None

    def forward(self, a, b):
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        self.a_shape, self.b_shape = a_shape, b_shape
        a_m = a_shape if len(a_shape) > 1 else (1,) + a_shape     # a row
        b_m = b_shape if len(b_shape) > 1 else b_shape + (1,)     # a column
        dropped = (() if len(a_shape) > 1 else (-2,)) + (() if len(b_shape) > 1 else (-1,))
        self.batched = BatchedProduct(a, b, a_m, b_m) if len(b_m) > 2 else None
        if self.batched:
            out, shape = self.batched.forward()
        else:
            self.a2 = a.reshape(math.prod(a_m[:-1]), a_m[-1])
            self.b = b.reshape(b_m)
            out = gemm(self.a2, self.b)
            shape = a_m[:-1] + (b_m[1],)
        return out.reshape(tuple(s for i, s in enumerate(shape)
                                 if i - len(shape) not in dropped))

    def backward(self, grad_out, grad_dst):
        if self.batched:
            return self.batched.backward(grad_out, *self.needs_input_grad)
        needs_a, needs_b = self.needs_input_grad
        g = grad_out.reshape(self.a2.shape[0], self.b.shape[1])
        grad_a = grad_b = None
        if needs_a:   # dA = G @ Bᵀ
            dst = grad_dst[0].reshape(self.a2.shape) if grad_dst[0] is not None else None
            grad_a = gemm(g, self.b, trans_b=True, out=dst)
            grad_a = grad_dst[0] if dst is not None else grad_a.reshape(self.a_shape)
        if needs_b:   # dB = Aᵀ @ G: a broadcast b's batches are a's rows, part of K
            dst = grad_dst[1].reshape(self.b.shape) if grad_dst[1] is not None else None
            grad_b = gemm(self.a2, g, trans_a=True, out=dst)
            grad_b = grad_dst[1] if dst is not None else grad_b.reshape(self.b_shape)
        return grad_a, grad_b


