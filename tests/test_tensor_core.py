"""ops.tensor_core's instructions alone: one warp's TF32 and bf16 tiles against NumPy.

The inputs are rounded in NumPy as the instructions round them (TF32: 10 mantissa bits, ties
away from zero; bf16: 7 bits, ties to even), so the products must match the float64 product
of the rounded inputs within float32 accumulation (K terms of size ~1: a few ulp). Inline PTX
runs on a GPU only, not in the simulator.
"""
import functools

import numpy as np
import pytest


def _round_tf32(x):
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _round_bf16(x):
    bits = np.asarray(x, np.float32).view(np.uint32)
    tie_to_even = (bits >> np.uint32(16)) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + tie_to_even) & np.uint32(0xFFFF0000)).view(np.float32)


def test_rounding_references_keep_the_instructions_mantissa_bits():
    # the references themselves: 1 + 2^-11 is a TF32 tie (rounds away), 1 + 2^-8 a bf16 tie
    # (rounds to even: down to 1)
    assert _round_tf32(np.float32(1 + 2 ** -11)) == np.float32(1 + 2 ** -10)
    assert _round_bf16(np.float32(1 + 2 ** -8)) == np.float32(1)
    assert _round_bf16(np.float32(1 + 3 * 2 ** -8)) == np.float32(1 + 2 ** -6)


@functools.cache
def _kernels():
    from ops.cuda_backend import cuda
    from ops.tensor_core import mma_bf16, mma_tf32, pack_bf16, to_tf32

    @cuda.jit
    def tiles_tf32(a, b, c):
        """C (16x8) = A (16xK) · B (Kx8), K a multiple of 8, in K steps of 8."""
        lane = cuda.threadIdx.x
        g, i = lane // 4, lane % 4
        d0 = d1 = d2 = d3 = np.float32(0)
        for k in range(0, a.shape[1], 8):
            d0, d1, d2, d3 = mma_tf32(
                to_tf32(a[g, k + i]), to_tf32(a[g + 8, k + i]), to_tf32(a[g, k + i + 4]),
                to_tf32(a[g + 8, k + i + 4]), to_tf32(b[k + i, g]), to_tf32(b[k + i + 4, g]),
                d0, d1, d2, d3)
        c[g, 2 * i], c[g, 2 * i + 1], c[g + 8, 2 * i], c[g + 8, 2 * i + 1] = d0, d1, d2, d3

    @cuda.jit
    def tiles_bf16(a, b, c):
        """C (16x8) = A (16xK) · B (Kx8), K a multiple of 16, in K steps of 16."""
        lane = cuda.threadIdx.x
        g, i = lane // 4, lane % 4
        d0 = d1 = d2 = d3 = np.float32(0)
        for k in range(0, a.shape[1], 16):
            lo, hi = k + 2 * i, k + 2 * i + 8
            d0, d1, d2, d3 = mma_bf16(
                pack_bf16(a[g, lo], a[g, lo + 1]), pack_bf16(a[g + 8, lo], a[g + 8, lo + 1]),
                pack_bf16(a[g, hi], a[g, hi + 1]), pack_bf16(a[g + 8, hi], a[g + 8, hi + 1]),
                pack_bf16(b[lo, g], b[lo + 1, g]), pack_bf16(b[hi, g], b[hi + 1, g]),
                d0, d1, d2, d3)
        c[g, 2 * i], c[g, 2 * i + 1], c[g + 8, 2 * i], c[g + 8, 2 * i + 1] = d0, d1, d2, d3

    return tiles_tf32, tiles_bf16


@pytest.mark.gpu
@pytest.mark.parametrize("precision, k", [("tf32", 8), ("tf32", 40), ("bf16", 16),
                                          ("bf16", 48)])
def test_one_warp_tile_matches_numpy_on_the_rounded_inputs(precision, k):
    from ops.cuda_backend import cuda
    rng = np.random.default_rng(k)
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    tiles_tf32, tiles_bf16 = _kernels()
    kernel, rounding = ((tiles_tf32, _round_tf32) if precision == "tf32"
                        else (tiles_bf16, _round_bf16))
    out = cuda.device_array((16, 8), np.float32)
    kernel[1, 32](cuda.to_device(a), cuda.to_device(b), out)
    got = out.copy_to_host()
    want = rounding(a).astype(np.float64) @ rounding(b).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(want).max(),
                               err_msg=f"{precision} 16x8x{k} tile")
    # and the rounding is really there: fp32 inputs would differ by about the rounding error
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - exact).max() > 1e-6 * np.abs(exact).max()
