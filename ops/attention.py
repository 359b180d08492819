"""Scaled dot-product attention (torch's ``F.scaled_dot_product_attention``), the CPU side and
the op; the CUDA kernels are ``ops.attention_cuda``'s.

For each of ``bh`` (batch x heads) slices, queries Q (Tq, d), keys K (Tk, d) and values V
(Tk, dv), with ``s`` the scale (default ``1 / sqrt(d)``), M the additive mask (a boolean mask
becomes 0 / -inf; ``is_causal`` keeps key j for query i when j <= i) and D the dropout mask
(element kept with probability 1 - p, scaled by 1 / (1 - p), from the hash of its index and
the call's device seed as ``ops.dropout``):

    S = s Q Kᵀ + M,   P = softmax(S) by rows,   O = (P ∘ D) V,   lse_i = log Σ_j exp S_ij

Backward, from dO, with P recomputed from S and the saved ``lse`` (no T x T matrix kept):

    dP = D ∘ (dO Vᵀ),   Δ_i = Σ_j P_ij dP_ij (= dO_i · O_i),   dS = P ∘ (dP - Δ)
    dQ = s dS K,   dK = s dSᵀ Q,   dV = (P ∘ D)ᵀ dO

The CPU splits the bh slices into one block per engine thread (``ops.cpu_threads.
slice_blocks``) and walks query tiles of ``CPU_TILE`` rows, a block's slices at once: the
products are NumPy's batched BLAS calls (one tile's scores, ``slices x tile x keys``, are the
only scores in memory; under ``is_causal`` a tile scores only the keys up to its last query);
the softmax is one ``@njit`` row pass (``_probability_rows``: the float32 maximum, a
vectorisable exp, row sums in float64 lanes, the dropout factors), which the backward runs
again from the saved ``lse``; its ``dS = s P ∘ (dP - Δ)`` is one more. dK and dV add the
tiles in order, each slice in one block, so results repeat bit for bit on any thread count. A row
whose every key is masked gives NaN, as torch. A float mask that requires grad gets dM = dS
(the scores' gradient before the scale), summed over the dims it was broadcast along: the CPU
stores each tile's dS, the CUDA dQ kernel each (query, key) element its thread owns; the sum
is a fixed-order reduction.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ops.attention_cuda import backward_plan, forward_plan
from ops.cpu_threads import numpy_blas_on_one_thread, run_blocks, slice_blocks
from ops.device import device_of, to_host
from ops.dispatch import Out, run
from ops.dropout import _keep_cpu
from ops.gelu_cpu import exp_nonpositive_float32
from ops.launch import CPU_KERNEL, Kernel
from ops.layout import flat
from ops.memory import empty
from ops.reduce import REDUCE, SUM, reduce
from ops.registry import Op, register

CPU_TILE = 64   # query rows a CPU pass scores at once
SCORE_FLOOR = -100.0   # a shifted score below it (a masked key's -inf) has e^score 0 in float32


def exp_nonpositive(a):
    """e^a for a <= 0 or -inf (a softmax's shifted score) in the dtype of ``a``."""


@overload(exp_nonpositive, inline="always")
def _exp_nonpositive(a):
    if a == types.float32:   # vectorisable (ops.gelu_cpu); -inf is clamped (NaN stays NaN)
        floor = np.float32(SCORE_FLOOR)
        return lambda a: exp_nonpositive_float32(floor if a < floor else a)
    return lambda a: math.exp(a)


# "reassoc" lets LLVM sum a row in vector lanes (a fixed order of this code: the same bits on
# every run and thread count); with the vectorisable exp, the softmax of the GPT's 48x64x64
# scores took 130 us in one pass against 405 for the three passes around NumPy's exp
_ROW_PASS = dict(CPU_KERNEL, nogil=True, error_model="numpy", fastmath={"reassoc"})


@njit(inline="always")
def _scaled_row(row, keys, mask, mask_strides, b, i, scale):
    """Row ``i`` of slice ``b`` in place over its first ``keys`` keys: ``s · score + M``;
    returns its maximum (in the row's dtype: a float64 maximum made the exp float64, 9x
    slower)."""
    for j in range(keys):
        row[j] *= scale
    if mask.size:
        for j in range(keys):
            row[j] += mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]]
    return _row_max(row, keys)


@njit(**CPU_KERNEL, nogil=True, fastmath={"nnan", "reassoc", "nsz"})
def _row_max(row, keys):
    """max(row[:keys]), -inf for none, in vector lanes ("nnan": a NaN among the scores is
    passed on by the exp that follows, not by this maximum)."""
    top = row.dtype.type(-np.inf)
    for j in range(keys):
        top = max(top, row[j])
    return top


