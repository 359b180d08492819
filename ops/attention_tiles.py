"""The tiles of the CUDA attention kernels (``ops.attention_cuda``): their sizes, and the
device functions the kernels share, built for one dtype and head-dimension cap.

- ``tiles``: how many queries and keys a block and its tiles hold, so that the tiles fit the
  48 KiB of static shared memory;
- ``tile_functions``: loading a tile from global memory (as it is, or transposed: a column of
  the source a row of the tile), the micro-tile product of two tiles a thread accumulates in
  registers, and the scores' masking and dropout factor.

Every function is inlined into the kernels (NVVM's alwaysinline): a thread's local arrays
then stay in registers, every index a constant once the loops over ``MICRO`` and the widths
unroll (the simulator takes no such option).
"""
import math

import numpy as np
from numba import float32, uint64 as U

from ops.cuda import SIMULATOR, cuda, device_address
from ops.dropout import _keep_cuda

MAX_HEAD_DIM = 128
HEAD_CAPS = (8, 16, 32, 64, MAX_HEAD_DIM)
MICRO = 4   # rows (and score columns) of a thread's micro-tile: the kernels call their
            # per-row functions for rows 0 to 3 one by one
PAD = 4                           # elements a transposed tile's rows are padded by
SHARED_BYTES = 48 * 1024          # a block's static shared memory
ALIGN = None if SIMULATOR else 16
INLINE = {} if SIMULATOR else {"forceinline": True}


def launch_bounds(threads, blocks):
    """``cuda.jit``'s options that cap a kernel's registers so that ``blocks`` blocks of
    ``threads`` fit an SM (the simulator takes no such option)."""
    return {} if SIMULATOR else {"launch_bounds": (threads, blocks)}


