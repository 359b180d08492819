"""Scaled dot-product attention's CPU kernels (``ops.attention`` has the math and the op).

The bh slices are split into one block per engine thread (``ops.cpu_threads.slice_blocks``),
and each block walks query tiles of ``CPU_TILE`` rows, its slices at once (the backward in
chunks of slices whose temporaries stay in a core's L2, ``GRAD_CHUNK_BYTES``): the products
are NumPy's batched BLAS calls on contiguous operands (one tile's scores, ``slices x tile x
keys``, are the only scores in memory; under ``is_causal`` a tile scores only the keys up to
its last query);
the softmax is one ``@njit`` row pass (``_probability_rows``: the float32 maximum, a
vectorisable exp, row sums in float64 lanes, the dropout factors), which the backward runs
again from the saved ``lse``; its ``dS = s P ∘ (dP - Δ)`` is one more. dK and dV add the
tiles in order, each slice in one block, so results repeat bit for bit on any thread count. A
row whose every key is masked gives NaN, as torch. A float mask that requires grad gets dM = dS
(the scores' gradient before the scale), summed over the dims it was broadcast along: the CPU
stores each tile's dS, the CUDA dQ kernel each (query, key) element its thread owns; the sum
is a fixed-order reduction.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from ops.cpu_threads import numpy_blas_on_one_thread, run_blocks, slice_blocks
from ops.dropout import _keep_cpu
from ops.gelu_cpu import exp_nonpositive_float32, running_max, select
from ops.launch import CPU_KERNEL

CPU_TILE = 64   # query rows a CPU pass scores at once
SCORE_FLOOR = -100.0   # a shifted score below it (a masked key's -inf) has e^score 0 in float32


def exp_nonpositive(a):
    """e^a for a <= 0 or -inf (a softmax's shifted score) in the dtype of ``a``."""


@overload(exp_nonpositive, inline="always")
def _exp_nonpositive(a):
    if a == types.float32:   # vectorisable (ops.gelu_cpu); -inf is clamped (NaN stays NaN)
        floor = np.float32(SCORE_FLOOR)
        return lambda a: exp_nonpositive_float32(select(a < floor, floor, a))
    return lambda a: math.exp(a)


# "reassoc" lets LLVM sum a row in vector lanes (a fixed order of this code: the same bits on
# every run and thread count); with the vectorisable exp, the softmax of the GPT's 48x64x64
# scores took 130 us in one pass against 405 for the three passes around NumPy's exp
_ROW_PASS = dict(CPU_KERNEL, nogil=True, error_model="numpy", fastmath={"reassoc"})


@njit(inline="always")
def _scaled_row(row, keys, mask, mask_strides, b, i, scale):
    """Row ``i`` of slice ``b`` in place: ``s · score + M`` over its first ``keys`` keys, 0
    beyond (the keys causality hides: neither exponentiated nor summed, and 0 in the
    product with V); returns the maximum of the first ``keys`` (in the row's dtype: a
    float64 maximum made the exp float64, 9x slower). One select over the whole row: the
    hidden tail zeroed by a slice assignment was a ``memset`` call per row, 75 us of the
    GPT's 3072 causal rows on the 2-core Xeon."""
    zero = scale - scale
    for j in range(row.size):
        row[j] = select(j < keys, row[j] * scale, zero)
    if mask.size:
        for j in range(keys):
            row[j] += mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]]
    top = row.dtype.type(-np.inf)
    for j in range(keys):
        top = running_max(top, row[j])
    return top