@njit(inline="always")
def _exponentiated_row(row, keys, top, shift):
    """``row[:keys] = e^(row - top + shift)`` (``top`` the row's maximum), 0 beyond."""
    for j in range(keys):
        row[j] = exp_nonpositive(row[j] - top + shift)
    row[keys:] = 0


@njit(**_ROW_PASS)
def _probability_rows(scores, mask, mask_strides, first_slice, first_query, tq, tk, scale,
                      causal, lse, from_lse, seed, threshold, keep_scale, dropout):
    """In place, row by row of the tile (slices, t, keys), slices from ``first_slice``: P =
    softmax(s · score + M) by rows, 0 at the keys causality hides. The forward
    (``from_lse`` False) normalises each row, writes its logsumexp into ``lse`` (bh * tq)
    and with ``dropout`` multiplies each element by its factor of D (kept: ``keep_scale``,
    else 0; ``ops.dropout``'s test of the flat (bh, tq, tk) score index, as on CUDA); the
    backward makes P again from the saved ``lse`` as ``exp(s · score + M - lse)`` (the row
    less its maximum first, as the forward exponentiates it)."""
    slices, tile, width = scores.shape
    for b in range(slices):
        for r in range(tile):
            i, row = first_query + r, scores[b, r]
            flat_row = (first_slice + b) * tq + i
            keys = min(width, i + 1) if causal else width
            top = _scaled_row(row, keys, mask, mask_strides, first_slice + b, i, scale)
            if from_lse:
                _exponentiated_row(row, keys, top, row.dtype.type(top - lse[flat_row]))
                continue
            _exponentiated_row(row, keys, top, top - top)
            total = 0.0
            for j in range(keys):
                total += row[j]
            inverse = row.dtype.type(1.0 / total) if total > 0 else row.dtype.type(np.nan)
            for j in range(keys):
                row[j] *= inverse
            lse[flat_row] = top + np.log(total) if total > 0 else np.nan
            if dropout:
                _apply_dropout(row, flat_row * tk, seed, threshold, keep_scale)


@njit(**_ROW_PASS)
def _score_gradients(probs, grad_scores, scale):
    """In place, row by row: ``dS = (dP - Δ) ∘ P ∘ s`` with ``Δ = Σ_j P dP`` summed in
    float64 (``grad_scores`` holds dP, already times D under dropout)."""
    slices, tile, width = probs.shape
    for b in range(slices):
        for r in range(tile):
            p, g = probs[b, r], grad_scores[b, r]
            delta = 0.0
            for j in range(width):
                delta += np.float64(p[j]) * np.float64(g[j])
            delta_t = g.dtype.type(delta)
            for j in range(width):
                g[j] = (g[j] - delta_t) * p[j] * scale


@njit(inline="always", error_model="numpy")
def _apply_dropout(row, base, seed, threshold, keep_scale):
    for j in range(row.size):
        row[j] = row[j] * keep_scale if _keep_cpu(base + j, seed[0], threshold) else 0.0


@njit(**CPU_KERNEL, nogil=True, error_model="numpy")
def _dropout_factors(factors, first_slice, first_query, tq, tk, seed, threshold, keep_scale):
    """``factors`` (slices, t, keys) = D of the tile's rows from ``first_query``."""
    slices, tile, _ = factors.shape
    for b in range(slices):
        for r in range(tile):
            row = factors[b, r]
            row[:] = 1.0
            _apply_dropout(row, ((first_slice + b) * tq + first_query + r) * tk, seed,
                           threshold, keep_scale)


def _views(q, k, v, sizes):
    bh, tq, tk, d, dv = sizes
    return (q.reshape(bh, tq, d), k.reshape(bh, tk, d), v.reshape(bh, tk, dv))


def _tiles(tq, tk, causal):
    """``(start, stop, keys)`` of each query tile: causality hides the keys from ``stop`` on
    (torch's is_causal: query i sees keys 0..i), which are neither scored nor summed."""
    for start in range(0, tq, CPU_TILE):
        stop = min(start + CPU_TILE, tq)
        yield start, stop, min(stop, tk) if causal else tk


def _in_slice_blocks(function, sizes, *arrays_and_scalars):
    """``function(first, last, ...)`` over blocks of the bh slices, one per engine thread
    when the work pays for the hand-off (``ops.cpu_threads.slice_blocks``): each slice is
    computed as in one call, so the bits do not depend on the thread count."""
    bh, tq, tk, d, dv = sizes
    blocks = slice_blocks(bh, bh * tq * tk * (d + dv))
    if blocks is None:
        function(0, bh, *arrays_and_scalars)
    else:
        run_blocks([(function, (first, last, *arrays_and_scalars)) for first, last in blocks])


