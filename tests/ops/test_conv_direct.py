"""The direct CPU convolution (ops/conv_direct_cpu.py) that ops/conv_cpu.py picks per shape.

``check_op`` runs Conv2D, its CPU kernels forced onto the direct loops (as ``bench.conv_ops
--cpu-path direct`` does), on odd shapes those loops take (stride 1, one group, at least
``DIRECT_MIN_TAPS`` taps; the input gradient where the padding fits): float64 forward against
the NumPy reference of tests/support/references.py, float64 gradcheck, poison mode. Every case's
shape is asserted to fit, so the cases test what they name. Beside them: the direct and
im2col paths agree on the CNN's 32->64 layer in float32, and the rule's kernels give the same
bits on 1 and 2 threads.
"""
import numpy as np
import pytest

import engine
from engine.autograd import apply
from ops import cpu_threads
from ops.conv import Conv2DOp
from ops.conv_cpu import (DIRECT, DIRECT_MIN_TAPS, IM2COL, conv2d_cpu_functions,
                          direct_backward_fits, direct_forward_pays)
from ops.pointwise import RELU
from tests.support.op_check import Case, check_op
from tests.support.references import np_conv2d


def _case(x_shape, w_shape, bias=True, grad=None, direct_backward=True, **params):
    """A check_op case, its op's params, and whether the rule runs its backward direct."""
    shapes = (x_shape, w_shape) + (((w_shape[0],),) if bias else ())
    case = Case("conv2d", shapes, lambda *t: apply(Conv2DOp, *t, **params),
                lambda *a: np_conv2d(*a, **params), grad=grad)
    return case, params, direct_backward


DIRECT_CASES = [
    # 45 taps, 6 outputs: one tile of 8 channels, rows 7 and 9 wide ("same": left/top 1)
    _case((2, 5, 7, 9), (6, 5, 3, 3), padding="same", activation="relu"),
    # 33 outputs (5 tiles of 8 channels, 2 of 32 in dw), 36 taps, dilation 2, no bias
    _case((3, 4, 6, 5), (33, 4, 3, 3), bias=False, padding="same", dilation=2,
          activation="tanh"),
    # 17 input planes (two chunks of 16), a 2x1 kernel, "valid", leaky_relu
    _case((2, 17, 5, 6), (3, 17, 2, 1), padding="valid", activation="leaky_relu", alpha=0.2),
    # padding 2 rows > (KH-1)·DH = 1: the forward and dw run direct, dx im2col
    _case((2, 9, 4, 5), (4, 9, 2, 2), padding=(2, 1), activation="sigmoid",
          direct_backward=False),
    # a first layer (no image gradient), rows of 13
    _case((3, 8, 5, 13), (7, 8, 3, 3), padding=1, grad=(False, True, True)),
]


@pytest.fixture(scope="module")
def direct_kernels():
    """ops.conv's CPU kernels forced onto the direct loops while a test runs."""
    from ops import conv
    saved = conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu
    conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu = conv2d_cpu_functions(DIRECT)
    yield
    conv.CONV2D_FORWARD.cpu, conv.CONV2D_BACKWARD.cpu = saved


@pytest.mark.parametrize("case, params, backward", DIRECT_CASES,
                         ids=[str(case) for case, _, _ in DIRECT_CASES])
def test_direct_conv(case, params, backward, direct_kernels):
    op = Conv2DOp(**params)
    op.check(*[np.zeros(shape) for shape in case.shapes])
    geometry = op.meta[:16]
    assert geometry[1] * geometry[7] * geometry[8] >= DIRECT_MIN_TAPS
    assert direct_forward_pays(geometry)
    assert direct_backward_fits(geometry) == backward
    check_op(case, "cpu")


def _layer(rng, batch, c_in, size, c_out, dtype):
    meta = (batch, c_in, size, size, c_out, size, size, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1)
    x = rng.standard_normal(batch * c_in * size * size).astype(dtype)
    w = (rng.standard_normal(c_out * c_in * 9) * 0.1).astype(dtype)
    b = rng.standard_normal(c_out).astype(dtype)
    upstream = rng.standard_normal(batch * c_out * size * size).astype(dtype)
    return meta, x, w, b, upstream


def _run(forward, backward, meta, x, w, b, upstream, relu=RELU):
    alpha = x.dtype.type(0.01)
    y = np.full(upstream.size, np.nan, x.dtype)
    forward(x, w, b, y, meta, relu, alpha)
    grads = [np.full_like(x, np.nan), np.full_like(w, np.nan), np.full_like(b, np.nan)]
    backward(x, w, y, upstream, *grads, meta, relu, alpha, True, True, True)
    return [y] + grads


def test_direct_matches_im2col_on_the_cnn_layer():
    """The CNN's 32->64 3x3 "same" layer (batch 9, float32): direct against im2col + GEMM,
    each written in full (NaN-filled outputs)."""
    meta, *arrays = _layer(np.random.default_rng(0), 9, 32, 14, 64, np.float32)
    direct = _run(*conv2d_cpu_functions(DIRECT), meta, *arrays)
    im2col = _run(*conv2d_cpu_functions(IM2COL), meta, *arrays)
    for name, got, want in zip(("y", "dx", "dw", "db"), direct, im2col):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=name)


def test_direct_is_bit_identical_on_one_and_two_threads():
    from ops.conv import CONV2D_BACKWARD, CONV2D_FORWARD
    meta, *arrays = _layer(np.random.default_rng(1), 11, 32, 14, 64, np.float32)
    assert direct_forward_pays(meta[:16])
    results = []
    try:
        for threads in (1, 2):
            engine.set_num_threads(threads)
            results.append(_run(CONV2D_FORWARD.cpu, CONV2D_BACKWARD.cpu, meta, *arrays))
    finally:
        cpu_threads.set_threads(None)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)
