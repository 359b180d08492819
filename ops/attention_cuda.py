"""The CUDA kernels of scaled dot-product attention (``ops.attention`` has the math and the
CPU side), in the flash-attention manner: no T x T matrix in global memory, no atomics.

Every product is a product of two tiles in shared memory, each thread accumulating a
micro-tile in registers (``MICRO`` rows by ``MICRO`` score columns in the forward, 2 in the
backward, or by a slice of the head dim): per step a forward thread reads 4 + 4 elements
for 16 multiply-adds, where a thread per query row read a key element per multiply-add
(H200, GPT step: attention 52.8 of 119.4 ms).

- Forward, one kernel: a block owns ``rows`` queries of one (batch, head) slice, Qᵀ in shared
  memory, and walks the keys a tile at a time (Kᵀ and V): the tile's scores, each row's
  maximum over the tile (per-thread maxima folded through shared memory), the online softmax
  (a new maximum rescales the thread's output rows and its share of each row's sum), Pᵀ into
  shared memory, then O += P V. With ``is_causal`` the block stops at its last query's keys.
  It writes O and each row's logsumexp (float64) for the backward.
- Backward, two kernels that recompute P from Q, K and the saved logsumexp. dQ: a block owns
  a tile of queries (Qᵀ, dOᵀ), walks the key tiles: S = Q Kᵀ and dP = dO Vᵀ, dS = P ∘ (dP -
  Δ) into shared memory, then dQ += dS K (K's rows loaded over Vᵀ once dP is done). It also
  computes each query's Δ = dO · O once, for the dK/dV kernel. dK, dV: a block owns a tile of
  keys (Kᵀ, Vᵀ), walks the query tiles: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, P ∘ D and dS into shared
  memory, then dV += (P ∘ D)ᵀ dO and dK += dSᵀ Q. A float mask's gradient dS is copied by
  the dQ kernel from each tile's dS in shared memory. Each gradient element is summed by the
  one thread that owns it, in key or query order.

Tiles fit the 48 KiB of static shared memory: a float32 forward block takes 64 queries and
32-key tiles, a backward block 32 queries or keys against tiles of 32 (128 threads each);
float64 and head dims over 64 halve them. Transposed tiles' rows are padded by 16 bytes:
vector loads stay aligned, a column's stores spread over 8 banks (``ops.attention_tiles``:
the tiles and the functions the kernels share). A block fills a tile with a constant number
of loads a thread, issued back to back, 16 bytes each where the launch found the sources'
rows allow (``vectors_fit``): the kernels had waited on one 4-byte load at a time (H100,
fwd+bwd at nanoGPT's GPU shape 2182 -> 1349 us). The kernels are latency-bound: their
speed follows the warps an SM holds, so their registers are capped at 128 (4 blocks an
SM, as many as the shared memory allows), and no register holds an address through the
loops (unsigned shared indices; Pᵀ and dSᵀ stored 16 bytes a micro-tile column): fwd+bwd
1337-1345 -> 1043 us on the H100 against torch's 703-708 (forward 284 -> 231 us, dQ 429 ->
324, dK/dV 514 -> 382; the rest accumulates the gradients). Every value is in the input's
dtype: a float64 literal or argument in a float32 expression made it, and its exp, float64.
"""
import functools
import math

import numpy as np
from numba import float32, float64, uint64 as U

from ops.attention_tiles import (ALIGN, INLINE, MICRO, backward_layout, block_place,
                                 head_cap, launch_bounds, strides, tile_functions, tiles,
                                 vectors_fit)
from ops.cuda import cuda
from ops.memory import empty


