"""The CUDA kernels of scaled dot-product attention (``ops.attention`` has the math and the
CPU side), in the flash-attention manner: no T x T matrix in global memory, no atomics.

- Forward, one kernel: a block owns ``QUERY_TILE`` queries of one (batch, head) slice, a
  thread a query row (its q and its output accumulator in registers). The block walks the
  keys a tile at a time through shared memory; each thread scores the tile's keys one by one
  with the online softmax (a new maximum rescales the accumulator), adding each key's value
  row. It writes the row's output and its logsumexp (float64) for the backward. With
  ``is_causal`` the block stops at its last query's keys and a thread at its own.
- Backward, two kernels that each recompute the scores from q, k and the saved logsumexp:
  dQ with a thread per query row walking the key tiles (Δ_i = dO_i · O_i from its own row),
  and dK, dV with a block owning ``kv_tile`` keys, a thread per key (its two accumulators in
  registers, its k and v rows in shared memory), walking the query tiles through shared
  memory (each thread of the block first writes one query's logsumexp and Δ there). A float
  mask's gradient dS is stored by the dQ kernel, each element by its query's thread (a mask
  excludes is_causal, so every key is visited). Each gradient element is summed by the one
  thread that owns it, in key or query order.

Registers, not local memory: a row's arrays are indexed only inside loops over the
compile-time head-dimension cap (8 to 128, the smallest holding the head dims; the columns
past them are zeros), which unroll, so every index is a constant. Loops over the runtime
head dim left them in local memory (a 640-1024 byte stack frame a thread), and the GPT's
step took 267.5 ms on the H200 against torch's 33.8. A dot product runs in four partial sums
(independent chains of multiply-adds), and every value is in the input's dtype: a float64
literal or argument in a float32 expression made it, and its exp, float64.
"""
import functools
import math

import numpy as np
from numba import float32, float64

from ops.cuda import SIMULATOR, cuda
from ops.dropout import _keep_cuda

MAX_HEAD_DIM = 128
HEAD_CAPS = (8, 16, 32, 64, MAX_HEAD_DIM)
QUERY_TILE = 4 if SIMULATOR else 64   # threads of a forward or dQ block: one query each
TILE_BYTES = 32 * 1024                # the K and V (or Q and dO) tiles of a block together
KV_BYTES = 40 * 1024                  # a dK/dV block's shared memory: those tiles, its own rows
PARTIAL_SUMS = 4
ALIGN = None if SIMULATOR else 16   # bytes: 16-byte tiles read in vector loads


def _key_tile(dtype, cap):
    """Rows of the forward and dQ kernels' shared K and V tiles: up to 64 where two fit
    ``TILE_BYTES``."""
    if SIMULATOR:
        return 4
    return max(8, min(64, TILE_BYTES // (2 * cap * np.dtype(dtype).itemsize)))


def _kv_tile(dtype, cap):
    """Keys (threads) of a dK/dV block, and rows of its Q and dO tiles: up to 32 where the
    two tiles and the block's own k and v rows (padded to ``cap + 1`` columns, so the threads
    reading their own rows hit different banks) fit ``KV_BYTES``."""
    if SIMULATOR:
        return 4
    tile = 32
    while tile > 8 and tile * (4 * cap + 8) * np.dtype(dtype).itemsize > KV_BYTES:
        tile //= 2
    return tile


def head_cap(d, dv):
    """The smallest head-dimension cap that holds both head dims; a ValueError past it."""
    for cap in HEAD_CAPS:
        if max(d, dv) <= cap:
            return cap
    raise ValueError(f"scaled_dot_product_attention: head dims {d} (q, k) and {dv} (v) exceed "
                     f"the CUDA kernels' {MAX_HEAD_DIM}; split the heads further")


def _masked_score(score, mask, mask_strides, b, i, j, causal, has_mask):
    if has_mask:
        score += mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]]
    if causal and j > i:
        return -math.inf
    return score


_masked_score_cuda = cuda.jit(device=True)(_masked_score)


