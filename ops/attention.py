"""Scaled dot-product attention (torch's ``F.scaled_dot_product_attention``): the math and the
op.

For each of ``bh`` (batch x heads) slices, queries Q (Tq, d), keys K (Tk, d) and values V
(Tk, dv), with ``s`` the scale (default ``1 / sqrt(d)``), M the additive mask (a boolean mask
becomes 0 / -inf; ``is_causal`` keeps key j for query i when j <= i) and D the dropout mask
(element kept with probability 1 - p, scaled by 1 / (1 - p), from the hash of its index and
the call's device seed as ``ops.dropout``):

    S = s Q Kᵀ + M,   P = softmax(S) by rows,   O = (P ∘ D) V,   lse_i = log Σ_j exp S_ij

Backward, from dO, with P recomputed from S and the saved ``lse`` (no T x T matrix kept; the
CPU keeps the forward's P instead where it is small, ``ops.attention_cpu.SAVED_PROBS_BYTES``):

    dP = D ∘ (dO Vᵀ),   Δ_i = Σ_j P_ij dP_ij (= dO_i · O_i),   dS = P ∘ (dP - Δ)
    dQ = s dS K,   dK = s dSᵀ Q,   dV = (P ∘ D)ᵀ dO

The CPU kernels are ``ops.attention_cpu``'s (a blocked loop with the same math); the CUDA
kernels ``ops.attention_cuda``'s.
"""
import numpy as np

from ops.attention_cpu import attention_cpu, attention_grad_cpu, saved_probs_size
from ops.attention_cuda import backward_plan, forward_plan
from ops.device import device_of, to_host
from ops.dispatch import Out, run
from ops.launch import Kernel
from ops.layout import flat
from ops.memory import empty
from ops.reduce import REDUCE, SUM, reduce
from ops.registry import Op, register

ATTENTION = Kernel("attention", attention_cpu, cuda_plan=forward_plan)
ATTENTION_GRAD = Kernel("attention_grad", attention_grad_cpu, cuda_plan=backward_plan)


