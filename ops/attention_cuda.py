"""The CUDA kernels of scaled dot-product attention (``ops.attention`` has the math and the
CPU side), in the flash-attention manner: no T x T matrix in global memory, no atomics.

- Forward, one kernel: a block owns ``QUERY_TILE`` queries of one (batch, head) slice, a
  thread a query row (its q and its output accumulator in registers). The block walks the
  keys a tile of ``KEY_TILE`` at a time through shared memory; each thread scores the tile,
  rescales its accumulator once by the online softmax's new maximum, and adds the tile's
  values. It writes the row's output and its logsumexp (float64) for the backward. With
  ``is_causal`` the block stops at its last query's keys.
- Backward, two kernels that each recompute the scores from q, k and the saved logsumexp:
  dQ with a thread per query row walking the key tiles (Δ_i = dO_i · O_i from its own row),
  and dK, dV with a block owning ``KEY_TILE`` keys, a thread per key row, walking the query
  tiles through shared memory (each thread of the block first writes one query's Δ there).
  A float mask's gradient dS is stored by the dQ kernel, each element by its query's thread
  (a mask excludes is_causal, so every key is visited). Each gradient element is summed by the one thread that owns it, in key or query order.

A head dimension up to ``MAX_HEAD_DIM`` fits; the kernels are compiled per dtype and per
head-dimension cap (32, 64 or 128: the registers a row takes). Accumulators are in the
input's dtype, as flash attention's float32, and the logsumexp in float64.
"""
import functools
import math

import numpy as np
from numba import float32, float64

from ops.cuda import SIMULATOR, cuda
from ops.dropout import _keep_cuda

MAX_HEAD_DIM = 128
HEAD_CAPS = (32, 64, MAX_HEAD_DIM)
QUERY_TILE = 4 if SIMULATOR else 64   # threads of a forward or dQ block: one query each
SHARED_BYTES = 32 * 1024              # K and V (or Q and dO) tiles of a block together