@cuda.jit(device=True)
def _query_block(tq):
    """``(b, first, i)``: the (batch, head) slice and first query of a forward or dQ block
    (``QUERY_TILE`` queries), and its thread's query."""
    query_tiles = (tq + QUERY_TILE - 1) // QUERY_TILE
    b = cuda.blockIdx.x // query_tiles
    first = (cuda.blockIdx.x - b * query_tiles) * QUERY_TILE
    return b, first, first + cuda.threadIdx.x


@functools.cache
def _kernels(dtype, cap):
    """The forward, dQ and dK/dV kernels for inputs of ``dtype`` and head dims <= ``cap``."""
    kind = float32 if np.dtype(dtype) == np.float32 else float64
    key_tile, kv_tile = _key_tile(dtype, cap), _kv_tile(dtype, cap)
    minus_infinity = -math.inf
    # a thread's own row in shared memory: rows padded by 16 bytes so that the 16-byte loads
    # of 8 threads (a quarter warp) reading their own rows fall in different banks (a
    # shape must be a constant name, not an expression)
    padded = cap + 4
    grad_q_tile = max(8, key_tile // 2)   # beside the block's own q rows

    @cuda.jit(device=True)
    def load_tile(tile, source, row0, rows, width, b, total_rows):
        """tile[r, c] = source[(b * total_rows + row0 + r) * width + c] for r < rows, zero
        for c from ``width`` to ``cap``, by the block's threads together."""
        for e in range(cuda.threadIdx.x, rows * cap, cuda.blockDim.x):
            r = e // cap
            c = e - r * cap
            tile[r, c] = source[(b * total_rows + row0 + r) * width + c] if c < width else 0

    @cuda.jit(device=True)
    def load_keys(keys, values, k, v, start, tile, d, dv, b, tk):
        """The K and V rows from ``start`` (``tile`` of them, fewer at the end) into the
        block's tiles, ready to read (after the barrier); returns how many."""
        rows = min(tile, tk - start)
        load_tile(keys, k, start, rows, d, b, tk)
        load_tile(values, v, start, rows, dv, b, tk)
        cuda.syncthreads()
        return rows

    @cuda.jit(device=True)
    def load_row(row, source, at, width, active):
        """row[c] = source[at * width + c] for c < width (and ``active``), zero past it."""
        for c in range(cap):
            row[c] = source[at * width + c] if active and c < width else 0

    @cuda.jit(device=True)
    def dot_row(row, tile, r):
        """row · tile[r] over the cap columns."""
        partial = cuda.local.array(PARTIAL_SUMS, kind)
        for u in range(PARTIAL_SUMS):
            partial[u] = 0
        for c in range(0, cap, PARTIAL_SUMS):
            for u in range(PARTIAL_SUMS):
                partial[u] += row[c + u] * tile[r, c + u]
        return (partial[0] + partial[1]) + (partial[2] + partial[3])

    @cuda.jit(device=True)
    def dot_tiles(tile, r, other, s):
        """tile[r] · other[s] over the cap columns."""
        partial = cuda.local.array(PARTIAL_SUMS, kind)
        for u in range(PARTIAL_SUMS):
            partial[u] = 0
        for c in range(0, cap, PARTIAL_SUMS):
            for u in range(PARTIAL_SUMS):
                partial[u] += tile[r, c + u] * other[s, c + u]
        return (partial[0] + partial[1]) + (partial[2] + partial[3])

    @cuda.jit(device=True)
    def masked(dot, scale, mask, mask_strides, b, i, j):
        """Query i's scaled, masked score for key j from their dot product (causal keys past
        i are never scored: each loop stops at them)."""
        return _masked_score_cuda(dot * scale, mask, mask_strides, b, i, j, False,
                                  mask.size > 0)

    @cuda.jit(device=True)
    def keys_seen(i, start, rows, causal):
        """How many of the tile's ``rows`` keys from ``start`` query i sees."""
        return max(0, min(rows, i - start + 1)) if causal else rows

    @cuda.jit(cache=True)
    def attention_forward_cuda(q, k, v, mask, seed, out, lse, sizes, mask_strides, scale,
                               causal, threshold, keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        keys = cuda.shared.array((key_tile, cap), kind, alignment=ALIGN)
        values = cuda.shared.array((key_tile, cap), kind, alignment=ALIGN)
        q_row = cuda.local.array(cap, kind)
        acc = cuda.local.array(cap, kind)
        b, first, i = _query_block(tq)
        active = i < tq
        load_row(q_row, q, b * tq + i, d, active)
        for c in range(cap):
            acc[c] = 0
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        top = kind(minus_infinity)
        total = kind(0)
        key_end = min(tk, first + QUERY_TILE) if causal else tk
        for start in range(0, key_end, key_tile):
            rows = load_keys(keys, values, k, v, start, key_tile, d, dv, b, tk)
            if active:
                for r in range(keys_seen(i, start, rows, causal)):
                    s = masked(dot_row(q_row, keys, r), scale_, mask, mask_strides, b, i,
                               start + r)
                    # a new maximum: rescale what was summed (e^-inf = 0); a NaN score
                    # comes in here too and makes the row NaN, as everywhere else
                    if not s <= top:
                        correction = math.exp(top - s)
                        total *= correction
                        for c in range(cap):
                            acc[c] *= correction
                        top = s
                    if s > minus_infinity:   # a masked key adds nothing
                        p = math.exp(s - top)
                        total += p
                        if dropout:
                            element = (b * tq + i) * tk + start + r
                            p = p * keep_scale_ if _keep_cuda(element, seed[0], threshold) else 0
                        for c in range(cap):
                            acc[c] += p * values[r, c]
            cuda.syncthreads()
        if active:
            inverse = 1 / total if total > 0 else kind(math.nan)
            for c in range(cap):
                if c < dv:
                    out[(b * tq + i) * dv + c] = acc[c] * inverse
            lse[b * tq + i] = top + math.log(float64(total)) if total > 0 else math.nan

    @cuda.jit(cache=True)
    def attention_grad_q_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                              grad_v, grad_mask, sizes, mask_strides, scale, causal, threshold,
                              keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        keys = cuda.shared.array((grad_q_tile, cap), kind, alignment=ALIGN)
        values = cuda.shared.array((grad_q_tile, cap), kind, alignment=ALIGN)
        own_q = cuda.shared.array((QUERY_TILE, padded), kind, alignment=ALIGN)
        g_row = cuda.local.array(cap, kind)
        acc = cuda.local.array(cap, kind)
        b, first, i = _query_block(tq)
        t = cuda.threadIdx.x
        active = i < tq
        row = b * tq + i
        load_tile(own_q, q, first, min(QUERY_TILE, tq - first), d, b, tq)
        load_row(g_row, grad_out, row, dv, active)
        delta = kind(0)
        for c in range(cap):
            acc[c] = 0
            if c < dv and active:
                delta += g_row[c] * out[row * dv + c]
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        row_lse = kind(lse[row]) if active else kind(0)
        key_end = min(tk, first + QUERY_TILE) if causal else tk
        for start in range(0, key_end, grad_q_tile):
            rows = load_keys(keys, values, k, v, start, grad_q_tile, d, dv, b, tk)
            if active:
                for r in range(keys_seen(i, start, rows, causal)):
                    s = masked(dot_tiles(keys, r, own_q, t), scale_, mask, mask_strides, b, i,
                               start + r)
                    p = math.exp(s - row_lse)
                    d_p = dot_row(g_row, values, r)
                    if dropout:
                        element = row * tk + start + r
                        d_p = d_p * keep_scale_ if _keep_cuda(element, seed[0], threshold) else 0
                    d_s = p * (d_p - delta)
                    if grad_mask.size > 0:   # dM = dS: this thread owns the query's row
                        grad_mask[row * tk + start + r] = d_s
                    for c in range(cap):
                        acc[c] += d_s * keys[r, c]
            cuda.syncthreads()
        if active:
            for c in range(cap):
                if c < d:
                    grad_q[row * d + c] = acc[c] * scale_

    @cuda.jit(cache=True)
    def attention_grad_kv_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                               grad_v, grad_mask, sizes, mask_strides, scale, causal,
                               threshold, keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        queries = cuda.shared.array((kv_tile, cap), kind, alignment=ALIGN)
        grads = cuda.shared.array((kv_tile, cap), kind, alignment=ALIGN)
        own_k = cuda.shared.array((kv_tile, padded), kind, alignment=ALIGN)
        own_v = cuda.shared.array((kv_tile, padded), kind, alignment=ALIGN)
        lses = cuda.shared.array(kv_tile, kind)
        deltas = cuda.shared.array(kv_tile, kind)
        acc_k = cuda.local.array(cap, kind)
        acc_v = cuda.local.array(cap, kind)
        key_tiles = (tk + kv_tile - 1) // kv_tile
        b = cuda.blockIdx.x // key_tiles
        first = (cuda.blockIdx.x - b * key_tiles) * kv_tile
        t = cuda.threadIdx.x
        j = first + t
        active = j < tk
        rows = min(kv_tile, tk - first)
        load_tile(own_k, k, first, rows, d, b, tk)
        load_tile(own_v, v, first, rows, dv, b, tk)
        for c in range(cap):
            acc_k[c] = 0
            acc_v[c] = 0
        scale_, keep_scale_ = kind(scale), kind(keep_scale)
        query_start = first if causal else 0   # earlier queries see none of these keys
        for start in range(query_start, tq, kv_tile):
            rows = min(kv_tile, tq - start)
            load_tile(queries, q, start, rows, d, b, tq)
            load_tile(grads, grad_out, start, rows, dv, b, tq)
            if t < rows:
                row = b * tq + start + t
                lses[t] = lse[row]
                delta = kind(0)
                for c in range(dv):
                    delta += grad_out[row * dv + c] * out[row * dv + c]
                deltas[t] = delta
            cuda.syncthreads()
            if active:
                for r in range(max(0, j - start) if causal else 0, rows):   # queries i >= j
                    i = start + r
                    s = masked(dot_tiles(queries, r, own_k, t), scale_, mask, mask_strides,
                               b, i, j)
                    p = math.exp(s - lses[r])
                    factor = kind(1)
                    if dropout:
                        element = (b * tq + i) * tk + j
                        factor = keep_scale_ if _keep_cuda(element, seed[0], threshold) else 0
                    d_p = dot_tiles(grads, r, own_v, t)
                    kept = p * factor
                    for c in range(cap):
                        acc_v[c] += kept * grads[r, c]
                    d_s = p * (d_p * factor - deltas[r])
                    for c in range(cap):
                        acc_k[c] += d_s * queries[r, c]
            cuda.syncthreads()
        if active:
            for c in range(cap):
                if c < d:
                    grad_k[(b * tk + j) * d + c] = acc_k[c] * scale_
            for c in range(cap):
                if c < dv:
                    grad_v[(b * tk + j) * dv + c] = acc_v[c]

    return attention_forward_cuda, attention_grad_q_cuda, attention_grad_kv_cuda, kv_tile


def forward_plan(args):
    q, k, v, mask, seed, out, lse, sizes = args[:8]
    bh, tq, tk, d, dv = sizes
    forward, _, _, _ = _kernels(np.dtype(q.dtype), head_cap(d, dv))
    return ((forward, bh * -(-tq // QUERY_TILE), QUERY_TILE, args),)


def backward_plan(args):
    q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k, grad_v, grad_mask, sizes = \
        args[:13]
    bh, tq, tk, d, dv = sizes
    _, grad_q_kernel, grad_kv_kernel, kv_tile = _kernels(np.dtype(q.dtype), head_cap(d, dv))
    return ((grad_q_kernel, bh * -(-tq // QUERY_TILE), QUERY_TILE, args),
            (grad_kv_kernel, bh * -(-tk // kv_tile), kv_tile, args))