@register
class AttentionOp(Op):
    """Inputs ``(q, k, v, mask, seed)``: q (bh, Tq, d), k (bh, Tk, d), v (bh, Tk, dv) as 3-D
    arrays, ``mask`` a float additive mask read through ``mask_strides`` (an empty array for
    none) and ``seed`` a one-element int64 array; params ``scale``, ``causal``,
    ``mask_strides`` and ``dropout_p``. A float mask that requires grad gets one, the seed
    none."""
    name = "attention"
    kernels = (ATTENTION, ATTENTION_GRAD, REDUCE[SUM])
    integer_inputs = (4,)

    def check(self, q, k, v, mask, seed):
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or q.shape[0] != k.shape[0] \
                or k.shape[0] != v.shape[0] or q.shape[2] != k.shape[2] \
                or k.shape[1] != v.shape[1]:
            raise ValueError(f"scaled_dot_product_attention: expects q (bh, Tq, d), k (bh, Tk, "
                             f"d), v (bh, Tk, dv), got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        self.sizes = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2])

    def _scalars(self):
        p = self.params["dropout_p"]
        return (self.params["mask_strides"], float(self.params["scale"]),
                bool(self.params["causal"]), int(round(p * 2 ** 32)),
                float(0.0 if p >= 1 else 1.0 / (1.0 - p)), p > 0)

    def forward(self, q, k, v, mask, seed):
        bh, tq, tk, d, dv = self.sizes
        scalars = self._scalars()
        _, _, causal, _, _, dropout = scalars
        kept = (saved_probs_size(self.sizes, causal, q.itemsize, dropout)
                if device_of(q) == "cpu" and any(self.needs_input_grad) else 0)
        out, self.lse, self.probs = run(
            ATTENTION, flat(q), flat(k), flat(v), flat(mask), seed, Out((bh, tq, dv), q.dtype),
            Out((bh * tq,), np.float64), self.sizes, *scalars, Out((kept,), q.dtype))
        self.saved = (q, k, v, mask, seed, out)
        return out

    def onnx(self, graph, inputs):   # its composition: softmax(q kᵀ scale + mask) v
        bh, tq, tk, _, _ = self.sizes
        mask_strides, scale, causal, _, _, dropout = self._scalars()
        if dropout:
            graph.refuse("attention with dropout (training mode); export runs eval mode")
        q, k, v = inputs[:3]
        scores = graph.node("MatMul", [q, graph.node("Transpose", [k], perm=[0, 2, 1])])
        scores = graph.node("Mul", [scores, graph.constant(scale, "attention.scale")])
        if causal:   # torch's is_causal: query i sees keys 0..i (from the top left)
            mask = np.triu(np.full((tq, tk), -np.inf, graph.dtype), 1)   # for every slice
        elif self.saved[3].size:
            mask = np.zeros((bh, tq, tk), graph.dtype)   # the additive mask as the kernel reads it
            given = np.ascontiguousarray(to_host(self.saved[3]))
            mask += np.lib.stride_tricks.as_strided(
                given, (bh, tq, tk), [s * given.itemsize for s in mask_strides])
        if causal or self.saved[3].size:
            scores = graph.node("Add", [scores, graph.constant(mask, "attention.mask")])
        return graph.node("MatMul", [graph.node("Softmax", [scores], axis=-1), v])

    def _run_grad(self, grad_out, grad_q, grad_k, grad_v, grad_mask):
        """The backward kernels into the given gradients (arrays or ``Out`` placeholders)."""
        q, k, v, mask, seed, out = self.saved
        return run(ATTENTION_GRAD, flat(q), flat(k), flat(v), flat(mask), seed, self.lse,
                   flat(out), flat(grad_out), grad_q, grad_k, grad_v, grad_mask, self.sizes,
                   *self._scalars(), self.probs)

    def backward(self, grad_out, grad_dst):
        q, k, v, mask = self.saved[:4]
        bh, tq, tk, _, _ = self.sizes
        mask_grad = self.needs_input_grad[3] and mask.size > 0
        grad_mask = (Out((bh, tq, tk), q.dtype) if mask_grad else
                     empty((0,), q.dtype, device_of(q)))
        grads = self._run_grad(grad_out, Out(q.shape, q.dtype), Out(k.shape, k.dtype),
                               Out(v.shape, v.dtype), grad_mask)
        if not mask_grad:
            return (*grads, None, None)
        *grads, full = grads
        # the dims the mask's strides do not walk were broadcast: summed, in a fixed order
        axes = tuple(axis for axis, stride in enumerate(self.params["mask_strides"])
                     if stride == 0)
        summed = reduce(SUM, full, axes, keepdims=True) if axes else full
        return (*grads, summed.reshape(mask.shape), None)


def _thirds(array):
    """q, k and v: the three flat (contiguous) slices of a (3, ...) array, as views."""
    whole = flat(array)
    n = whole.size // 3
    return whole[:n], whole[n:2 * n], whole[2 * n:]


@register
class PackedAttentionOp(AttentionOp):
    """``AttentionOp`` without a mask over one array ``qkv`` (3, bh, T, d) holding q, k and
    v, as multi-head attention's projection gives them permuted once: the kernels read its
    three slices, and its gradient is one array the backward's kernels write the three
    gradients into. The slices taken by indexing ops instead each had a zero-filled gradient
    of the whole array, which the tape then summed (the GPT's H200 step: 18 fills, 12 adds
    and 18 copies). Inputs ``(qkv, seed)``; params as AttentionOp's."""
    name = "packed_attention"
    kernels = (ATTENTION, ATTENTION_GRAD)
    integer_inputs = (1,)

    def check(self, qkv, seed):
        if qkv.ndim != 4 or qkv.shape[0] != 3:
            raise ValueError(f"packed attention: expects qkv (3, bh, T, d), got "
                             f"{tuple(qkv.shape)}")
        _, bh, t, d = qkv.shape
        self.sizes = (bh, t, t, d, d)

    def forward(self, qkv, seed):
        nothing = empty((0,), qkv.dtype, device_of(qkv))
        return super().forward(*_thirds(qkv), nothing, seed)

    def onnx(self, graph, inputs):
        thirds = [graph.node("Gather", [inputs[0], graph.constant(np.int64(n), "qkv.index")],
                             axis=0) for n in range(3)]
        return super().onnx(graph, thirds)

    def backward(self, grad_out, grad_dst):
        q = self.saved[0]
        bh, t, _, d, _ = self.sizes
        grad = empty((3, bh, t, d), q.dtype, device_of(q))
        self._run_grad(grad_out, *_thirds(grad), empty((0,), q.dtype, device_of(q)))
        return grad, None