@functools.cache
def _kernels(dtype, cap, vector):
    """The forward, dQ and dK/dV kernels for inputs of ``dtype`` and head dims <= ``cap``;
    ``vector``: their loads take 16 bytes at a time (``vectors_fit``)."""
    kind = float32 if np.dtype(dtype) == np.float32 else float64
    rows_f, keys_f, _ = tiles(dtype, cap)
    tile, columns, threads = backward_layout(dtype, cap)
    across_f = keys_f // MICRO   # a forward block's threads across a score tile's keys
    width_f = cap // across_f    # the head-dim columns of O each of them owns
    across = tile // columns     # a backward block's threads across a tile's columns
    width = cap // across
    threads_f = (rows_f // MICRO) * across_f
    widest = max(MICRO, width_f, width)
    minus_infinity = -math.inf
    stride_f, keys_stride_f, stride = strides(dtype, cap)
    operand = cap * stride   # a backward operand tile: transposed, or rows of cap
    # array sizes must be constant names, not expressions
    queries_f_size, keys_f_size = cap * stride_f, cap * keys_stride_f
    values_f_size, probs_f_size = keys_f * cap, keys_f * stride_f
    partial_size, square = rows_f * across_f, tile * stride
    micro_square, acc_f_size, acc_size = MICRO * MICRO, MICRO * width_f, MICRO * width
    micro = MICRO * columns   # a backward thread's scores

    (excluded, masked, keep_factor, load_transposed, load_rows, product, clear,
     store_transposed, row_deltas) = tile_functions(kind, cap, widest, vector)

    # Capped at 128 registers a thread, 4 blocks of 128 threads fit an SM, as many as their
    # shared memory allows, where ptxas took more and fit fewer (H100, nanoGPT's GPU shape:
    # forward 168 registers, 3 blocks, 242 -> 232 us; dQ 185, 2 blocks, 519 -> 366 us, dK/dV
    # 482 -> 397 us; spilling 0, 0 and 8 bytes)
    forward_options = {"cache": True, **launch_bounds(threads_f, 4)}
    backward_options = {"cache": True, **launch_bounds(threads, 4)}

    # A thread's micro-tile rows are handled by per-row device functions called once for each
    # row with a constant row number: inlined, every index into the thread's arrays is a
    # constant and they stay in registers, where a loop over the rows with these bodies (an
    # exp, the dropout hash, a mask load) was left rolled and put them in local memory (224
    # bytes of stack a forward thread, seen in ptxas's report).

    @cuda.jit(device=True, **INLINE)
    def mask_row(x, slot, scores, partial, scale_, mask, mask_strides, b, i, j, tq, tk, causal):
        """Row x of the scores scaled and masked in place; its maximum into ``partial``."""
        row_top = kind(minus_infinity)
        for y in range(MICRO):
            s = masked(scores[x * MICRO + y] * scale_, mask, mask_strides, b, i + x, j + y,
                       tq, tk, causal)
            scores[x * MICRO + y] = s
            row_top = max(row_top, s)
        partial[U(slot + x * across_f)] = row_top

    @cuda.jit(device=True, **INLINE)
    def softmax_row(x, scores, acc, top, total, partial, slot, b, i, j, tq, tk, drop):
        """Row x's online softmax over the tile: the row's new maximum (from every thread's
        in ``partial``) rescales what the thread summed (e^-inf = 0; nothing yet: 1), then
        its probabilities add to its share of the row's sum and replace its scores, dropped
        or scaled."""
        new_top = top[x]
        for u in range(across_f):
            new_top = max(new_top, partial[U(slot + x * across_f + u)])
        correction = kind(1) if new_top == top[x] else math.exp(top[x] - new_top)
        total[x] *= correction
        for e in range(width_f):
            acc[x * width_f + e] *= correction
        top[x] = new_top
        for y in range(MICRO):
            s = scores[x * MICRO + y]
            # a masked key adds nothing; a NaN score makes the row NaN
            p = kind(0) if s == minus_infinity else math.exp(s - new_top)
            total[x] += p
            scores[x * MICRO + y] = p * keep_factor(b, i + x, j + y, tq, tk, drop)

    @cuda.jit(device=True, **INLINE)
    def output_row(x, acc, top, partial, out, lse, slot, b, i, tq, dv, c0, lane):
        """Row x's output, divided by the row's sum (its threads' shares in order), and its
        logsumexp (by the row's first thread)."""
        if i + x < tq:
            row_total = kind(0)
            for u in range(across_f):
                row_total += partial[U(slot + x * across_f + u)]
            inverse = kind(1) / row_total if row_total > 0 else kind(math.nan)
            for e in range(width_f):
                if c0 + e < dv:
                    out[(b * tq + i + x) * dv + c0 + e] = acc[x * width_f + e] * inverse
            if lane == 0:
                lse[b * tq + i + x] = (top[x] + math.log(float64(row_total))
                                       if row_total > 0 else math.nan)

    @cuda.jit(**forward_options)
    def attention_forward_cuda(q, k, v, mask, seed, out, lse, sizes, mask_strides, scale,
                               causal, threshold, keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        queries_t = cuda.shared.array(queries_f_size, kind, alignment=ALIGN)
        keys_t = cuda.shared.array(keys_f_size, kind, alignment=ALIGN)
        values = cuda.shared.array(values_f_size, kind, alignment=ALIGN)
        probs_t = cuda.shared.array(probs_f_size, kind, alignment=ALIGN)
        partial = cuda.shared.array(partial_size, kind)
        scores = cuda.local.array(micro_square, kind)
        acc = cuda.local.array(acc_f_size, kind)
        top = cuda.local.array(MICRO, kind)     # each row's maximum so far
        total = cuda.local.array(MICRO, kind)   # this thread's share of each row's sum
        b, first, ty, tx = block_place(tq, rows_f, across_f)
        i0, j0, c0 = MICRO * ty, MICRO * tx, width_f * tx
        slot = i0 * across_f + tx   # the thread's first row's place in ``partial``
        load_transposed(queries_t, stride_f, q, first, min(rows_f, tq - first), d, b, tq,
                        rows_f, threads_f)
        clear(acc, MICRO * width_f)
        for x in range(MICRO):
            top[x] = minus_infinity
            total[x] = 0
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        drop = (seed, threshold, keep_scale_, dropout)   # the dropout's arguments
        key_end = min(tk, first + rows_f) if causal else tk
        for start in range(0, key_end, keys_f):
            rows = min(keys_f, tk - start)
            load_transposed(keys_t, keys_stride_f, k, start, rows, d, b, tk, keys_f, threads_f)
            load_rows(values, v, start, rows, dv, b, tk, keys_f, threads_f)
            cuda.syncthreads()
            clear(scores, MICRO * MICRO)
            product(scores, queries_t, stride_f, i0, keys_t, keys_stride_f, j0, cap, MICRO)
            i, j = first + i0, start + j0
            mask_row(0, slot, scores, partial, scale_, mask, mask_strides, b, i, j, tq, tk, causal)
            mask_row(1, slot, scores, partial, scale_, mask, mask_strides, b, i, j, tq, tk, causal)
            mask_row(2, slot, scores, partial, scale_, mask, mask_strides, b, i, j, tq, tk, causal)
            mask_row(3, slot, scores, partial, scale_, mask, mask_strides, b, i, j, tq, tk, causal)
            cuda.syncthreads()
            slot0 = i0 * across_f
            softmax_row(0, scores, acc, top, total, partial, slot0, b, i, j, tq, tk, drop)
            softmax_row(1, scores, acc, top, total, partial, slot0, b, i, j, tq, tk, drop)
            softmax_row(2, scores, acc, top, total, partial, slot0, b, i, j, tq, tk, drop)
            softmax_row(3, scores, acc, top, total, partial, slot0, b, i, j, tq, tk, drop)
            store_transposed(probs_t, j0 * stride_f + i0, stride_f, scores, MICRO)
            cuda.syncthreads()
            product(acc, probs_t, stride_f, i0, values, cap, c0, keys_f, width_f)
            cuda.syncthreads()
        for x in range(MICRO):   # each row's sum: the shares of its threads, in order
            partial[U(slot + x * across_f)] = total[x]
        cuda.syncthreads()
        i, slot0 = first + i0, i0 * across_f
        output_row(0, acc, top, partial, out, lse, slot0, b, i, tq, dv, c0, tx)
        output_row(1, acc, top, partial, out, lse, slot0, b, i, tq, dv, c0, tx)
        output_row(2, acc, top, partial, out, lse, slot0, b, i, tq, dv, c0, tx)
        output_row(3, acc, top, partial, out, lse, slot0, b, i, tq, dv, c0, tx)

    @cuda.jit(device=True, **INLINE)
    def store_row(x, acc, target, at, inside, c0, limit, factor):
        """A thread's row x of a gradient (``width`` columns from ``c0``, those below
        ``limit``) times ``factor``, from ``target[at]`` on, where the row is ``inside``."""
        if inside:
            for e in range(width):
                if c0 + e < limit:
                    target[at + e] = acc[x * width + e] * factor

    @cuda.jit(device=True, **INLINE)
    def d_score_row(x, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                    b, i, j, tq, tk, causal, drop):
        """Query row x of the dQ tile: P from the saved lse, dS = P ∘ (D ∘ dP - Δ) in place
        of the row's scores."""
        for y in range(columns):
            s = masked(scores[x * columns + y] * scale_, mask, mask_strides, b, i + x, j + y,
                       tq, tk, causal)
            p = kind(0) if excluded(i + x, j + y, tq, tk, causal) else math.exp(
                s - row_lse[U(i0 + x)])
            d_p = d_probs[x * columns + y] * keep_factor(b, i + x, j + y, tq, tk, drop)
            scores[x * columns + y] = p * (d_p - row_delta[U(i0 + x)])

    @cuda.jit(device=True, **INLINE)
    def kv_score_row(x, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                     b, i, j, tq, tk, causal, drop):
        """Key row x of the dK/dV tile (its columns queries): P ∘ D in place of the row's
        scores and dS in place of its dP."""
        for y in range(columns):
            s = masked(scores[x * columns + y] * scale_, mask, mask_strides, b, i + y, j + x,
                       tq, tk, causal)
            p = kind(0) if excluded(i + y, j + x, tq, tk, causal) else math.exp(
                s - row_lse[U(i0 + y)])
            factor = keep_factor(b, i + y, j + x, tq, tk, drop)
            scores[x * columns + y] = p * factor
            d_probs[x * columns + y] = p * (d_probs[x * columns + y] * factor
                                            - row_delta[U(i0 + y)])

    @cuda.jit(**backward_options)
    def attention_grad_q_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                              grad_v, grad_mask, sizes, mask_strides, scale, causal, threshold,
                              keep_scale, dropout, deltas):
        bh, tq, tk, d, dv = sizes
        queries_t = cuda.shared.array(operand, kind, alignment=ALIGN)
        grads_t = cuda.shared.array(operand, kind, alignment=ALIGN)
        keys_t = cuda.shared.array(operand, kind, alignment=ALIGN)
        values_t = cuda.shared.array(operand, kind, alignment=ALIGN)   # then K's rows
        d_scores_t = cuda.shared.array(square, kind, alignment=ALIGN)
        row_lse = cuda.shared.array(tile, kind)
        row_delta = cuda.shared.array(tile, kind)
        delta_parts = cuda.shared.array(threads, kind)
        scores = cuda.local.array(micro, kind)
        d_probs = cuda.local.array(micro, kind)
        acc = cuda.local.array(acc_size, kind)
        b, first, ty, tx = block_place(tq, tile, across)
        t = cuda.threadIdx.x
        i0, j0, c0 = MICRO * ty, columns * tx, width * tx
        rows = min(tile, tq - first)
        load_transposed(queries_t, stride, q, first, rows, d, b, tq, tile, threads)
        load_transposed(grads_t, stride, grad_out, first, rows, dv, b, tq, tile, threads)
        row_deltas(grad_out, out, deltas, lse, row_delta, row_lse, delta_parts, b * tq + first,
                   rows, dv, tile, threads)
        clear(acc, MICRO * width)
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        drop = (seed, threshold, keep_scale_, dropout)   # the dropout's arguments
        key_end = min(tk, first + tile) if causal else tk
        for start in range(0, key_end, tile):
            keys = min(tile, tk - start)
            load_transposed(keys_t, stride, k, start, keys, d, b, tk, tile, threads)
            load_transposed(values_t, stride, v, start, keys, dv, b, tk, tile, threads)
            cuda.syncthreads()
            clear(scores, micro)
            clear(d_probs, micro)
            product(scores, queries_t, stride, i0, keys_t, stride, j0, cap, columns)
            product(d_probs, grads_t, stride, i0, values_t, stride, j0, cap, columns)
            i, j, at = first + i0, start + j0, j0 * stride + i0
            d_score_row(0, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                        b, i, j, tq, tk, causal, drop)
            d_score_row(1, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                        b, i, j, tq, tk, causal, drop)
            d_score_row(2, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                        b, i, j, tq, tk, causal, drop)
            d_score_row(3, scores, d_probs, row_lse, row_delta, i0, scale_, mask, mask_strides,
                        b, i, j, tq, tk, causal, drop)
            store_transposed(d_scores_t, at, stride, scores, columns)
            cuda.syncthreads()
            if grad_mask.size > 0:   # dM = dS, the tile's elements by the block's threads
                for e in range(t, tile * tile, cuda.blockDim.x):
                    r = e // tile
                    c = e - r * tile
                    if first + r < tq and start + c < tk:
                        grad_mask[(b * tq + first + r) * tk + start + c] = \
                            d_scores_t[c * stride + r]
            load_rows(values_t, k, start, keys, d, b, tk, tile, threads)   # dP is done with Vᵀ
            cuda.syncthreads()
            product(acc, d_scores_t, stride, i0, values_t, cap, c0, tile, width)
            cuda.syncthreads()
        at = (b * tq + first + i0) * d + c0
        store_row(0, acc, grad_q, at, first + i0 < tq, c0, d, scale_)
        store_row(1, acc, grad_q, at + d, first + i0 + 1 < tq, c0, d, scale_)
        store_row(2, acc, grad_q, at + 2 * d, first + i0 + 2 < tq, c0, d, scale_)
        store_row(3, acc, grad_q, at + 3 * d, first + i0 + 3 < tq, c0, d, scale_)

    @cuda.jit(**backward_options)
    def attention_grad_kv_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                               grad_v, grad_mask, sizes, mask_strides, scale, causal,
                               threshold, keep_scale, dropout, deltas):
        bh, tq, tk, d, dv = sizes
        keys_t = cuda.shared.array(operand, kind, alignment=ALIGN)
        values_t = cuda.shared.array(operand, kind, alignment=ALIGN)
        first_operand = cuda.shared.array(operand, kind, alignment=ALIGN)    # Qᵀ, then dO
        second_operand = cuda.shared.array(operand, kind, alignment=ALIGN)   # dOᵀ, then Q
        kept_probs = cuda.shared.array(square, kind, alignment=ALIGN)
        d_scores = cuda.shared.array(square, kind, alignment=ALIGN)
        row_lse = cuda.shared.array(tile, kind)
        row_delta = cuda.shared.array(tile, kind)
        scores = cuda.local.array(micro, kind)
        d_probs = cuda.local.array(micro, kind)
        acc_k = cuda.local.array(acc_size, kind)
        acc_v = cuda.local.array(acc_size, kind)
        b, first, ty, tx = block_place(tk, tile, across)
        t = cuda.threadIdx.x
        j0, i0, c0 = MICRO * ty, columns * tx, width * tx   # rows: keys; columns: queries
        keys = min(tile, tk - first)
        load_transposed(keys_t, stride, k, first, keys, d, b, tk, tile, threads)
        load_transposed(values_t, stride, v, first, keys, dv, b, tk, tile, threads)
        clear(acc_k, MICRO * width)
        clear(acc_v, MICRO * width)
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        drop = (seed, threshold, keep_scale_, dropout)   # the dropout's arguments
        query_start = first if causal else 0   # earlier queries see none of these keys
        for start in range(query_start, tq, tile):
            rows = min(tile, tq - start)
            load_transposed(first_operand, stride, q, start, rows, d, b, tq, tile, threads)
            load_transposed(second_operand, stride, grad_out, start, rows, dv, b, tq, tile,
                            threads)
            for r in range(t, tile, cuda.blockDim.x):
                row = b * tq + start + r
                row_lse[r] = kind(lse[row]) if r < rows else kind(0)
                row_delta[r] = deltas[row] if r < rows else kind(0)
            cuda.syncthreads()
            clear(scores, micro)
            clear(d_probs, micro)
            product(scores, keys_t, stride, j0, first_operand, stride, i0, cap, columns)
            product(d_probs, values_t, stride, j0, second_operand, stride, i0, cap, columns)
            j, i, at = first + j0, start + i0, i0 * stride + j0
            kv_score_row(0, scores, d_probs, row_lse, row_delta, i0, scale_, mask,
                         mask_strides, b, i, j, tq, tk, causal, drop)
            kv_score_row(1, scores, d_probs, row_lse, row_delta, i0, scale_, mask,
                         mask_strides, b, i, j, tq, tk, causal, drop)
            kv_score_row(2, scores, d_probs, row_lse, row_delta, i0, scale_, mask,
                         mask_strides, b, i, j, tq, tk, causal, drop)
            kv_score_row(3, scores, d_probs, row_lse, row_delta, i0, scale_, mask,
                         mask_strides, b, i, j, tq, tk, causal, drop)
            store_transposed(kept_probs, at, stride, scores, columns)
            store_transposed(d_scores, at, stride, d_probs, columns)
            cuda.syncthreads()
            load_rows(first_operand, grad_out, start, rows, dv, b, tq, tile, threads)
            load_rows(second_operand, q, start, rows, d, b, tq, tile, threads)
            cuda.syncthreads()
            product(acc_v, kept_probs, stride, j0, first_operand, cap, c0, tile, width)
            product(acc_k, d_scores, stride, j0, second_operand, cap, c0, tile, width)
            cuda.syncthreads()
        j = first + j0
        at_k, at_v = (b * tk + j) * d + c0, (b * tk + j) * dv + c0
        store_row(0, acc_k, grad_k, at_k, j < tk, c0, d, scale_)
        store_row(1, acc_k, grad_k, at_k + d, j + 1 < tk, c0, d, scale_)
        store_row(2, acc_k, grad_k, at_k + 2 * d, j + 2 < tk, c0, d, scale_)
        store_row(3, acc_k, grad_k, at_k + 3 * d, j + 3 < tk, c0, d, scale_)
        store_row(0, acc_v, grad_v, at_v, j < tk, c0, dv, kind(1))
        store_row(1, acc_v, grad_v, at_v + dv, j + 1 < tk, c0, dv, kind(1))
        store_row(2, acc_v, grad_v, at_v + 2 * dv, j + 2 < tk, c0, dv, kind(1))
        store_row(3, acc_v, grad_v, at_v + 3 * dv, j + 3 < tk, c0, dv, kind(1))

    return attention_forward_cuda, attention_grad_q_cuda, attention_grad_kv_cuda