def attention_cpu(q, k, v, mask, seed, out, lse, sizes, mask_strides, scale, causal,
                  threshold, keep_scale, dropout):
    numpy_blas_on_one_thread()
    _in_slice_blocks(_attention_slices, sizes, q, k, v, mask, seed, out, lse, sizes,
                     mask_strides, q.dtype.type(scale), causal, threshold, keep_scale, dropout)


def _attention_slices(first, last, q, k, v, mask, seed, out, lse, sizes, mask_strides, scale,
                      causal, threshold, keep_scale, dropout):
    bh, tq, tk, d, dv = sizes
    q3, k3, v3 = (a[first:last] for a in _views(q, k, v, sizes))
    out3 = out.reshape(bh, tq, dv)[first:last]
    keys_t = k3.transpose(0, 2, 1)
    for start, stop, keys in _tiles(tq, tk, causal):
        probs = np.matmul(q3[:, start:stop], keys_t[:, :, :keys])
        _probability_rows(probs, mask, mask_strides, first, start, tq, tk, scale, causal, lse,
                          False, seed, threshold, keep_scale, dropout)
        np.matmul(probs, v3[:, :keys], out=out3[:, start:stop])


def attention_grad_cpu(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k, grad_v,
                       grad_mask, sizes, mask_strides, scale, causal, threshold, keep_scale,
                       dropout):
    numpy_blas_on_one_thread()
    _in_slice_blocks(_attention_grad_slices, sizes, q, k, v, mask, seed, lse, grad_out, grad_q,
                     grad_k, grad_v, grad_mask, sizes, mask_strides, q.dtype.type(scale), causal,
                     threshold, keep_scale, dropout)


def _attention_grad_slices(first, last, q, k, v, mask, seed, lse, grad_out, grad_q, grad_k,
                           grad_v, grad_mask, sizes, mask_strides, scale, causal, threshold,
                           keep_scale, dropout):
    bh, tq, tk, d, dv = sizes
    q3, k3, v3 = (a[first:last] for a in _views(q, k, v, sizes))
    g3 = grad_out.reshape(bh, tq, dv)[first:last]
    dq3, dk3, dv3 = (grad_q.reshape(bh, tq, d)[first:last], grad_k.reshape(bh, tk, d)[first:last],
                     grad_v.reshape(bh, tk, dv)[first:last])
    keys_t, values_t = k3.transpose(0, 2, 1), v3.transpose(0, 2, 1)
    one = scale.dtype.type(1)
    dk3[:] = 0   # each tile adds into the keys it sees, in order: the same bits every run
    dv3[:] = 0
    for start, stop, keys in _tiles(tq, tk, causal):
        probs = np.matmul(q3[:, start:stop], keys_t[:, :, :keys])
        _probability_rows(probs, mask, mask_strides, first, start, tq, tk, scale, causal, lse,
                          True, seed, threshold, keep_scale, False)
        grad_scores = np.matmul(g3[:, start:stop], values_t[:, :, :keys])   # dO Vᵀ
        dropped = probs
        if dropout:
            factors = np.empty_like(probs)
            _dropout_factors(factors, first, start, tq, tk, seed, threshold, keep_scale)
            grad_scores *= factors
            dropped = probs * factors
        if grad_mask.size:   # dM = dS before the scale, each (slice, query, key) once
            _score_gradients(probs, grad_scores, one)
            tile_mask = grad_mask.reshape(bh, tq, tk)[first:last, start:stop]
            tile_mask[:, :, :keys] = grad_scores
            tile_mask[:, :, keys:] = 0
            grad_scores *= scale
        else:
            _score_gradients(probs, grad_scores, scale)
        np.matmul(grad_scores, k3[:, :keys], out=dq3[:, start:stop])
        dk3[:, :keys] += np.matmul(grad_scores.transpose(0, 2, 1), q3[:, start:stop])
        dv3[:, :keys] += np.matmul(dropped.transpose(0, 2, 1), g3[:, start:stop])


# the compiled kernels behind each CPU side (tests/ops/test_registry.py looks for them)
attention_cpu.__wrapped__ = _probability_rows
attention_grad_cpu.__wrapped__ = _probability_rows

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
        out, self.lse = run(ATTENTION, flat(q), flat(k), flat(v), flat(mask), seed,
                            Out((bh, tq, dv), q.dtype), Out((bh * tq,), np.float64),
                            self.sizes, *self._scalars())
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
                   *self._scalars())

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
