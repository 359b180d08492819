"""torch.matmul's batched products: every (a[i], b[j]) pair of broadcast batch dims in one
launch of the GEMM template (``ops.gemm.plans.batched_gemm_plan``: ``blockIdx.z`` the batch,
each operand's batch stride in whole matrices, 0 where it is broadcast), one BLAS call per
product on the CPU (``ops.gemm.cpu.gemm_batched_cpu``). ``ops.matmul.MatMul`` runs
``BatchedProduct`` when b has batch dims."""
import math

import numpy as np

from ops.dispatch import Meta, Out, run
from ops.gemm.cpu import gemm_batched_cpu
from ops.gemm.batches import batch_meta
from ops.gemm.plans import batched_gemm_plan
from ops.launch import Kernel
from ops.reduce import sum_to_shape


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


class BatchedProduct:
    """A (..., M, K) @ (..., K, N) product whose batch dims broadcast: its forward, and the
    backward from what the forward kept (the operands as C-contiguous stacks: views)."""

    def __init__(self, a, b, a_m, b_m):
        self.batch = np.broadcast_shapes(a_m[:-2], b_m[:-2])
        self.a_batch, self.b_batch = a_m[:-2], b_m[:-2]
        self.a_shape, self.b_shape = tuple(a.shape), tuple(b.shape)
        self.a3 = a.reshape((math.prod(a_m[:-2]),) + a_m[-2:])
        self.b3 = b.reshape((math.prod(b_m[:-2]),) + b_m[-2:])
        self.out_shape = self.batch + (a_m[-2], b_m[-1])

    def forward(self):
        """``(out, shape)``: the (prod(batch), M, N) stack and the product's shape."""
        return (batched_gemm(self.a3, self.b3, self.batch, self.a_batch, self.b_batch),
                self.out_shape)

    def backward(self, grad_out, needs_a, needs_b):
        """Each gradient over the whole batch in one batched GEMM, then summed over the
        batches its operand was broadcast along."""
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