def _key_tile(dtype, cap):
    """Rows of a shared K/V (or Q/dO) tile: 32 where two tiles fit ``SHARED_BYTES``."""
    if SIMULATOR:
        return 4
    return max(8, min(32, SHARED_BYTES // (2 * cap * np.dtype(dtype).itemsize)))


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
    key_tile = _key_tile(dtype, cap)

    @cuda.jit(device=True)
    def load_tile(tile, source, row0, rows, width, b, total_rows):
        """tile[r, c] = source[(b * total_rows + row0 + r) * width + c] for r < rows, by
        the block's threads together."""
        for e in range(cuda.threadIdx.x, rows * width, cuda.blockDim.x):
            r = e // width
            tile[r, e - r * width] = source[(b * total_rows + row0 + r) * width + e - r * width]

    @cuda.jit(device=True)
    def load_tiles(tile, other_tile, source, other_source, row0, total_rows, width,
                   other_width, b):
        """The rows from ``row0`` of two sources into two tiles (K and V, or Q and dO); the
        row count, short at the end."""
        rows = min(key_tile, total_rows - row0)
        load_tile(tile, source, row0, rows, width, b, total_rows)
        load_tile(other_tile, other_source, row0, rows, other_width, b, total_rows)
        return rows

    @cuda.jit(device=True)
    def score(tile, r, row, d, scale, mask, mask_strides, b, i, j, causal):
        """Query i's scaled, masked score for key j, one of them ``tile`` row r, the other
        ``row``."""
        dot = kind(0)
        for c in range(d):
            dot += row[c] * tile[r, c]
        return _masked_score_cuda(dot * scale, mask, mask_strides, b, i, j, causal,
                                  mask.size > 0)

    @cuda.jit(cache=True)
    def attention_forward_cuda(q, k, v, mask, seed, out, lse, sizes, mask_strides, scale,
                               causal, threshold, keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        keys = cuda.shared.array((key_tile, cap), kind)
        values = cuda.shared.array((key_tile, cap), kind)
        q_row = cuda.local.array(cap, kind)
        acc = cuda.local.array(cap, kind)
        scores = cuda.local.array(key_tile, kind)
        b, first, i = _query_block(tq)
        active = i < tq
        for c in range(d):
            q_row[c] = q[(b * tq + i) * d + c] if active else 0
        for c in range(dv):
            acc[c] = 0
        top = -math.inf
        total = 0.0
        key_end = min(tk, first + QUERY_TILE) if causal else tk
        for start in range(0, key_end, key_tile):
            rows = load_tiles(keys, values, k, v, start, tk, d, dv, b)
            cuda.syncthreads()
            if active:
                tile_top = top
                for r in range(rows):
                    s = score(keys, r, q_row, d, scale, mask, mask_strides, b, i, start + r,
                              causal)
                    scores[r] = s
                    tile_top = max(tile_top, s)
                if tile_top > -math.inf:
                    correction = math.exp(top - tile_top)
                    total *= correction
                    for c in range(dv):
                        acc[c] *= correction
                    for r in range(rows):
                        p = math.exp(scores[r] - tile_top)
                        total += p
                        if dropout:
                            element = (b * tq + i) * tk + start + r
                            p = p * keep_scale if _keep_cuda(element, seed[0], threshold) else 0
                        for c in range(dv):
                            acc[c] += p * values[r, c]
                    top = tile_top
            cuda.syncthreads()
        if active:
            inverse = 1.0 / total if total > 0 else math.nan
            for c in range(dv):
                out[(b * tq + i) * dv + c] = acc[c] * inverse
            lse[b * tq + i] = top + math.log(total) if total > 0 else math.nan

    @cuda.jit(cache=True)
    def attention_grad_q_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                              grad_v, grad_mask, sizes, mask_strides, scale, causal, threshold,
                              keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        keys = cuda.shared.array((key_tile, cap), kind)
        values = cuda.shared.array((key_tile, cap), kind)
        q_row = cuda.local.array(cap, kind)
        g_row = cuda.local.array(cap, kind)
        acc = cuda.local.array(cap, kind)
        b, first, i = _query_block(tq)
        active = i < tq
        row = b * tq + i
        delta = kind(0)
        for c in range(d):
            q_row[c] = q[row * d + c] if active else 0
            acc[c] = 0
        for c in range(dv):
            g_row[c] = grad_out[row * dv + c] if active else 0
            delta += g_row[c] * (out[row * dv + c] if active else 0)
        row_lse = lse[row] if active else 0.0
        key_end = min(tk, first + QUERY_TILE) if causal else tk
        for start in range(0, key_end, key_tile):
            rows = load_tiles(keys, values, k, v, start, tk, d, dv, b)
            cuda.syncthreads()
            if active:
                for r in range(rows):
                    s = score(keys, r, q_row, d, scale, mask, mask_strides, b, i, start + r,
                              causal)
                    p = math.exp(s - row_lse)
                    d_p = kind(0)
                    for c in range(dv):
                        d_p += g_row[c] * values[r, c]
                    if dropout:
                        element = row * tk + start + r
                        d_p = d_p * keep_scale if _keep_cuda(element, seed[0], threshold) else 0
                    d_s = p * (d_p - delta)
                    if grad_mask.size > 0:   # dM = dS: this thread owns the query's row
                        grad_mask[row * tk + start + r] = d_s
                    for c in range(d):
                        acc[c] += d_s * keys[r, c]
            cuda.syncthreads()
        if active:
            for c in range(d):
                grad_q[row * d + c] = acc[c] * scale

    @cuda.jit(cache=True)
    def attention_grad_kv_cuda(q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k,
                               grad_v, grad_mask, sizes, mask_strides, scale, causal,
                               threshold, keep_scale, dropout):
        bh, tq, tk, d, dv = sizes
        queries = cuda.shared.array((key_tile, cap), kind)
        grads = cuda.shared.array((key_tile, cap), kind)
        lses = cuda.shared.array(key_tile, float64)
        deltas = cuda.shared.array(key_tile, kind)
        k_row = cuda.local.array(cap, kind)
        v_row = cuda.local.array(cap, kind)
        acc_k = cuda.local.array(cap, kind)
        acc_v = cuda.local.array(cap, kind)
        key_tiles = (tk + key_tile - 1) // key_tile
        b = cuda.blockIdx.x // key_tiles
        first = (cuda.blockIdx.x - b * key_tiles) * key_tile
        t = cuda.threadIdx.x
        j = first + t
        active = j < tk
        for c in range(d):
            k_row[c] = k[(b * tk + j) * d + c] if active else 0
            acc_k[c] = 0
        for c in range(dv):
            v_row[c] = v[(b * tk + j) * dv + c] if active else 0
            acc_v[c] = 0
        query_start = first if causal else 0   # earlier queries see none of these keys
        for start in range(query_start, tq, key_tile):
            rows = load_tiles(queries, grads, q, grad_out, start, tq, d, dv, b)
            if t < rows:
                row = b * tq + start + t
                lses[t] = lse[row]
                delta = kind(0)
                for c in range(dv):
                    delta += grad_out[row * dv + c] * out[row * dv + c]
                deltas[t] = delta
            cuda.syncthreads()
            if active:
                for r in range(rows):
                    i = start + r
                    s = score(queries, r, k_row, d, scale, mask, mask_strides, b, i, j, causal)
                    p = math.exp(s - lses[r])
                    factor = kind(1)
                    if dropout:
                        element = (b * tq + i) * tk + j
                        factor = keep_scale if _keep_cuda(element, seed[0], threshold) else 0
                    d_p = kind(0)
                    for c in range(dv):
                        d_p += grads[r, c] * v_row[c]
                        acc_v[c] += p * factor * grads[r, c]
                    d_s = p * (d_p * factor - deltas[r])
                    for c in range(d):
                        acc_k[c] += d_s * queries[r, c]
            cuda.syncthreads()
        if active:
            for c in range(d):
                grad_k[(b * tk + j) * d + c] = acc_k[c] * scale
            for c in range(dv):
                grad_v[(b * tk + j) * dv + c] = acc_v[c]

    return attention_forward_cuda, attention_grad_q_cuda, attention_grad_kv_cuda, key_tile


def forward_plan(args):
    q, k, v, mask, seed, out, lse, sizes = args[:8]
    bh, tq, tk, d, dv = sizes
    forward, _, _, _ = _kernels(np.dtype(q.dtype), head_cap(d, dv))
    return ((forward, bh * -(-tq // QUERY_TILE), QUERY_TILE, args),)


def backward_plan(args):
    q, k, v, mask, seed, lse, out, grad_out, grad_q, grad_k, grad_v, grad_mask, sizes = \
        args[:13]
    bh, tq, tk, d, dv = sizes
    _, grad_q_kernel, grad_kv_kernel, key_tile = _kernels(np.dtype(q.dtype), head_cap(d, dv))
    return ((grad_q_kernel, bh * -(-tq // QUERY_TILE), QUERY_TILE, args),
            (grad_kv_kernel, bh * -(-tk // key_tile), key_tile, args))
