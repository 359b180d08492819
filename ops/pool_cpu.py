"""The CPU kernels of MaxPool2D and AvgPool2D (``ops.pool`` has the ops, their semantics and
the CUDA kernels): each walks a block of planes and their rows with no index division per
element, and runs in blocks of planes on the engine's threads (``ops.cpu_threads.in_blocks``):
a plane's results are the same bits in any block.
"""
from numba import njit

from ops.im2col_cpu import valid_range
from ops.cpu_threads import in_blocks
from ops.lanes import (LANES, add_lanes, added_where_equal, broadcast_lanes, even_lanes,
                       high_doubled, index_lanes, later_wins, load_lanes, low_doubled, mul_lanes,
                       odd_lanes, store_lanes)
from ops.launch import CPU_KERNEL

_PLANE_LOOPS = dict(CPU_KERNEL, error_model="numpy", nogil=True)   # a block of planes a call


@njit(inline="always")
def _geometry_cpu(meta):
    return (meta[0], meta[1], meta[2], meta[3], meta[4], meta[5], meta[6], meta[7], meta[8],
            meta[9], meta[10])


@njit(inline="always")
def _halving(kh, kw, sh, sw, ph, pw):
    """The 2x2 window at stride 2 without padding (both pools of engine.models' CNN): the CPU
    kernels run it as its own loop, with no window bounds, in the general loop's order, so
    the results are the same bits. Measured on the 2-core machine, the CNN's step replayed
    (bench.cpu_step --model cnn, 2 threads): max forward over 128x32x28x28 6.5 ms in the
    general loop; avg forward and backward over 128x64x14x14 2.3 and 2.2 ms."""
    return kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0


@njit(inline="always")
def _take_larger(top, top_at, value, value_at):
    """The running maximum after ``value``: it wins when larger, or NaN (a select, not a
    branch: see the module docstring)."""
    better = (value > top) | (value != value)
    return (value if better else top), (value_at if better else top_at)


@njit(inline="always")
def _max_halving_row(source, first, w, best, best_at):
    """One output row of the halving max, its windows' top-left elements at ``first + 2·ow``
    of the plane ``source``."""
    for ow in range(best.size):
        at = first + 2 * ow
        top, top_at = _take_larger(source[at], at, source[at], at)
        top, top_at = _take_larger(top, top_at, source[at + 1], at + 1)
        top, top_at = _take_larger(top, top_at, source[at + w], at + w)
        top, top_at = _take_larger(top, top_at, source[at + w + 1], at + w + 1)
        best[ow], best_at[ow] = top, top_at


@njit(inline="always")
def _max_halving_lanes(x, base, first, w, out, argmax, at):
    """16 windows of the halving max at once, the windows' top-left elements at ``first +
    2·k`` of the plane at ``x[base:]``, their results into ``out[at:at + 16]`` and
    ``argmax``: the 32 inputs of each row as two vectors, each window's four elements the
    even and odd lanes of its rows, taken in ``_max_halving_row``'s order (the same bits).
    One thread over 128x32x28x28 float32 on the 2-core Xeon, alternating in one process:
    3.8-5.9 ms a row at a time (its stride-2 reads kept LLVM's vectoriser out), 0.92-1.22."""
    top_low, top_high = load_lanes(x, base + first), load_lanes(x, base + first + LANES)
    low, high = load_lanes(x, base + first + w), load_lanes(x, base + first + w + LANES)
    top, top_at = even_lanes(top_low, top_high), index_lanes(argmax, first, 2)
    top, top_at = later_wins(top, top_at, odd_lanes(top_low, top_high),
                             index_lanes(argmax, first + 1, 2))
    top, top_at = later_wins(top, top_at, even_lanes(low, high),
                             index_lanes(argmax, first + w, 2))
    top, top_at = later_wins(top, top_at, odd_lanes(low, high),
                             index_lanes(argmax, first + w + 1, 2))
    store_lanes(out, at, top)
    store_lanes(argmax, at, top_at)