@njit(inline="always")
def _exponentiated_row(row, keys, top, shift):
    """``row[:keys] = e^(row - top + shift)`` (``top`` the row's maximum)."""
    for j in range(keys):
        row[j] = exp_nonpositive(row[j] - top + shift)


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
    tops = np.empty(tile, scores.dtype)
    totals = np.empty(tile, np.float64)
    # a slice's rows pass by pass, not each row through all passes: a row's passes wait on
    # each other (its maximum, then its sum), rows do not (one thread, the GPT's 48x64x64
    # causal forward on the 2-core Xeon: 257-333 us against 434-553)
    for b in range(slices):
        for r in range(tile):
            i = first_query + r
            tops[r] = _scaled_row(scores[b, r], _keys(i, width, causal), mask, mask_strides,
                                  first_slice + b, i, scale)
        for r in range(tile):
            i, top = first_query + r, tops[r]
            shift = top - lse[(first_slice + b) * tq + i] if from_lse else top - top
            _exponentiated_row(scores[b, r], _keys(i, width, causal), top,
                               scores.dtype.type(shift))
        if from_lse:
            continue
        for r in range(tile):
            row, total = scores[b, r], 0.0
            for j in range(_keys(first_query + r, width, causal)):
                total += row[j]
            totals[r] = total
        for r in range(tile):
            i, row, total = first_query + r, scores[b, r], totals[r]
            flat_row = (first_slice + b) * tq + i
            inverse = row.dtype.type(1.0 / total) if total > 0 else row.dtype.type(np.nan)
            for j in range(_keys(i, width, causal)):
                row[j] *= inverse
            lse[flat_row] = tops[r] + np.log(total) if total > 0 else np.nan
            if dropout:
                _apply_dropout(row, flat_row * tk, seed, threshold, keep_scale)


@njit(inline="always")
def _keys(i, width, causal):
    """The keys query ``i`` sees in a tile ``width`` keys wide."""
    return select(causal, min(width, i + 1), width)


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


def _transposed(slices):
    """Each slice's transpose, contiguous: NumPy's batched ``matmul`` reads a transposed view
    as BLAS's second operand 1.6x slower (the GPT's 24 slices of 64 x 32 @ 32 x 64, one
    thread: 96 us against 59 contiguous, 15 the copy)."""
    return np.ascontiguousarray(slices.transpose(0, 2, 1))


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


# P kept from the forward for the backward, where it takes at most this many bytes and no
# dropout applies (the forward's P is then the backward's): the backward neither scores again
# nor makes P again from lse. One thread, the GPT's 24 slices of 64 causal queries (a
# thread's half) on the 2-core Xeon: K's transpose, Q Kᵀ and the row pass were 160 of the
# backward's 524 us
SAVED_PROBS_BYTES = 32 << 20


def saved_probs_size(sizes, causal, itemsize, dropout):
    """The elements of the forward's P as kept for the backward (each query tile's scores,
    ``bh x tile x keys``, one after another), or 0 where P is made again instead."""
    bh, tq, tk, _, _ = sizes
    size = sum(bh * (stop - start) * keys for start, stop, keys in _tiles(tq, tk, causal))
    return 0 if dropout or size * itemsize > SAVED_PROBS_BYTES else size


def _kept_tiles(probs, sizes, first, last, causal):
    """``(start, stop, keys, P)`` of each query tile, P its slices' kept probabilities
    (contiguous ``(last - first, tile, keys)``), or None where none are kept."""
    bh, tq, tk, _, _ = sizes
    offset = 0
    for start, stop, keys in _tiles(tq, tk, causal):
        size = bh * (stop - start) * keys
        yield start, stop, keys, (probs[offset:offset + size].reshape(bh, stop - start, keys)
                                  [first:last] if probs.size else None)
        offset += size


def attention_cpu(q, k, v, mask, seed, out, lse, sizes, mask_strides, scale, causal,
                  threshold, keep_scale, dropout, probs):
    numpy_blas_on_one_thread()
    _in_slice_blocks(_attention_slices, sizes, q, k, v, mask, seed, out, lse, sizes,
                     mask_strides, q.dtype.type(scale), causal, threshold, keep_scale, dropout,
                     probs)


def _attention_slices(first, last, q, k, v, mask, seed, out, lse, sizes, mask_strides, scale,
                      causal, threshold, keep_scale, dropout, probs):
    bh, tq, tk, d, dv = sizes
    q3, k3, v3 = (a[first:last] for a in _views(q, k, v, sizes))
    out3 = out.reshape(bh, tq, dv)[first:last]
    keys_t = _transposed(k3)
    for start, stop, keys, kept in _kept_tiles(probs, sizes, first, last, causal):
        tile = np.matmul(q3[:, start:stop], keys_t[:, :, :keys], out=kept)
        _probability_rows(tile, mask, mask_strides, first, start, tq, tk, scale, causal, lse,
                          False, seed, threshold, keep_scale, dropout)
        np.matmul(tile, v3[:, :keys], out=out3[:, start:stop])