def forward_plan(args):
    """The forward kernel over ``args`` less the last (the CPU's kept P, none here)."""
    q, k, v, mask, seed, out, lse, sizes = args[:8]
    bh, tq, tk, d, dv = sizes
    cap = head_cap(d, dv)
    vector = vectors_fit(q.dtype, cap, (q, k, v), (d, dv))
    forward, _, _ = _kernels(np.dtype(q.dtype), cap, vector)
    queries, keys, _ = tiles(q.dtype, cap)
    return ((forward, bh * -(-tq // queries), (queries // MICRO) * (keys // MICRO), args[:-1]),)


def backward_plan(args):
    """dQ first: it also writes each query's Δ, which the dK/dV kernel reads (in place of
    the last argument, the CPU's kept P)."""
    q, k, v, grad_out, sizes = args[0], args[1], args[2], args[7], args[12]
    bh, tq, tk, d, dv = sizes
    cap = head_cap(d, dv)
    vector = vectors_fit(q.dtype, cap, (q, k, v, grad_out), (d, dv))
    _, grad_q_kernel, grad_kv_kernel = _kernels(np.dtype(q.dtype), cap, vector)
    tile, _, threads = backward_layout(q.dtype, cap)
    full = (*args[:-1], empty(max(bh * tq, 1), q.dtype, "cuda"))
    return ((grad_q_kernel, bh * -(-tq // tile), threads, full),
            (grad_kv_kernel, bh * -(-tk // tile), threads, full))
