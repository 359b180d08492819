"""im2col and its adjoint col2im-add on the CPU, one loop written once (``_patch_loop``):
Conv2D's CPU path where the direct loops do not pay (``ops.conv_cpu``). ``geometry`` is
``ops.conv_cpu``'s tuple (N, C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS).
"""
from numba import njit

from ops.launch import CPU_KERNEL


@njit(inline="always")
def valid_range(count, stride, offset, size):
    """``[lo, hi)``: the positions p in [0, count) whose ``p·stride + offset`` lies in
    [0, size)."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = 0 if size - offset <= 0 else (size - offset + stride - 1) // stride
    hi = min(hi, count)
    return lo, max(lo, hi)


@njit(inline="always")
def _is_shift(geometry):
    """True when every im2col row is the input plane shifted by one offset (stride 1 and the
    output as wide as the input: 'same' padding), so rows copy in one contiguous run."""
    return geometry[9] == 1 and geometry[10] == 1 and geometry[6] == geometry[3]


@njit(inline="always")
def _zero_padding_columns(row, at, ow_lo, ow_hi, ow_n, zero):
    """The columns of output row ``at`` (of ``row``) whose tap reads the left or right
    padding."""
    for ow in range(ow_lo):
        row[at + ow] = zero
    for ow in range(ow_hi, ow_n):
        row[at + ow] = zero


def _patch_loop(adjoint):
    """The im2col loop (``adjoint=False``) or its adjoint (``True``), written once; the
    direction is a constant of the closure, so each compiled kernel holds only its own
    branches (Numba prunes ``if`` on a frozen closure value).

    im2col, ``im2col(x, n, g, geometry, cols)``: ``cols[(c·KH + i)·KW + j, oh·OW + ow] =
    x[n, g·Cg + c, ih, iw]``, 0 in the padding.
    Its adjoint, ``col2im_add(grad_x, n, g, geometry, cols)``: ``grad_x[n, g·Cg + c, ih,
    iw] += cols[...]`` over the taps inside the input, in a fixed order (c, i, j, oh, ow).
    It zeroes the padding taps of ``cols`` (scratch) on the shift path, which then adds
    whole rows."""
    def patch_loop(image, n, g, geometry, cols):
        nb, c_in, h, w_in, o_out, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
        cg = c_in // groups
        positions = oh_n * ow_n
        zero = cols.dtype.type(0)
        shifted = _is_shift(geometry)
        for c in range(cg):
            first = (n * c_in + g * cg + c) * h * w_in
            plane = image[first:first + h * w_in]
            for i in range(kh):
                oh_lo, oh_hi = valid_range(oh_n, sh, i * dh - pt, h)
                for j in range(kw):
                    row = cols[(c * kh + i) * kw + j, :positions]
                    ow_lo, ow_hi = valid_range(ow_n, sw, j * dw - pl, w_in)
                    if not adjoint:   # the output rows whose taps all read the padding
                        row[:oh_lo * ow_n] = zero
                        row[oh_hi * ow_n:] = zero
                    if shifted:
                        if adjoint:   # before the whole run is added
                            for oh in range(oh_lo, oh_hi):
                                _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        shift = (i * dh - pt) * w_in + j * dw - pl
                        lo = max(oh_lo * ow_n, -shift)
                        hi = min(oh_hi * ow_n, plane.size - shift)
                        run, window = row[lo:hi], plane[lo + shift:hi + shift]
                        for p in range(run.size):
                            if adjoint:
                                window[p] += run[p]
                            else:
                                run[p] = window[p]
                        if not adjoint:   # after the run copied over them
                            for oh in range(oh_lo, oh_hi):
                                _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        start = (oh * sh - pt + i * dh) * w_in - pl + j * dw
                        if not adjoint:
                            _zero_padding_columns(row, oh * ow_n, ow_lo, ow_hi, ow_n, zero)
                        for ow in range(ow_lo, ow_hi):
                            if adjoint:
                                plane[start + ow * sw] += row[oh * ow_n + ow]
                            else:
                                row[oh * ow_n + ow] = plane[start + ow * sw]

    patch_loop.__name__ = patch_loop.__qualname__ = "col2im_add" if adjoint else "im2col"
    return njit(**CPU_KERNEL)(patch_loop)


im2col = _patch_loop(adjoint=False)
col2im_add = _patch_loop(adjoint=True)