@njit(**_PLANE_LOOPS)
def max_pool_cpu(x, out, argmax, meta, first_plane, last_plane):
    planes, h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = _geometry_cpu(meta)
    halving = _halving(kh, kw, sh, sw, ph, pw)
    end = last_plane * oh_n * ow_n   # this block's outputs end here (another's follow)
    for plane in range(first_plane, last_plane):
        base = plane * h * w
        source = x[base:base + h * w]
        for oh in range(oh_n):
            at = (plane * oh_n + oh) * ow_n
            if halving:
                # 16 windows at a time while their rows' 32 inputs lie in x and their 16
                # results in this block: lanes past the row are written, then overwritten
                # by the next row's (the rows go in address order); the rest one at a time
                ow0, top = 0, 2 * oh * w   # top: the row pair's first element in the plane
                while (ow0 < ow_n and base + top + 2 * ow0 + w + 2 * LANES <= x.size
                       and at + ow0 + LANES <= end):
                    _max_halving_lanes(x, base, top + 2 * ow0, w, out, argmax, at + ow0)
                    ow0 += LANES
                if ow0 < ow_n:
                    _max_halving_row(source, top + 2 * ow0, w, out[at + ow0:at + ow_n],
                                     argmax[at + ow0:at + ow_n])
                continue
            best, best_at = out[at:at + ow_n], argmax[at:at + ow_n]
            h0 = oh * sh - ph
            for ow in range(ow_n):
                w0 = ow * sw - pw
                top_at = max(h0, 0) * w + max(w0, 0)
                top = source[top_at]
                for ih in range(max(h0, 0), min(h0 + kh, h)):
                    for iw in range(max(w0, 0), min(w0 + kw, w)):
                        top, top_at = _take_larger(top, top_at, source[ih * w + iw],
                                                   ih * w + iw)
                best[ow], best_at[ow] = top, top_at


@njit(inline="always")
def _zero_outside_halving_windows(image, at, h, w, oh_n, ow_n):
    """Zeros the column and the row of the plane at ``image[at:]`` that no halving window
    holds (an odd width or height), the last writes of a gradient written window by window."""
    zero = image.dtype.type(0)
    for row in range(at, at + 2 * oh_n * w, w):   # the column no window holds
        for iw in range(2 * ow_n, w):
            image[row + iw] = zero
    for i in range(at + 2 * oh_n * w, at + h * w):   # the row no window holds
        image[i] = zero


@njit(inline="always")
def _max_grad_halving_lanes(argmax, grad_out, at, grad_in, base, row):
    """One input row's 32 elements under the 16 halving windows ``grad_out[at:at + 16]``,
    from ``row`` of the plane at ``grad_in[base:]`` (the windows' top or bottom row): each
    element ``0 + its window's gradient`` where it is the window's argmax, else 0 (the
    zeroed plane and the scatter's one add: the same bits)."""
    g, a = load_lanes(grad_out, at), load_lanes(argmax, at)
    store_lanes(grad_in, base + row, added_where_equal(
        low_doubled(a), index_lanes(argmax, row, 1), low_doubled(g)))
    store_lanes(grad_in, base + row + LANES, added_where_equal(
        high_doubled(a), index_lanes(argmax, row + LANES, 1), high_doubled(g)))


@njit(inline="always")
def _max_grad_halving_row(argmax, grad_out, at, target, first, w, count):
    """The same for ``count`` windows one at a time, both their rows, the windows' top-left
    elements at ``first + 2·ow`` of the plane ``target``."""
    zero = target.dtype.type(0)
    for ow in range(count):
        cell, value, top_at = first + 2 * ow, zero + grad_out[at + ow], argmax[at + ow]
        for tap in (cell, cell + 1, cell + w, cell + w + 1):
            target[tap] = value if top_at == tap else zero