def tiles(dtype, cap):
    """``(queries, keys, tile)``: a forward block's queries and key tiles, a backward block's
    queries or keys and the tiles it walks. A float32 head of 64 fits the shared memory with
    the largest; each doubling of the dtype or the cap halves them, and they halve again
    where they still would not fit (a float64 head of 32, whose forward would take 52 KiB
    and backward 48.5: every launch of one had failed ``strides``' assertion)."""
    if SIMULATOR:
        return 8, 8, 8
    itemsize = np.dtype(dtype).itemsize
    halvings = max(1, cap * itemsize // 256)
    while (_forward_bytes(cap, itemsize, 64 // halvings, 32 // halvings, 0) > SHARED_BYTES
           or _backward_bytes(cap, itemsize, 32 // halvings, 0) > SHARED_BYTES):
        halvings *= 2
    return 64 // halvings, 32 // halvings, 32 // halvings


def _backward_shape(cap, tile):
    """``(columns, threads)`` of a backward block over tiles of ``tile`` (``backward_layout``)."""
    columns = 2 if 2 * cap >= tile else MICRO
    return columns, (tile // MICRO) * (tile // columns)


def backward_layout(dtype, cap):
    """``(tile, columns, threads)`` of a backward block: its tile, each thread's score columns
    (its micro-tile rows are ``MICRO``) and its threads. Two columns where a thread then
    still owns a column of the gradient's cap: 128 threads to a float32 block of 32, where
    64 (4 x 4 micro-tiles) had left an SM 8 warps, its registers and shared memory both
    full; with the registers capped (``ops.attention_cuda``) it holds 16 (H100, nanoGPT's
    GPU shape: dQ kernel 429 -> 366 us, dK/dV 514 -> 397 us)."""
    tile = tiles(dtype, cap)[2]
    return (tile, *_backward_shape(cap, tile))


def _forward_bytes(cap, itemsize, rows_f, keys_f, pad):
    """A forward block's static shared memory: Qᵀ, Kᵀ, V, Pᵀ and the rows' partial maxima."""
    return ((cap + keys_f) * (rows_f + pad) + cap * (keys_f + pad) + keys_f * cap
            + rows_f * keys_f // MICRO) * itemsize


def _backward_bytes(cap, itemsize, tile, pad):
    """A backward block's static shared memory: four operand tiles, two score tiles, the
    rows' lse and Δ, and the parts of Δ's sums (``row_deltas``)."""
    threads = _backward_shape(cap, tile)[1]
    return ((4 * cap + 2 * tile) * (tile + pad) + 2 * tile + threads) * itemsize


def head_cap(d, dv):
    """The smallest head-dimension cap that holds both head dims; a ValueError past it."""
    for cap in HEAD_CAPS:
        if max(d, dv) <= cap:
            return cap
    raise ValueError(f"scaled_dot_product_attention: head dims {d} (q, k) and {dv} (v) exceed "
                     f"the CUDA kernels' {MAX_HEAD_DIM}; split the heads further")


def strides(dtype, cap):
    """``(forward queries', forward keys', backward)`` row lengths of the transposed tiles:
    padded by ``PAD`` where the shared memory allows (float64 heads of 128 go without, in the
    backward)."""
    itemsize = np.dtype(dtype).itemsize
    rows_f, keys_f, tile = tiles(dtype, cap)
    pad_f = PAD if _forward_bytes(cap, itemsize, rows_f, keys_f, PAD) <= SHARED_BYTES else 0
    pad = PAD if _backward_bytes(cap, itemsize, tile, PAD) <= SHARED_BYTES else 0
    assert max(_forward_bytes(cap, itemsize, rows_f, keys_f, pad_f),
               _backward_bytes(cap, itemsize, tile, pad)) <= SHARED_BYTES, (dtype, cap)
    return rows_f + pad_f, keys_f + pad_f, tile + pad


@cuda.jit(device=True, **INLINE)
def block_place(count, rows, across):
    """``(b, first, ty, tx)``: the (batch, head) slice of the block and its first row of the
    slice's ``count`` (blocks of ``rows``), and the thread's row and column in its block's
    grid of micro-tiles (``across`` threads a row)."""
    tiles_ = (count + rows - 1) // rows
    b = cuda.blockIdx.x // tiles_
    ty = cuda.threadIdx.x // across
    return b, (cuda.blockIdx.x - b * tiles_) * rows, ty, cuda.threadIdx.x - ty * across


def tile_functions(kind, cap, widest, vector):
    """``(excluded, masked, keep_factor, load_transposed, load_rows, product, clear,
    store_transposed, row_deltas)`` for
    values of the Numba type ``kind``, tiles ``cap`` wide and micro-tiles up to ``widest``
    columns; ``vector``: the loads take 16 bytes at a time (``vector_loads``)."""
    minus_infinity = -math.inf

    @cuda.jit(device=True, **INLINE)
    def excluded(i, j, tq, tk, causal):
        """Past the ends, or a causal key after the query: P is 0 there, whatever the lse (a
        row whose every key a mask excludes has a NaN lse, and NaN gradients, as on the
        CPU)."""
        return i >= tq or j >= tk or (causal and j > i)

    @cuda.jit(device=True, **INLINE)
    def masked(dot, mask, mask_strides, b, i, j, tq, tk, causal):
        """Query i's masked score for key j from its scaled dot product: -inf past the ends,
        for a causal key after the query, or where the mask says so."""
        if excluded(i, j, tq, tk, causal):
            return kind(minus_infinity)
        if mask.size > 0:
            dot += mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]]
        return dot

    # The loads below run a constant count of steps (the block's ``threads`` and the tile's
    # rows are constants once inlined) and read unconditionally (an element past the ends
    # reads the source's first element and stores 0): the loop unrolls into independent
    # loads issued back to back. Behind a per-element branch each load waited for the one
    # before, and the kernels spent most of their time waiting on global memory.
    @cuda.jit(device=True, **INLINE)
    def tile_element(source, base, e, rows, width_):
        """``(r, c, value)``: element e of a tile of rows ``cap`` long read from ``source``
        from ``base`` on, rows ``width_`` long: its row, its column and its value (0 at r >=
        rows or c >= width_, where the source's first element is read instead)."""
        r = e // U(cap)
        c = e - r * U(cap)
        inside = (r < U(rows)) & (c < U(width_))
        value = source[base + r * U(width_) + c if inside else U(0)]
        return r, c, value if inside else kind(0)

    @cuda.jit(device=True, **INLINE)
    def load_transposed(tile_, tile_stride, source, row0, rows, width_, b, total_rows,
                        tile_rows, threads):
        """tile_[c * tile_stride + r] = source[(b * total_rows + row0 + r) * width_ + c] for r
        < rows and c < width_, zero elsewhere up to ``tile_rows`` and ``cap``, by the block's
        ``threads`` together (consecutive threads read consecutive elements of a row)."""
        base = U(b * total_rows + row0) * U(width_)
        for step in range(tile_rows * cap // threads):
            e = U(cuda.threadIdx.x) + U(step * threads)
            r, c, value = tile_element(source, base, e, rows, width_)
            tile_[c * U(tile_stride) + r] = value

    @cuda.jit(device=True, **INLINE)
    def load_rows(tile_, source, row0, rows, width_, b, total_rows, tile_rows, threads):
        """tile_[r * cap + c], the rows as they are (zero past ``rows`` and ``width_``)."""
        base = U(b * total_rows + row0) * U(width_)
        for step in range(tile_rows * cap // threads):
            e = U(cuda.threadIdx.x) + U(step * threads)
            tile_[e] = tile_element(source, base, e, rows, width_)[2]

    @cuda.jit(device=True, **INLINE)
    def product(acc, a, a_stride, a0, b_, b_stride, b0, depth, columns):
        """acc[x * columns + y] += Σ_k a[k * a_stride + a0 + x] · b_[k * b_stride + b0 + y]
        for x < MICRO, y < columns, k < depth: a micro-tile of a product of two tiles.
        Unsigned offsets and a while loop, as the GEMM template's (``ops.gemm.template``):
        signed indices carry Numba's negative-index fix-ups, and a range's bookkeeping
        stops the unrolling."""
        left = cuda.local.array(MICRO, kind)
        right = cuda.local.array(widest, kind)
        a_at, b_at = U(a0), U(b0)
        k = U(0)
        while k < U(depth):
            for x in range(MICRO):
                left[x] = a[a_at + U(x)]
            for y in range(columns):
                right[y] = b_[b_at + U(y)]
            for x in range(MICRO):
                for y in range(columns):
                    acc[x * columns + y] += left[x] * right[y]
            a_at += U(a_stride)
            b_at += U(b_stride)
            k += U(1)

    @cuda.jit(device=True, **INLINE)
    def clear(acc, size):
        for e in range(size):
            acc[e] = 0

    @cuda.jit(device=True, **INLINE)
    def keep_factor(b, i, j, tq, tk, drop):
        """D_ij: 0 for a dropped score, 1 / (1 - p) for a kept one (1 without dropout);
        ``drop`` is ``(seed, threshold, keep_scale, dropout)``."""
        seed, threshold, keep_scale_, dropout = drop
        if not dropout:
            return kind(1)
        return keep_scale_ if _keep_cuda((b * tq + i) * tk + j, seed[0], threshold) else kind(0)

    @cuda.jit(device=True, **INLINE)
    def store_transposed(tile_, at, tile_stride, values, columns):
        """tile_[at + y * tile_stride + x] = values[x * columns + y] for x < MICRO, y <
        ``columns``: a thread's micro-tile into a transposed tile."""
        for y in range(columns):
            for x in range(MICRO):
                tile_[U(at + y * tile_stride + x)] = values[x * columns + y]

    @cuda.jit(device=True, **INLINE)
    def row_deltas(grad_out, out, deltas, lse, row_delta, row_lse, sums, row0, rows, dv, tile,
                   threads):
        """Δ_i = dO_i · O_i of the ``rows`` rows from ``row0`` on, into ``deltas`` and
        ``row_delta``, and their saved lse into ``row_lse`` (zeros up to ``tile``): threads
        // tile threads a row, each summing every so many columns into ``sums`` (a constant
        count of loads, issued together), then the row's sums added in order by one thread.
        One thread a row had read its 2 x dv elements in a loop while the block's other
        threads waited (H100, nanoGPT's GPU shape: dQ kernel 362 -> 325 us)."""
        parts = threads // tile
        t = cuda.threadIdx.x
        r, part = t // parts, t % parts
        delta = kind(0)
        for e in range(cap // parts):
            c = part + parts * e
            inside = (r < rows) & (c < dv)
            at = U((row0 + r) * dv + c) if inside else U(0)
            term = grad_out[at] * out[at]
            delta += term if inside else kind(0)
        sums[t] = delta
        cuda.syncthreads()
        if t < tile:
            delta = kind(0)
            for u in range(parts):
                delta += sums[t * parts + u]
            if t < rows:
                deltas[row0 + t] = delta
            row_delta[t] = delta
            row_lse[t] = kind(lse[row0 + t]) if t < rows else kind(0)

    if vector:
        load_transposed, load_rows = vector_loads(kind, cap)
    if kind == float32 and not SIMULATOR:
        store_transposed = vector_store()
    return (excluded, masked, keep_factor, load_transposed, load_rows, product, clear,
            store_transposed, row_deltas)


def vector_store():
    """``store_transposed`` (``tile_functions``) for float32 tiles: a micro-tile column's
    ``MICRO`` (4) elements in one 16-byte store (the tiles' rows and the micro-tiles' first
    rows are multiples of 4 elements). Stored an element at a time, each element's address
    had been computed once, before the kernel's loop, and kept in a register of its own
    (235 registers a forward thread live through its loop, in the PTX)."""
    from ops.cuda import ptx   # numba-cuda's extension API: GPU kernels only
    store_float4 = ptx.store_float4

    @cuda.jit(device=True, **INLINE)
    def store_transposed(tile_, at, tile_stride, values, columns):
        for y in range(columns):
            store_float4(tile_, at + y * tile_stride, values[y], values[columns + y],
                         values[2 * columns + y], values[3 * columns + y])

    return store_transposed


def vectors_fit(dtype, cap, arrays, widths):
    """Whether the kernels' loads can take 16 bytes at a time, decided at launch (a kernel
    that also held the scalar loads, for sources found unaligned as it ran, kept every
    unrolled step's offsets of both in registers: 245 registers a dK/dV thread, 185
    without): float32 tiles of ``cap`` that split into whole 16-byte vectors among a
    block's threads (every tile of the kernels: their caps from 16 on) on a GPU, and
    ``arrays`` whose rows (``widths`` long) are whole 16-byte vectors."""
    if SIMULATOR or np.dtype(dtype) != np.float32:
        return False
    rows_f, keys_f, _ = tiles(dtype, cap)
    tile, _, threads = backward_layout(dtype, cap)
    threads_f = (rows_f // MICRO) * (keys_f // MICRO)
    return (all(rows * cap % (4 * threads_f) == 0 for rows in (rows_f, keys_f))
            and tile * cap % (4 * threads) == 0 and all(w % 4 == 0 for w in widths)
            and all(device_address(a) % 16 == 0 for a in arrays))


def vector_loads(kind, cap):
    """``load_transposed`` and ``load_rows`` (``tile_functions``) that read a float32 source
    16 bytes at a time: a quarter of the loads and of their index arithmetic, which took more
    instructions than the loads."""
    from ops.cuda import ptx   # numba-cuda's extension API: GPU kernels only
    load_float4 = ptx.load_float4

    @cuda.jit(device=True, **INLINE)
    def load_transposed(tile_, tile_stride, source, row0, rows, width_, b, total_rows,
                        tile_rows, threads):
        base = U(b * total_rows + row0) * U(width_)
        zero = kind(0)
        for step in range(tile_rows * cap // (4 * threads)):
            e = U(cuda.threadIdx.x) + U(step * threads)
            # two threads a row's 32 bytes (a sector), consecutive pairs on consecutive rows:
            # 4 padded tile rows span 16 banks mod 32, so a warp's 16 rows by 2 column
            # groups store into 32 different banks
            r = (e // U(2)) % U(tile_rows)
            c = (e % U(2) + U(2) * (e // U(2 * tile_rows))) * U(4)
            inside = (r < U(rows)) & (c < U(width_))
            x0, x1, x2, x3 = load_float4(source, base + r * U(width_) + c if inside else U(0))
            at = c * U(tile_stride) + r
            tile_[at] = x0 if inside else zero
            tile_[at + U(tile_stride)] = x1 if inside else zero
            tile_[at + U(2 * tile_stride)] = x2 if inside else zero
            tile_[at + U(3 * tile_stride)] = x3 if inside else zero

    @cuda.jit(device=True, **INLINE)
    def load_rows(tile_, source, row0, rows, width_, b, total_rows, tile_rows, threads):
        base = U(b * total_rows + row0) * U(width_)
        zero = kind(0)
        for step in range(tile_rows * cap // (4 * threads)):
            e = U(cuda.threadIdx.x) + U(step * threads)
            r = e // U(cap // 4)
            c = (e % U(cap // 4)) * U(4)
            inside = (r < U(rows)) & (c < U(width_))
            x0, x1, x2, x3 = load_float4(source, base + r * U(width_) + c if inside else U(0))
            at = r * U(cap) + c
            tile_[at] = x0 if inside else zero
            tile_[at + U(1)] = x1 if inside else zero
            tile_[at + U(2)] = x2 if inside else zero
            tile_[at + U(3)] = x3 if inside else zero

    return load_transposed, load_rows