def attention_grad_cpu(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k, grad_v,
                       grad_mask, sizes, mask_strides, scale, causal, threshold, keep_scale,
                       dropout, probs):
    numpy_blas_on_one_thread()
    _, tq, tk, _, _ = sizes
    chunk = max(1, GRAD_CHUNK_BYTES // (min(tq, CPU_TILE) * tk * q.itemsize))   # slices
    _in_slice_blocks(_attention_grad_slices, sizes, chunk, q, k, v, mask, seed, lse, grad_out,
                     grad_q, grad_k, grad_v, grad_mask, sizes, mask_strides, q.dtype.type(scale),
                     causal, threshold, keep_scale, dropout, probs)


# The bytes of one temporary (a tile's scores, or their gradients: slices x tile x keys) a
# backward pass makes at once: its slices are taken in chunks that keep them in a core's L2.
# One thread, the GPT's 48 slices of 64 x 64 float32 scores (786 KB a temporary): 2178 us
# in one pass, 973 in passes of 24 slices, 1004 of 12 (the same bits: each slice's products
# are the same BLAS calls)
GRAD_CHUNK_BYTES = 512 << 10


def _attention_grad_slices(first, last, chunk, *args):
    """Slices ``first`` to ``last`` in chunks of ``chunk`` (``GRAD_CHUNK_BYTES``)."""
    for start in range(first, last, chunk):
        _attention_grad_chunk(start, min(last, start + chunk), *args)


def _attention_grad_chunk(first, last, q, k, v, mask, seed, lse, grad_out, grad_q, grad_k,
                          grad_v, grad_mask, sizes, mask_strides, scale, causal, threshold,
                          keep_scale, dropout, probs):
    bh, tq, tk, d, dv = sizes
    q3, k3, v3 = (a[first:last] for a in _views(q, k, v, sizes))
    g3 = grad_out.reshape(bh, tq, dv)[first:last]
    dq3, dk3, dv3 = (grad_q.reshape(bh, tq, d)[first:last], grad_k.reshape(bh, tk, d)[first:last],
                     grad_v.reshape(bh, tk, dv)[first:last])
    keys_t = None if probs.size else _transposed(k3)
    values_t = _transposed(v3)
    one = scale.dtype.type(1)
    dk3[:] = 0   # each tile adds into the keys it sees, in order: the same bits every run
    dv3[:] = 0
    for start, stop, keys, kept in _kept_tiles(probs, sizes, first, last, causal):
        tile = kept
        if kept is None:   # P again, from the saved lse
            tile = np.matmul(q3[:, start:stop], keys_t[:, :, :keys])
            _probability_rows(tile, mask, mask_strides, first, start, tq, tk, scale, causal,
                              lse, True, seed, threshold, keep_scale, False)
        grad_scores = np.matmul(g3[:, start:stop], values_t[:, :, :keys])   # dO Vᵀ
        dropped = tile
        if dropout:
            factors = np.empty_like(tile)
            _dropout_factors(factors, first, start, tq, tk, seed, threshold, keep_scale)
            grad_scores *= factors
            dropped = tile * factors
        if grad_mask.size:   # dM = dS before the scale, each (slice, query, key) once
            _score_gradients(tile, grad_scores, one)
            tile_mask = grad_mask.reshape(bh, tq, tk)[first:last, start:stop]
            tile_mask[:, :, :keys] = grad_scores
            tile_mask[:, :, keys:] = 0
            grad_scores *= scale
        else:
            _score_gradients(tile, grad_scores, scale)
        np.matmul(grad_scores, k3[:, :keys], out=dq3[:, start:stop])
        dk3[:, :keys] += np.matmul(grad_scores.transpose(0, 2, 1), q3[:, start:stop])
        dv3[:, :keys] += np.matmul(dropped.transpose(0, 2, 1), g3[:, start:stop])


# the compiled kernels behind each CPU side (tests/ops/test_registry.py looks for them)
attention_cpu.__wrapped__ = _probability_rows
attention_grad_cpu.__wrapped__ = _probability_rows