@njit(**_PLANE_LOOPS)
def max_pool_grad_cpu(argmax, grad_out, grad_in, meta, first_plane, last_plane):
    """Scatters each window's gradient to its argmax, windows in row-major order: each input
    element sums its windows in the order of the CUDA gather. The halving windows (which
    do not overlap) write each element once instead, 16 windows at a time: over 128x32x28x28
    float32 on the 2-core Xeon, alternating in one process, one thread 1.28-2.42 ms zeroing
    and scattering, 0.98-1.31 in lanes; two threads 0.94-1.38, 0.59-0.73."""
    planes, h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = _geometry_cpu(meta)
    zero = grad_in.dtype.type(0)
    halving = _halving(kh, kw, sh, sw, ph, pw)
    end = last_plane * h * w   # this block's elements end here (another's follow)
    lanes_end = (ow_n + LANES - 1) // LANES * LANES   # a row's windows in chunks of 16
    for plane in range(first_plane, last_plane):
        base = plane * h * w
        target = grad_in[base:base + h * w]
        if not halving:
            for i in range(h * w):
                target[i] = zero
            first = plane * oh_n * ow_n
            for o in range(first, first + oh_n * ow_n):
                target[argmax[o]] += grad_out[o]
            continue
        # In lanes where the last row pair's last 16 gradients lie in grad_out and its 32
        # elements a row in this block (the block's last plane goes one window at a time):
        # lanes past a row write the next rows, which this thread writes later (the top
        # row's pass before the bottom's, the column and row no window holds last). With a
        # check a row and its leftover windows one at a time in the same loop, the lanes ran
        # 0.48 ns an element against 0.24 without (256 planes of 28x28, one thread; the
        # scatter 0.68 in that run)
        last_at = (plane * oh_n + oh_n - 1) * ow_n
        room = min(grad_out.size - last_at, (end - base - 2 * (oh_n - 1) * w - w) // 2)
        if room >= lanes_end:
            for oh in range(oh_n):
                at, top = (plane * oh_n + oh) * ow_n, 2 * oh * w
                for row in (top, top + w):
                    for ow0 in range(0, lanes_end, LANES):
                        _max_grad_halving_lanes(argmax, grad_out, at + ow0, grad_in, base,
                                                row + 2 * ow0)
        else:
            for oh in range(oh_n):
                _max_grad_halving_row(argmax, grad_out, (plane * oh_n + oh) * ow_n, target,
                                      2 * oh * w, w, ow_n)
        _zero_outside_halving_windows(grad_in, base, h, w, oh_n, ow_n)


@njit(inline="always")
def _avg_halving_lanes(x, first, w, out, at, scale):
    """16 windows of the halving average at once, their top-left elements at ``first + 2·k``
    of x, their results into ``out[at:at + 16]``: ``_avg_halving_plane``'s sums, lane by
    lane in its order (the same bits)."""
    top_low, top_high = load_lanes(x, first), load_lanes(x, first + LANES)
    low, high = load_lanes(x, first + w), load_lanes(x, first + w + LANES)
    total = add_lanes(broadcast_lanes(scale - scale), even_lanes(top_low, top_high))
    total = add_lanes(total, odd_lanes(top_low, top_high))
    total = add_lanes(total, even_lanes(low, high))
    total = add_lanes(total, odd_lanes(low, high))
    store_lanes(out, at, mul_lanes(total, broadcast_lanes(scale)))


@njit(inline="always")
def _avg_grad_halving_lanes(grad_out, at, grad_in, row, scale):
    """The adjoint's row of 32 elements from ``row`` of grad_in under the 16 windows
    ``grad_out[at:at + 16]``: each ``(0 + its window's gradient) · scale``."""
    value = mul_lanes(add_lanes(broadcast_lanes(scale - scale), load_lanes(grad_out, at)),
                      broadcast_lanes(scale))
    store_lanes(grad_in, row, low_doubled(value))
    store_lanes(grad_in, row + LANES, high_doubled(value))


@njit(inline="always")
def _avg_halving_plane(source, target, plane, h, w, oh_n, ow_n, scale, adjoint, end):
    """Plane ``plane`` of the halving average: each window the sum of its 4 elements in
    row-major order, then scaled; or its adjoint (``adjoint``, the caller's constant): each
    element in a window gets ``(0 + its window's gradient) · scale`` (windows do not
    overlap: one add each), the row and column no window holds (an odd size) 0. The general
    loop's sums in its order, so the same bits. 16 windows at a time where the plane's last
    row pair's lanes lie in the arrays and their results in this block (its outputs or
    elements end at ``end``), as the max pool's (lanes past a row are written again later);
    the block's last plane a window at a time. Alternating with the loop of windows in one
    process on the 2-core Xeon, 128x64x14x14 float32, medians of two runs: one thread
    forward 1.86, 1.41 -> 0.76, 0.75 ms, backward 1.75, 1.50 -> 0.96, 0.92; two threads
    forward 0.98, 1.66 -> 0.46, 0.80, backward 0.93, 1.71 -> 0.56, 0.95. Not in the loop's
    closure: a closure over a compiled function is compiled again in every process
    (tests/ops/test_numba_cache.py)."""
    zero = scale - scale
    image, windows = (target, source) if adjoint else (source, target)
    image_at, windows_at = plane * h * w, plane * oh_n * ow_n
    lanes_end = (ow_n + LANES - 1) // LANES * LANES   # a row's windows in chunks of 16
    last_top, last_at = image_at + 2 * (oh_n - 1) * w, windows_at + (oh_n - 1) * ow_n
    if adjoint:
        in_lanes = last_at + lanes_end <= windows.size and last_top + w + 2 * lanes_end <= end
    else:
        in_lanes = last_top + w + 2 * lanes_end <= image.size and last_at + lanes_end <= end
    if in_lanes:
        for oh in range(oh_n):
            at, top = windows_at + oh * ow_n, image_at + 2 * oh * w
            if adjoint:   # the top row's pass before the bottom's, as the max pool's
                for row in (top, top + w):
                    for ow0 in range(0, lanes_end, LANES):
                        _avg_grad_halving_lanes(windows, at + ow0, image, row + 2 * ow0,
                                                scale)
            else:
                for ow0 in range(0, lanes_end, LANES):
                    _avg_halving_lanes(image, top + 2 * ow0, w, windows, at + ow0, scale)
    else:
        for oh in range(oh_n):
            at, top = windows_at + oh * ow_n, image_at + 2 * oh * w
            for ow in range(ow_n):
                cell = top + 2 * ow
                if adjoint:
                    value = (zero + windows[at + ow]) * scale
                    image[cell] = image[cell + 1] = image[cell + w] = image[cell + w + 1] = value
                else:
                    total = zero + image[cell]
                    total += image[cell + 1]
                    total += image[cell + w]
                    total += image[cell + w + 1]
                    windows[at + ow] = total * scale
    if adjoint:
        _zero_outside_halving_windows(image, image_at, h, w, oh_n, ow_n)


def _avg_pool_loop(adjoint):
    """The CPU average pool (``adjoint=False``): ``avg_pool_cpu(x, out, meta, scale)``, each
    output the sum of its window in row-major order, then scaled; or its adjoint (``True``):
    ``avg_pool_grad_cpu(grad_out, grad_in, meta, scale)``, each plane zeroed, every window's
    gradient scattered over it, then scaled, so every input element adds its windows in
    row-major window order (j descending is ow ascending), as the CUDA gather does. One loop
    written once; the direction is a constant of the closure, so each compiled kernel holds
    only its own branches (Numba prunes ``if`` on a frozen closure value)."""

    def avg_pool_loop(source, target, meta, scale, first_plane, last_plane):
        planes, h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw = _geometry_cpu(meta)
        zero = scale - scale
        halving = _halving(kh, kw, sh, sw, ph, pw)
        end = last_plane * (h * w if adjoint else oh_n * ow_n)   # this block's results end
        for plane in range(first_plane, last_plane):
            if halving:
                _avg_halving_plane(source, target, plane, h, w, oh_n, ow_n, scale, adjoint, end)
                continue
            image = (target if adjoint else source)[plane * h * w:(plane + 1) * h * w]
            if adjoint:
                for i in range(h * w):
                    image[i] = zero
            for oh in range(oh_n):
                at = (plane * oh_n + oh) * ow_n
                windows = (source if adjoint else target)[at:at + ow_n]
                if not adjoint:
                    for ow in range(ow_n):
                        windows[ow] = zero
                h0 = oh * sh - ph
                for ih in range(max(h0, 0), min(h0 + kh, h)):
                    for tap in range(kw):
                        j = kw - 1 - tap if adjoint else tap
                        ow_lo, ow_hi = valid_range(ow_n, sw, j - pw, w)
                        for ow in range(ow_lo, ow_hi):
                            if adjoint:
                                image[ih * w + ow * sw - pw + j] += windows[ow]
                            else:
                                windows[ow] += image[ih * w + ow * sw - pw + j]
                if not adjoint:
                    for ow in range(ow_n):
                        windows[ow] *= scale
            if adjoint:
                for i in range(h * w):
                    image[i] *= scale

    avg_pool_loop.__name__ = avg_pool_loop.__qualname__ = ("avg_pool_grad_cpu" if adjoint
                                                           else "avg_pool_cpu")
    return njit(**_PLANE_LOOPS)(avg_pool_loop)


avg_pool_cpu = _avg_pool_loop(adjoint=False)
avg_pool_grad_cpu = _avg_pool_loop(adjoint=True)


def _planes(meta_at, input_at, seconds_per_element):
    """``in_blocks``' rule for a pool kernel: blocks of the planes (meta's first value), by
    one thread's time an element of its input ``input_at``."""
    return (lambda args: int(args[meta_at][0]),
            lambda args: args[input_at].size * seconds_per_element)


# The CPU side of each pool kernel, by one thread's time an input element (128x32x28x28
# float32, kernel 2, the 2-core EPYC: ops.pool's notes)
max_pool_blocks_cpu = in_blocks(max_pool_cpu, *_planes(3, 0, 0.35e-9))   # lanes, Xeon
max_pool_grad_blocks_cpu = in_blocks(max_pool_grad_cpu, *_planes(3, 2, 0.3e-9))
avg_pool_blocks_cpu = in_blocks(avg_pool_cpu, *_planes(2, 0, 0.9e-9))
avg_pool_grad_blocks_cpu = in_blocks(avg_pool_grad_cpu, *_planes(2, 1, 1.0e-9))
