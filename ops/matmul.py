"""Matrix products: the ``matmul`` op and ``gemm``, the array-level GEMM every other product
calls.

CPU: BLAS (``ops.gemm.cpu``), a large product in row blocks across the engine's threads.
CUDA: our own tiled, register-blocked GEMM template (``ops.gemm.template``), whose tiling and
split-K count ``ops.gemm.choices`` picks and whose launches ``ops.gemm.plans`` makes; the
same template carries Dense's fused kernels (``ops.dense``) and the convolutions
(``ops.conv``). How a call flows from here to a kernel: ops/gemm/README.md."""
import math

import numpy as np

from ops.dispatch import Meta, Out, run
from ops.gemm.cpu import gemm_batched_cpu, gemm_split_cpu
from ops.gemm.plans import batch_meta, batched_gemm_plan, gemm_plan
from ops.gemm.tilings import PLAIN
from ops.launch import Kernel
from ops.pointwise import IDENTITY
from ops.reduce import REDUCE, SUM, sum_to_shape
from ops.registry import Op, register

# ------------------------------------------------------------------ array-level GEMM

def _gemm_plan(args):
    a, b, out, trans_a, trans_b = args
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    return gemm_plan(PLAIN, m, n, k, a.dtype, trans_a, trans_b, IDENTITY, (a, b, out))


GEMM = Kernel("gemm", gemm_split_cpu, cuda_plan=_gemm_plan)


def _batched_gemm_plan(args):
    a, b, out, batches, trans_a, trans_b = args
    k = a.shape[1] if trans_a else a.shape[2]
    return batched_gemm_plan(out.shape[1], out.shape[2], k, a.dtype, trans_a, trans_b,
                             (a, b, out, batches))


BATCHED_GEMM = Kernel("gemm_batched", gemm_batched_cpu, cuda_plan=_batched_gemm_plan)


def batched_gemm(a, b, batch_shape, a_batch, b_batch, trans_a=False, trans_b=False):
    """``op(a[i]) @ op(b[j])`` for every batch of ``batch_shape``: a (Ba, ., .) and b (Bb,
    ., .) C-contiguous stacks of matrices whose batch shapes ``a_batch``, ``b_batch``
    broadcast to ``batch_shape`` (torch.matmul's rule); one launch on CUDA. Returns the
    (prod(batch_shape), M, N) stack."""
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    meta = batch_meta(batch_shape, _matrix_strides(a_batch, len(batch_shape)),
                      _matrix_strides(b_batch, len(batch_shape)))
    return run(BATCHED_GEMM, a, b, Out((math.prod(batch_shape), m, n), a.dtype, flat=False),
               Meta(meta), bool(trans_a), bool(trans_b))


def _matrix_strides(batch, rank):
    """An operand's strides along the broadcast batch dims, in whole matrices (0 where it
    is broadcast: a missing or size-1 dim)."""
    batch = (1,) * (rank - len(batch)) + tuple(batch)
    strides, step = [], 1
    for size in reversed(batch):
        strides.append(step if size != 1 else 0)
        step *= size
    return tuple(reversed(strides))


def gemm(a, b, trans_a=False, trans_b=False, out=None):
    """``op(a) @ op(b)`` for 2-D arrays of one device and dtype, ``op`` a transpose when asked.

    ``out`` (C-contiguous, the right shape) receives the result when given."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul: gemm takes 2-D arrays, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k_b:
        raise ValueError(f"matmul: inner dimensions differ: {_described(a, trans_a)} @ "
                         f"{_described(b, trans_b)}")
    flags = (bool(trans_a), bool(trans_b))
    if out is None:
        return run(GEMM, a, b, Out((m, n), a.dtype, flat=False), *flags)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"matmul: output buffer has shape {tuple(out.shape)}, expected {(m, n)}")
    run(GEMM, a, b, out, *flags)
    return out


def _described(x, transposed):
    return f"{tuple(x.shape)}" + ("ᵀ" if transposed else "")


# ------------------------------------------------------------------ the op

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
        self.batched = len(b_m) > 2
        if self.batched:
            self.batch = np.broadcast_shapes(a_m[:-2], b_m[:-2])
            self.a_batch, self.b_batch = a_m[:-2], b_m[:-2]
            self.a3 = a.reshape((math.prod(a_m[:-2]),) + a_m[-2:])   # C-contiguous: views
            self.b3 = b.reshape((math.prod(b_m[:-2]),) + b_m[-2:])
            out = batched_gemm(self.a3, self.b3, self.batch, self.a_batch, self.b_batch)
            shape = self.batch + (a_m[-2], b_m[-1])
        else:
            self.a2 = a.reshape(math.prod(a_m[:-1]), a_m[-1])
            self.b = b.reshape(b_m)
            out = gemm(self.a2, self.b)
            shape = a_m[:-1] + (b_m[1],)
        self.out_shape = shape
        return out.reshape(tuple(s for i, s in enumerate(shape)
                                 if i - len(shape) not in dropped))

    def backward(self, grad_out, grad_dst):
        if self.batched:
            return self._batched_backward(grad_out)
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

    def _batched_backward(self, grad_out):
        """Each gradient over the whole batch in one batched GEMM, then summed over the
        batches its operand was broadcast along."""
        needs_a, needs_b = self.needs_input_grad
        batch, count = self.batch, math.prod(self.batch)
        g = grad_out.reshape((count,) + self.out_shape[-2:])
        grad_a = grad_b = None
        if needs_a:   # dA = G @ Bᵀ
            full = batched_gemm(g, self.b3, batch, batch, self.b_batch, trans_b=True)
            grad_a = _summed(full, batch, self.a_batch, self.a_shape)
        if needs_b:   # dB = Aᵀ @ G
            full = batched_gemm(self.a3, g, batch, self.a_batch, batch, trans_a=True)
            grad_b = _summed(full, batch, self.b_batch, self.b_shape)
        return grad_a, grad_b


def _summed(full, batch, operand_batch, shape):
    """The (prod(batch), r, c) gradient summed down to its operand's ``shape``."""
    full = full.reshape(batch + tuple(full.shape[1:]))
    if tuple(operand_batch) != tuple(batch):
        full = sum_to_shape(full, tuple(operand_batch) + tuple(full.shape[-2:]))
    return full.reshape(shape)
