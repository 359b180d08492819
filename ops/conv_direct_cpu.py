"""Direct CPU convolution loops for Conv2D (``ops.conv``): no im2col, no col2im, no BLAS.

Every product is one register tile, ``_outer_tile``: 8 scalars of one operand times 32 lanes
of the other, summed over a reduction in 16 vector registers by ``llvm.fma`` (one rounding per
multiply-add, the order fixed: the same bits on any thread count; no fastmath):
- forward (stride 1): 8 output channels x 32 neighbouring outputs of the sample's zero-padded
  planes, flattened (a row's columns past the output's width are computed and dropped: 2 of
  16 on 14x14), summed over the taps (c, i, j); the filter blocked 8 channels a tap;
- input gradient (stride 1): the same loop on G, padded by ``(K-1)·D - pad``, with the filter
  flipped and blocked by input channel;
- weight gradient: 8 taps x 32 output channels, summed over the output positions, G
  transposed to ``(positions, O)`` once per sample.
Lanes are an LLVM vector type and four intrinsics (``ops.lanes``): as loops over a 16-wide
array, Numba's LLVM vectorised the wrong loop (2 GFLOP/s) or none (6.6). The tile in L1: 116
GFLOP/s on one core of the AMD EPYC (Zen 4) CI machine. Measured there (7-channel tiles,
8-plane chunks), one thread, thread CPU, batch 128, float32, direct against im2col + OpenBLAS
(``ops.conv_cpu``'s other path): 32->64 3x3 "same" on 14x14: forward 12.0 ms against 12.9, dw
12.2 against 14.4, dx 12.4 against 12.9; the 1->32 first layer (9 taps): forward 2.1 against
1.4, dx 6.9 against 1.8 (``DIRECT_MIN_TAPS``). On the 2-core Xeon, 8 rows a tile (7 computed 70
channels of 64) and chunks of 16 planes, against 7 and 8 in one process alternating every
round: forward 0.90-0.92x on 32->64 14x14, 32->32 28x28 and 64->64 14x14, dx 0.88-0.92x, dw
0.99-1.05x (8 taps a tile: one tile for all three). NCHW stays at the op's boundary: copying
the sums into NCHW and activating them cost 0.7 of the forward's 12.0 ms, the most a channel-
blocked layout could save.
"""
import numpy as np
from numba import njit

from ops.lanes import LANES, fma_lanes, load_lanes, splat_lanes, store_lanes
from ops.launch import CPU_KERNEL

TILE_ROWS = 8            # scalars of a tile: 8 x 2 vectors = 16 accumulators of 16
TILE_COLUMNS = 2 * LANES
CHUNK_PLANES = 16        # input planes a pass of the direct sums reads
ALIGNMENT = 64           # bytes: a cache line, one vector of 16 float32


@njit(inline="always")
def _pair(array, index):
    return load_lanes(array, index), load_lanes(array, index + LANES)


@njit(inline="always")
def _put_pair(array, index, low, high):
    store_lanes(array, index, low)
    store_lanes(array, index + LANES, high)


@njit(inline="always")
def _row_fma(a, at, b0, b1, low, high):
    """A tile row's two accumulators plus ``a[at]`` (every lane) times the pair b0, b1."""
    x = splat_lanes(a, at)
    return fma_lanes(x, b0, low), fma_lanes(x, b1, high)


