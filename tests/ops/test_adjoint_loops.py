"""The adjoint pairs written as one loop each (``ops.im2col_cpu._patch_loop``: im2col and
col2im-add; ``ops.pool_cpu._avg_pool_loop``: the average pool and its gradient) compute what the
two loops they replaced computed, bit for bit: against references written as those loops'
arithmetic in its order, element by element in float32, and against each other (an adjoint
pair satisfies ``<im2col(x), c> = <x, col2im(c)>``). On CUDA the average pool gathers in the
order the CPU scatters, so the two devices agree bit for bit too.
"""
import numpy as np
import pytest

import engine
from engine.autograd import apply
from ops.im2col_cpu import col2im_add, im2col
from ops.pool import AvgPool2DOp
from ops.pool_cpu import avg_pool_blocks_cpu, avg_pool_grad_blocks_cpu

# (N, C, H, W, O, KH, KW, SH, SW, PT, PB, PL, PR, DH, DW, GROUPS)
CONV_GEOMETRIES = {
    "same (the shift path)": (2, 3, 7, 6, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1),
    "strided, uneven padding, groups": (2, 4, 9, 8, 6, 3, 2, 2, 3, 1, 2, 0, 1, 1, 1, 2),
    "dilated rows": (1, 2, 10, 11, 2, 3, 3, 1, 1, 2, 2, 0, 0, 2, 1, 1),
    "mostly padding (shift path)": (1, 2, 5, 5, 2, 5, 5, 1, 1, 4, 4, 4, 4, 1, 1, 1),
}


def _geometry(n, c, h, w, o, kh, kw, sh, sw, pt, pb, pl, pr, dh, dw, groups):
    """The kernels' geometry tuple (ops/conv_cpu.py's meta without HAS_BIAS)."""
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    return (n, c, h, w, o, oh, ow, kh, kw, sh, sw, pt, pl, dh, dw, groups)


def _taps(geometry):
    """(row of cols, column of cols, plane index or None in the padding) in the loops'
    order: channel, kernel row, kernel column, output row, output column."""
    n, c_in, h, w, o, oh_n, ow_n, kh, kw, sh, sw, pt, pl, dh, dw, groups = geometry
    for c in range(c_in // groups):
        for i in range(kh):
            for j in range(kw):
                for oh in range(oh_n):
                    for ow in range(ow_n):
                        ih, iw = oh * sh - pt + i * dh, ow * sw - pl + j * dw
                        inside = 0 <= ih < h and 0 <= iw < w
                        yield ((c * kh + i) * kw + j, oh * ow_n + ow, c,
                               ih * w + iw if inside else None)


@pytest.mark.parametrize("case", list(CONV_GEOMETRIES), ids=str)
def test_im2col_and_col2im_add_are_the_loops_they_replaced(case):
    geometry = _geometry(*CONV_GEOMETRIES[case])
    n, c_in, h, w, o, oh_n, ow_n, kh, kw = geometry[:9]
    groups = geometry[15]
    cg = c_in // groups
    sample, group = n - 1, groups - 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n * c_in * h * w).astype(np.float32)
    grad_cols = rng.standard_normal((cg * kh * kw, oh_n * ow_n)).astype(np.float32)
    first = (sample * c_in + group * cg) * h * w   # the group's first plane of the sample

    cols = np.full_like(grad_cols, np.nan)   # every element written
    im2col(x, sample, group, geometry, cols)
    want = np.empty_like(cols)
    for row, column, c, at in _taps(geometry):
        want[row, column] = 0 if at is None else x[first + c * h * w + at]
    np.testing.assert_array_equal(cols, want)

    grad_x = np.full(x.size, np.float32(0.25))
    col2im_add(grad_x, sample, group, geometry, grad_cols.copy())   # cols is its scratch
    want = np.full(x.size, np.float32(0.25))
    for row, column, c, at in _taps(geometry):
        if at is not None:   # one float32 addition at a time, in the loops' order
            want[first + c * h * w + at] += grad_cols[row, column]
    assert grad_x.tobytes() == want.tobytes()

    # the pair is adjoint: <im2col(x), g> = <x, col2im(g)> (float64, up to rounding)
    x64, g64 = x.astype(np.float64), grad_cols.astype(np.float64)
    cols64, back = np.empty_like(g64), np.zeros_like(x64)
    im2col(x64, sample, group, geometry, cols64)
    col2im_add(back, sample, group, geometry, g64.copy())
    np.testing.assert_allclose(np.vdot(cols64, g64), np.vdot(x64, back), rtol=1e-12)


# (planes, H, W, KH, KW, SH, SW, PH, PW): overlapping windows with padding, tiling ones
POOL_GEOMETRIES = [(3, 7, 9, 3, 2, 2, 1, 1, 1), (2, 6, 6, 2, 2, 2, 2, 0, 0),
                   (2, 8, 7, 3, 3, 1, 2, 1, 0)]


@pytest.mark.parametrize("geometry", POOL_GEOMETRIES, ids=str)
def test_avg_pool_and_its_gradient_are_the_loops_they_replaced(geometry):
    planes, h, w, kh, kw, sh, sw, ph, pw = geometry
    oh_n, ow_n = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    meta = (planes, h, w, oh_n, ow_n, kh, kw, sh, sw, ph, pw)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(planes * h * w).astype(np.float32)
    grad_out = rng.standard_normal(planes * oh_n * ow_n).astype(np.float32)
    scale = np.float32(1 / (kh * kw))

    def windows():
        for plane in range(planes):
            for oh in range(oh_n):
                for ow in range(ow_n):
                    inside = [(plane * h + ih) * w + iw
                              for ih in range(max(oh * sh - ph, 0), min(oh * sh - ph + kh, h))
                              for iw in range(max(ow * sw - pw, 0), min(ow * sw - pw + kw, w))]
                    yield (plane * oh_n + oh) * ow_n + ow, inside

    out = np.full(grad_out.size, np.nan, np.float32)
    avg_pool_blocks_cpu(x, out, meta, scale)
    want = np.empty_like(out)
    for at, inside in windows():   # the window's sum in row-major order, then the scale
        total = np.float32(0)
        for index in inside:
            total += x[index]
        want[at] = total * scale
    assert out.tobytes() == want.tobytes()

    grad_x = np.full(x.size, np.nan, np.float32)
    avg_pool_grad_blocks_cpu(grad_out, grad_x, meta, scale)
    want = np.zeros_like(x)
    for at, inside in windows():   # each input adds its windows in row-major window order
        for index in inside:
            want[index] += grad_out[at]
    assert grad_x.tobytes() == (want * scale).tobytes()


@pytest.mark.cuda
def test_avg_pool_and_its_gradient_agree_bit_for_bit_on_both_devices():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    upstream = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    results = []
    for device in ("cpu", "cuda"):
        t = engine.tensor(x, device=device, requires_grad=True)
        y = apply(AvgPool2DOp, t, kernel_size=3, stride=2, padding=1)   # windows overlap
        (y * engine.tensor(upstream, device=device)).sum().backward()
        results.append((y.numpy(), t.grad.numpy()))
    (y_cpu, grad_cpu), (y_cuda, grad_cuda) = results
    assert y_cpu.tobytes() == y_cuda.tobytes()
    assert grad_cpu.tobytes() == grad_cuda.tobytes()