@njit(inline="always")
def _outer_tile(a, a_at, a_off, count, v, v_at, v_off, tile, tile_at, tile_step):
    """``tile[tile_at + k·tile_step + l] += Σ_r a[a_at[k] + a_off[r]] · v[v_at + v_off[r] +
    l]`` for k < 8, l < 32, r < count, r in order: 16 accumulators of 16 lanes."""
    a0, a1, a2, a3 = a_at[0], a_at[1], a_at[2], a_at[3]
    a4, a5, a6, a7 = a_at[4], a_at[5], a_at[6], a_at[7]
    s0, s1 = _pair(tile, tile_at + 0 * tile_step)
    s2, s3 = _pair(tile, tile_at + 1 * tile_step)
    s4, s5 = _pair(tile, tile_at + 2 * tile_step)
    s6, s7 = _pair(tile, tile_at + 3 * tile_step)
    s8, s9 = _pair(tile, tile_at + 4 * tile_step)
    s10, s11 = _pair(tile, tile_at + 5 * tile_step)
    s12, s13 = _pair(tile, tile_at + 6 * tile_step)
    s14, s15 = _pair(tile, tile_at + 7 * tile_step)
    for r in range(count):
        offset = a_off[r]
        b0, b1 = _pair(v, v_at + v_off[r])
        s0, s1 = _row_fma(a, a0 + offset, b0, b1, s0, s1)
        s2, s3 = _row_fma(a, a1 + offset, b0, b1, s2, s3)
        s4, s5 = _row_fma(a, a2 + offset, b0, b1, s4, s5)
        s6, s7 = _row_fma(a, a3 + offset, b0, b1, s6, s7)
        s8, s9 = _row_fma(a, a4 + offset, b0, b1, s8, s9)
        s10, s11 = _row_fma(a, a5 + offset, b0, b1, s10, s11)
        s12, s13 = _row_fma(a, a6 + offset, b0, b1, s12, s13)
        s14, s15 = _row_fma(a, a7 + offset, b0, b1, s14, s15)
    _put_pair(tile, tile_at + 0 * tile_step, s0, s1)
    _put_pair(tile, tile_at + 1 * tile_step, s2, s3)
    _put_pair(tile, tile_at + 2 * tile_step, s4, s5)
    _put_pair(tile, tile_at + 3 * tile_step, s6, s7)
    _put_pair(tile, tile_at + 4 * tile_step, s8, s9)
    _put_pair(tile, tile_at + 5 * tile_step, s10, s11)
    _put_pair(tile, tile_at + 6 * tile_step, s12, s13)
    _put_pair(tile, tile_at + 7 * tile_step, s14, s15)


@njit(inline="always")
def aligned_empty(size, dtype):
    """An uninitialised 1-d array of ``size`` whose first element starts a cache line: the
    tiles' loads and stores at multiples of 16 lanes then never straddle two lines (the
    same kernels ran 12 or 17 ms, 32->64 forward, as malloc's alignment fell)."""
    buffer = np.empty(size + ALIGNMENT, dtype)   # ALIGNMENT elements: bytes to spare
    start = (-buffer.ctypes.data) % ALIGNMENT // buffer.itemsize
    return buffer[start:start + size]


@njit(inline="always")
def _multiples(count, step):
    """``[0, step, 2·step, ...]``, ``count`` of them, cache-line aligned."""
    multiples = aligned_empty(count, np.int64)
    for r in range(count):
        multiples[r] = r * step
    return multiples


@njit(inline="always")
def round_up(count, step):
    return -(-count // step) * step


@njit(inline="always")
def _extent(size, before, out_n, kernel, dilation):
    """A padded dimension's length (stride 1): the input after ``before`` zeros, long enough
    for every tap of every output (the bottom/right padding)."""
    return max(size + before, out_n + (kernel - 1) * dilation)


@njit(**CPU_KERNEL)
def input_extents(geometry):
    """``(rows, columns)`` of a sample's padded input planes."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    return _extent(h, pt, oh_n, kh, dh), _extent(w_in, pl, ow_n, kw, dw)


@njit(**CPU_KERNEL)
def gradient_extents(geometry):
    """``(rows, columns)`` of a sample's padded G planes (the input gradient's operand)."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    return (_extent(oh_n, (kh - 1) * dh - pt, h, kh, dh),
            _extent(ow_n, (kw - 1) * dw - pl, w_in, kw, dw))


@njit(**CPU_KERNEL)
def tap_offsets(channels, kh, kw, dh, dw, rows, columns):
    """Where tap (c, i, j) reads in padded planes of ``rows`` x ``columns``, relative to its
    output's first tap."""
    offsets = aligned_empty(channels * kh * kw, np.int64)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                offsets[(c * kh + i) * kw + j] = (c * rows + i * dh) * columns + j * dw
    return offsets


@njit(**CPU_KERNEL)
def blocked_weights(w, o_out, k):
    """The forward's filter: w, (O, K) flat, as (O/8, K, 8) flat, ``blocked[o // 8, t, o % 8]
    = w[o, t]``, zeros past O: a tile's 8 channels of each tap side by side."""
    blocked = aligned_empty(round_up(o_out, TILE_ROWS) * k, w.dtype)
    blocked[:] = 0
    for o in range(o_out):
        for t in range(k):
            blocked[((o // TILE_ROWS) * k + t) * TILE_ROWS + o % TILE_ROWS] = w[o * k + t]
    return blocked


@njit(**CPU_KERNEL)
def flipped_weights(w, o_out, c_in, kh, kw):
    """The input gradient's filter, blocked as ``blocked_weights``: ``flipped[c // 8, (o·KH
    + KH-1-i)·KW + KW-1-j, c % 8] = w[o, c, i, j]``."""
    k = o_out * kh * kw
    flipped = aligned_empty(round_up(c_in, TILE_ROWS) * k, w.dtype)
    flipped[:] = 0
    for o in range(o_out):
        for c in range(c_in):
            for i in range(kh):
                for j in range(kw):
                    t = (o * kh + kh - 1 - i) * kw + kw - 1 - j
                    flipped[((c // TILE_ROWS) * k + t) * TILE_ROWS + c % TILE_ROWS] = \
                        w[((o * c_in + c) * kh + i) * kw + j]
    return flipped


@njit(inline="always")
def _pad_planes(source, first, channels, h, w, top, left, rows, columns, padded):
    """``channels`` planes of h x w from ``source[first:]`` into ``padded`` (rows x columns
    each, then slack), ``top`` zero rows above and ``left`` zero columns before."""
    padded[:] = 0
    for c in range(channels):
        for r in range(h):
            at = first + (c * h + r) * w
            to = (c * rows + r + top) * columns + left
            for p in range(w):   # a loop: a slice copy per row cost ~2 ms per batch
                padded[to + p] = source[at + p]


@njit(inline="always")
def padded_size(channels, rows, columns):
    """A padded operand's scratch: its planes and a tile's overrun past the last one."""
    return channels * rows * columns + columns + TILE_COLUMNS


@njit(inline="always")
def sums_stride(out_rows, columns):
    """The distance between two channels' planes in ``direct_sums``' layout."""
    return round_up(out_rows * columns, TILE_COLUMNS)


@njit(inline="always")
def sums_size(channels, out_rows, columns):
    """``_direct_sums``' scratch, and 16 lanes that ``copy_rows`` may read past it."""
    return round_up(channels, TILE_ROWS) * sums_stride(out_rows, columns) + LANES


@njit(inline="always")
def _direct_sums(a, channels, v, v_offsets, taps_per_plane, plane, sums):
    """``sums[k·P + q] = Σ_r a[k // 8, r, k % 8] · v[q + v_offsets[r]]`` for channels k and the
    flat positions q < ``plane`` (P: ``plane`` rounded up to 32): stride 1 makes 32
    neighbouring outputs of a padded plane read 32 neighbouring inputs, a vector; the
    columns past the output's width are computed and never read. The taps run in chunks of
    ``CHUNK_PLANES`` planes of v (``taps_per_plane`` taps each), each over every tile, so a
    chunk's planes and filter stay in L1."""
    count = v_offsets.size
    stride = sums_stride(plane, 1)
    a_at = np.empty(TILE_ROWS, np.int64)
    a_off = _multiples(count, TILE_ROWS)
    sums[:] = 0
    chunk = CHUNK_PLANES * taps_per_plane
    for r0 in range(0, count, chunk):
        r1 = min(r0 + chunk, count)
        for k0 in range(0, channels, TILE_ROWS):
            for k in range(TILE_ROWS):   # a last tile's rows past the channels: zero weights
                a_at[k] = k0 * count + k
            for q0 in range(0, plane, TILE_COLUMNS):
                _outer_tile(a, a_at, a_off[r0:r1], r1 - r0, v, q0, v_offsets[r0:r1], sums,
                            k0 * stride + q0, stride)


@njit(**CPU_KERNEL)
def copy_rows(sums, stride, columns, out, first, channels, out_rows, width):
    """``out[first + (k·rows + r)·width + p] = sums[k·stride + r·columns + p]``: the rows of
    ``channels`` planes of direct sums (``stride`` apart, ``columns`` wide) into NCHW, 16
    lanes a load and a store: a row narrower than 16 spills into the next rows' start, which
    they then overwrite (the rows go in address order); the rows within 16 of the block's
    end go lane by lane, so nothing past ``out``'s block is touched (another thread's
    sample). ``sums`` has 16 lanes of slack past its last plane."""
    end = first + channels * out_rows * width
    for k in range(channels):
        for r in range(out_rows):
            at = first + (k * out_rows + r) * width
            row = k * stride + r * columns
            if width < LANES:
                if at + LANES <= end:
                    store_lanes(out, at, load_lanes(sums, row))
                else:
                    for p in range(width):
                        out[at + p] = sums[row + p]
                continue
            for p in range(0, width - LANES, LANES):
                store_lanes(out, at + p, load_lanes(sums, row + p))
            store_lanes(out, at + width - LANES, load_lanes(sums, row + width - LANES))


@njit(**CPU_KERNEL)
def forward_sums(x, n, geometry, weights, offsets, padded, sums):
    """Sample n's convolution sums (stride 1, no bias): ``sums[o·P + oh·columns + ow]`` (P:
    ``OH·columns`` rounded up to 32, ``columns`` the padded input's). ``weights``:
    ``blocked_weights``; ``offsets``: ``tap_offsets`` of the padded input."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    rows, columns = input_extents(geometry)
    _pad_planes(x, n * c_in * h * w_in, c_in, h, w_in, pt, pl, rows, columns, padded)
    _direct_sums(weights, o_out, padded, offsets, kh * kw, oh_n * columns, sums)


@njit(**CPU_KERNEL)
def grad_input_sums(gradient, geometry, flipped, offsets, padded, sums):
    """A sample's input gradient (stride 1) from its G (O, OH·OW), as ``forward_sums`` lays
    out its sums (C planes of H rows, G's padded ``columns``): the forward's loop on G padded
    by ``(K-1)·D - pad`` before, with the ``flipped_weights``; ``offsets``: ``tap_offsets``
    of the padded G."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    rows, columns = gradient_extents(geometry)
    _pad_planes(gradient.ravel(), 0, o_out, oh_n, ow_n, (kh - 1) * dh - pt,
                (kw - 1) * dw - pl, rows, columns, padded)
    _direct_sums(flipped, c_in, padded, offsets, kh * kw, h * columns, sums)


@njit(**CPU_KERNEL)
def position_offsets(geometry, columns):
    """Where each output position's first tap reads in padded planes ``columns`` wide."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    offsets = aligned_empty(oh_n * ow_n, np.int64)
    for oh in range(oh_n):
        for ow in range(ow_n):
            offsets[oh * ow_n + ow] = oh * columns + ow
    return offsets


@njit(inline="always")
def weight_partial_size(k, o_out):
    """``grad_weight_sample``'s partial: K rounded up to tile rows, O to tile columns."""
    return round_up(k, TILE_ROWS) * round_up(o_out, TILE_COLUMNS)


@njit(**CPU_KERNEL)
def grad_weight_sample(x, n, geometry, gradient, offsets, positions, padded, blocked_g,
                       partial):
    """``partial[t·O' + o] += Σ_p G[o, p] · x_n[tap t of position p]`` (O' = O rounded up to
    32; rows past K are scratch), 8 taps x 32 channels a tile, the positions in order.
    ``offsets``: ``tap_offsets`` of the padded input; ``positions``: ``position_offsets``;
    ``blocked_g``: (OH·OW, O') scratch, its extra columns 0."""
    nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    rows, columns = input_extents(geometry)
    _pad_planes(x, n * c_in * h * w_in, c_in, h, w_in, pt, pl, rows, columns, padded)
    g_columns = round_up(o_out, TILE_COLUMNS)
    count = positions.size
    for o in range(o_out):
        for p in range(count):
            blocked_g[p * g_columns + o] = gradient[o, p]
    g_offsets = _multiples(count, g_columns)
    a_at = np.empty(TILE_ROWS, np.int64)
    k = offsets.size
    for t0 in range(0, k, TILE_ROWS):
        for row in range(TILE_ROWS):
            a_at[row] = offsets[min(t0 + row, k - 1)]
        for block in range(0, o_out, TILE_COLUMNS):
            _outer_tile(padded, a_at, positions, count, blocked_g, block, g_offsets, partial,
                        t0 * g_columns + block, g_columns)
