"""ops.cuda.ptx's instructions alone: one warp's TF32 and bf16 tiles against NumPy.

The inputs are rounded in NumPy as the instructions round them (TF32: 10 mantissa bits, ties
away from zero; bf16: 7 bits, ties to even), so the products must match the float64 product
of the rounded inputs within float32 accumulation (K terms of size ~1: a few ulp). Inline PTX
runs on a GPU only, not in the simulator.
"""
import functools

import numpy as np
import pytest

from tests.support.rounded_operands import assert_product_of_rounded, round_bf16, round_tf32


def test_rounding_references_keep_the_instructions_mantissa_bits():
    # the references themselves: 1 + 2^-11 is a TF32 tie (rounds away), 1 + 2^-8 a bf16 tie
    # (rounds to even: down to 1)
    assert round_tf32(np.float32(1 + 2 ** -11)) == np.float32(1 + 2 ** -10)
    assert round_bf16(np.float32(1 + 2 ** -8)) == np.float32(1)
    assert round_bf16(np.float32(1 + 3 * 2 ** -8)) == np.float32(1 + 2 ** -6)


@functools.cache
def _kernels():
    from ops.cuda import cuda
    from ops.cuda.ptx import mma_bf16, mma_tf32, pack_bf16, to_tf32

    def tiles(k_step, mma, operands):
        """C (16x8) = A (16xK) · B (Kx8), K a multiple of ``k_step``, in K steps of it: each
        step's A and B fragments of this lane from ``operands``, into one ``mma``."""

        @cuda.jit
        def kernel(a, b, c):
            lane = cuda.threadIdx.x
            g, i = lane // 4, lane % 4
            d0 = d1 = d2 = d3 = np.float32(0)
            for k in range(0, a.shape[1], k_step):
                a0, a1, a2, a3, b0, b1 = operands(a, b, g, i, k)
                d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3)
            c[g, 2 * i], c[g, 2 * i + 1], c[g + 8, 2 * i], c[g + 8, 2 * i + 1] = d0, d1, d2, d3
        return kernel

    @cuda.jit(device=True)
    def tf32_operands(a, b, g, i, k):   # a K step of 8: A columns k+i, k+i+4, B rows alike
        return (to_tf32(a[g, k + i]), to_tf32(a[g + 8, k + i]), to_tf32(a[g, k + i + 4]),
                to_tf32(a[g + 8, k + i + 4]), to_tf32(b[k + i, g]), to_tf32(b[k + i + 4, g]))

    @cuda.jit(device=True)
    def bf16_operands(a, b, g, i, k):   # a K step of 16: pairs from k+2i and k+2i+8
        lo, hi = k + 2 * i, k + 2 * i + 8
        return (pack_bf16(a[g, lo], a[g, lo + 1]), pack_bf16(a[g + 8, lo], a[g + 8, lo + 1]),
                pack_bf16(a[g, hi], a[g, hi + 1]), pack_bf16(a[g + 8, hi], a[g + 8, hi + 1]),
                pack_bf16(b[lo, g], b[lo + 1, g]), pack_bf16(b[hi, g], b[hi + 1, g]))

    return tiles(8, mma_tf32, tf32_operands), tiles(16, mma_bf16, bf16_operands)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, k", [("tf32", 8), ("tf32", 40), ("bf16", 16),
                                          ("bf16", 48)])
def test_one_warp_tile_matches_numpy_on_the_rounded_inputs(precision, k):
    from ops.cuda import cuda
    rng = np.random.default_rng(k)
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    tiles_tf32, tiles_bf16 = _kernels()
    kernel, rounding = ((tiles_tf32, round_tf32) if precision == "tf32"
                        else (tiles_bf16, round_bf16))
    out = cuda.device_array((16, 8), np.float32)
    kernel[1, 32](cuda.to_device(a), cuda.to_device(b), out)
    got = out.copy_to_host()
    want = rounding(a).astype(np.float64) @ rounding(b).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(want).max(),
                               err_msg=f"{precision} 16x8x{k} tile")
    # and the rounding is really there: fp32 inputs would differ by about the rounding error
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - exact).max() > 1e-6 * np.abs(exact).max()


# ------------------------------------------------------------------ the GEMM template's tensor-core tilings

ROUNDINGS = {"high": round_tf32, "medium": round_bf16}


@pytest.fixture
def precision(request):
    """Runs the test under engine.set_float32_matmul_precision(request.param), then restores
    the default."""
    import engine
    engine.set_float32_matmul_precision(request.param)
    yield request.param
    engine.set_float32_matmul_precision("highest")


# (m, k, n, trans_a, trans_b): odd edges in every extent, each layout, 1024³ for the 128x128
# tiling (it alone fills the GPU there), 4096x256x4096 whole 16-byte aligned tiles, and a
# view one element into its buffer (no 16-byte loads: the scalar path)
TENSOR_CORE_SHAPES = [(130, 77, 257, False, False), (64, 128, 96, True, False),
                      (200, 70, 33, False, True), (40, 300, 36, True, True),
                      (1024, 1024, 1024, False, False), (4096, 256, 4096, False, False),
                      (4096, 256, 4096, True, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("m, k, n, trans_a, trans_b", TENSOR_CORE_SHAPES)
def test_gemm_takes_the_rounded_inputs_product(precision, m, k, n, trans_a, trans_b):
    from ops.cuda import cuda
    from ops.device import to_device
    from ops.gemm.choices import mma_format
    from ops.matmul import gemm
    assert mma_format(np.float32) == {"high": "tf32", "medium": "bf16"}[precision]
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    out = cuda.device_array((m, n), np.float32)
    gemm(to_device(a, "cuda"), to_device(b, "cuda"), trans_a, trans_b, out=out)
    got = out.copy_to_host()
    shifted_a = to_device(np.concatenate([[0], a.ravel()]).astype(np.float32), "cuda")
    shifted = cuda.device_array((m, n), np.float32)   # a 4-byte offset: the scalar fetches
    gemm(shifted_a[1:].reshape(a.shape), to_device(b, "cuda"), trans_a, trans_b, out=shifted)
    np.testing.assert_array_equal(shifted.copy_to_host(), got)
    # an output 4 bytes off its 8-byte alignment takes the fragment pairs' 4-byte stores
    shifted_out = cuda.device_array(m * n + 1, np.float32)[1:].reshape(m, n)
    gemm(to_device(a, "cuda"), to_device(b, "cuda"), trans_a, trans_b, out=shifted_out)
    np.testing.assert_array_equal(shifted_out.copy_to_host(), got)
    rounding = ROUNDINGS[precision]

    def operand(x, transposed):
        x = rounding(x).astype(np.float64)
        return x.T if transposed else x
    ra, rb = operand(a, trans_a), operand(b, trans_b)
    assert_product_of_rounded(got, ra @ rb, np.abs(ra) @ np.abs(rb), k, f"{precision} gemm")
    exact = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)
    assert np.abs(got - exact).max() > 1e-5 * np.abs(exact).max(), "no rounding: not TF32/bf16"
    again = cuda.device_array((m, n), np.float32)
    gemm(to_device(a, "cuda"), to_device(b, "cuda"), trans_a, trans_b, out=again)
    np.testing.assert_array_equal(again.copy_to_host(), got)   # a fixed order: deterministic


# (m, k, n, trans_a, trans_b): odd edges in every extent the 16-byte copies allow (an
# operand's rows a multiple of 4 elements), K not a multiple of BK, each layout
PIPELINE_SHAPES = [(131, 76, 260, False, False), (68, 132, 200, True, False),
                   (200, 68, 36, False, True), (36, 300, 44, True, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("m, k, n, trans_a, trans_b", PIPELINE_SHAPES)
def test_pipelined_tiles_take_the_rounded_inputs_product(monkeypatch, precision, split, m, k,
                                                         n, trans_a, trans_b):
    # unsplit, the pipelined tiling (cp.async into its stages, TF32 rounded as fragments are
    # read) and LARGE (tiles stashed from registers, rounded as stored) sum the same mma
    # products in the same order: the same bits. Split, their slices differ (whole steps of
    # their BK): both must be the rounded operands' product, and repeat bit for bit.
    from ops import matmul as mm
    from ops.cuda import cuda
    from ops.device import to_device
    from ops.gemm import choices, plans, tilings
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    formats = tilings.MMA_TILINGS[choices.mma_format(np.float32)]
    results = []
    for tiling in (formats.pipelined, formats.large, formats.pipelined):
        monkeypatch.setattr(plans, "pick_config", lambda *args, tiling=tiling, **options:
                            choices.GemmConfig(tiling, split))
        out = cuda.device_array((m, n), np.float32)
        mm.gemm(to_device(a, "cuda"), to_device(b, "cuda"), trans_a, trans_b, out=out)
        results.append(out.copy_to_host())
    np.testing.assert_array_equal(results[2], results[0])
    if split == 1:
        np.testing.assert_array_equal(results[0], results[1])
    ra = ROUNDINGS[precision](a).astype(np.float64)
    rb = ROUNDINGS[precision](b).astype(np.float64)
    ra, rb = ra.T if trans_a else ra, rb.T if trans_b else rb
    for got in results[:2]:
        assert_product_of_rounded(got, ra @ rb, np.abs(ra) @ np.abs(rb), k,
                                  f"{precision} pipelined gemm")


def test_the_plan_pipelines_only_operands_it_can_copy_as_they_are(monkeypatch):
    from ops.gemm import choices, mma, tilings
    monkeypatch.setattr(choices, "_multiprocessors", lambda: 132)
    pick_config, GemmConfig = choices.pick_config, choices.GemmConfig
    assert pick_config(4096, 4096, 4096, False, False, mma="tf32",
                       pipelined=tilings.TF32_PIPELINED) == GemmConfig(tilings.TF32_PIPELINED, 1)
    assert pick_config(4096, 4096, 4096, False, False,
                       mma="bf16") == GemmConfig(tilings.BF16_LARGE, 1)
    # MEDIUM tiles and FMA tilings stay as they are
    assert pick_config(1024, 1024, 1024, False, False, mma="tf32",
                       pipelined=tilings.TF32_PIPELINED).tiling == tilings.TF32_MEDIUM
    assert pick_config(4096, 4096, 4096, False, False,
                       pipelined=tilings.TF32_PIPELINED).tiling == tilings.LARGE

    class Operand:
        def __init__(self, address, shape):
            self.__cuda_array_interface__ = {"data": (address, False)}
            self.shape = shape
    aligned, shifted, odd = (Operand(1 << 20, (8, 12)), Operand((1 << 20) + 4, (8, 12)),
                             Operand(1 << 20, (8, 13)))
    assert (mma.pipelined_tiling("bf16", tilings.FORWARD, (aligned, aligned))
            == tilings.BF16_PIPELINED)
    assert mma.pipelined_tiling(None, tilings.FORWARD, (aligned, aligned)) is None
    assert mma.pipelined_tiling("tf32", tilings.PLAIN, (aligned, shifted)) is None
    assert mma.pipelined_tiling("tf32", tilings.PLAIN, (odd, aligned)) is None
    # the prologue's y (the third operand) is copied too: its own tile per stage
    assert (mma.pipelined_tiling("tf32", tilings.GRAD_A, (aligned, aligned, aligned))
            == tilings.TF32_PIPELINED_PROLOGUE)
    assert mma.pipelined_tiling("tf32", tilings.GRAD_B, (aligned, aligned, shifted)) is None


@pytest.mark.parametrize("tiling, problem", [
    (dict(stages=3), "only tensor-core tilings are pipelined"),
    (dict(mma="tf32", stages=6), "2 to 5 stages"),
    (dict(BM=256, BN=256, BK=64, TM=16, TN=16, mma="tf32", stages=4), "more than the")])
def test_check_tiling_names_what_a_pipeline_cannot_do(tiling, problem):
    from ops.gemm import tilings
    with pytest.raises(ValueError, match=problem):
        tilings.check_tiling(tilings.TF32_PIPELINED._replace(**{"mma": None, **tiling}))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high"], indirect=True)
def test_products_too_small_for_a_fragment_stay_float32(precision):
    """K = 9 (the CNN's first convolution) and N = 10 keep the FMA tilings at any precision."""
    from ops.cuda import cuda
    from ops.device import to_device
    from ops.matmul import gemm
    rng = np.random.default_rng(9)
    for m, k, n in ((300, 9, 64), (128, 128, 10)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        out = cuda.device_array((m, n), np.float32)
        gemm(to_device(a, "cuda"), to_device(b, "cuda"), out=out)
        exact = a.astype(np.float64) @ b
        assert_product_of_rounded(out.copy_to_host(), exact, np.abs(a) @ np.abs(b), k,
                                   f"{m}x{k}x{n} in float32")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("batch, fan_in, fan_out", [(132, 76, 260), (64, 128, 132)])
def test_pipelined_dense_kernels_give_the_bits_of_registered_ones(monkeypatch, precision, split,
                                                                  batch, fan_in, fan_out):
    """The fused Dense kernels on pipelined tiles: the forward's epilogue, the relu' prologue
    copied beside G and applied as fragments are read (dX on A, dW on B), and dW's row of
    ones written over the copied zeros (db; with fan_in 128 it is a row of blocks of its
    own), against the same kernels on LARGE's register-stashed tiles."""
    import engine
    from engine import nn
    from ops.gemm import choices, plans, tilings
    rng = np.random.default_rng(batch + fan_out)
    x_host = rng.standard_normal((batch, fan_in)).astype(np.float32)
    grad_out = rng.standard_normal((batch, fan_out)).astype(np.float32)
    large = tilings.MMA_TILINGS[choices.mma_format(np.float32)].large
    results = []
    for pipelines in (True, False):
        chosen = []

        def pick(*args, pipelined=None, pipelines=pipelines, chosen=chosen):
            tiling = pipelined if pipelines and pipelined else large
            chosen.append(tiling)
            return choices.GemmConfig(tiling, split)
        monkeypatch.setattr(plans, "pick_config", pick)
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(fan_out, activation="relu", input_shape=(fan_in,))])
        model.to("cuda")
        layer = model.layers[0]
        x = engine.tensor(x_host, device="cuda", requires_grad=True)
        y = layer(x)
        (y * engine.tensor(grad_out, device="cuda")).sum().backward()
        results.append([t.numpy() for t in (y, x.grad, layer.weight.grad, layer.bias.grad)])
        assert all(t.stages for t in chosen) == pipelines and len(chosen) == 3
    for got, want, what in zip(results[0], results[1], ("y", "dX", "dW", "db")):
        if split == 1:   # split, the slices are whole steps of unequal BK
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                       err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("batch, fan_in, fan_out", [(128, 784, 256), (70, 75, 66)])
def test_dense_forward_and_backward_take_the_rounded_operands(precision, batch, fan_in,
                                                              fan_out):
    """The fused Dense kernels under tensor cores: y = relu(x·W + b) from rounded x and W; the
    backward's G = grad_out·relu'(y), rounded as the kernels stash it, gives dX = G·Wᵀ,
    dW = xᵀ·G and db = Σ G."""
    import engine
    from engine import nn
    rng = np.random.default_rng(batch)
    model = nn.Sequential([nn.Dense(fan_out, activation="relu", input_shape=(fan_in,))])
    model.to("cuda")
    layer = model.layers[0]
    x = engine.tensor(rng.standard_normal((batch, fan_in)).astype(np.float32), device="cuda",
                      requires_grad=True)
    grad_out = rng.standard_normal((batch, fan_out)).astype(np.float32)
    y = layer(x)
    (y * engine.tensor(grad_out, device="cuda")).sum().backward()
    rounding = ROUNDINGS[precision]
    w, bias = layer.weight.numpy(), layer.bias.numpy()
    rx, rw = rounding(x.numpy()).astype(np.float64), rounding(w).astype(np.float64)
    z = rx @ rw
    assert_product_of_rounded(y.numpy(), np.maximum(z + bias, 0),
                               np.abs(rx) @ np.abs(rw) + np.abs(bias), fan_in, "forward")
    g = rounding(grad_out * (y.numpy() > 0)).astype(np.float64)
    assert_product_of_rounded(x.grad.numpy(), g @ rw.T, np.abs(g) @ np.abs(rw.T), fan_out,
                               "dX")
    assert_product_of_rounded(layer.weight.grad.numpy(), rx.T @ g, np.abs(rx.T) @ np.abs(g),
                               batch, "dW")
    assert_product_of_rounded(layer.bias.grad.numpy(), g.sum(0), np.abs(g).sum(0), batch,
                               "db")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("n, c, size, o, stride, padding", [(2, 32, 9, 40, 1, 1),
                                                            (4, 33, 13, 64, 2, 0),
                                                            (2, 48, 12, 96, 1, 1)])
def test_conv2d_forward_and_backward_take_the_rounded_operands(precision, n, c, size, o,
                                                                stride, padding):
    """The implicit-GEMM convolutions under tensor cores against torch's float64 convolution
    of the rounded operands (x and w; grad_out for the backward, as the kernels stash it).
    Every product of these shapes is large enough for tensor cores (``mma_suits``: the weight
    gradient's K is n·OH·OW, at least 64 here)."""
    torch = pytest.importorskip("torch")
    import engine
    rng = np.random.default_rng(o)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((o, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    ex = engine.tensor(x, device="cuda", requires_grad=True)
    ew = engine.tensor(w, device="cuda", requires_grad=True)
    eb = engine.tensor(b, device="cuda", requires_grad=True)
    y = engine.conv2d(ex, ew, eb, stride=stride, padding=padding)
    grad_out = rng.standard_normal(y.shape).astype(np.float32)
    (y * engine.tensor(grad_out, device="cuda")).sum().backward()
    rounding = ROUNDINGS[precision]

    def reference(*arrays):
        return [torch.tensor(rounding(a).astype(np.float64), requires_grad=True)
                for a in arrays]
    tx, tw = reference(x, w)
    tb = torch.tensor(b.astype(np.float64), requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=padding)
    ty.backward(torch.tensor(rounding(grad_out).astype(np.float64)))
    # the magnitudes: the same convolutions of the absolute values
    ax, aw, ag = (torch.tensor(np.abs(rounding(a)).astype(np.float64))
                  for a in (x, w, grad_out))
    forward_scale = (torch.nn.functional.conv2d(ax, aw, stride=stride, padding=padding)
                     + torch.tensor(np.abs(b).astype(np.float64))[:, None, None])
    aax, aaw = ax.clone().requires_grad_(), aw.clone().requires_grad_()
    torch.nn.functional.conv2d(aax, aaw, stride=stride, padding=padding).backward(ag)
    taps = c * 9
    assert_product_of_rounded(y.numpy(), ty.detach().numpy(), forward_scale.numpy(), taps,
                               "forward")
    assert_product_of_rounded(ex.grad.numpy(), tx.grad.numpy(), aax.grad.numpy(), o * 9,
                               "grad_input")
    positions = y.shape[0] * y.shape[2] * y.shape[3]
    assert_product_of_rounded(ew.grad.numpy(), tw.grad.numpy(), aaw.grad.numpy(), positions,
                               "grad_weight")
    assert_product_of_rounded(eb.grad.numpy(), tb.grad.numpy(),
                               np.abs(rounding(grad_out)).sum((0, 2, 3)), positions, "grad_bias")


@pytest.mark.parametrize("m, n, k, tiling, split", [
    (4096, 4096, 4096, "TF32_LARGE", 1),    # 1024 tiles: LARGE alone fills the GPU
    (128, 4096, 4096, "TF32_LARGE", 9),     # 32 tiles in 9 slices of 456: the wide MLP's x·W2
    (128, 4096, 784, "TF32_MEDIUM", 3),     # slices of 784 // 512 = 1: MEDIUM, split by the rule
    (1024, 1024, 1024, "TF32_MEDIUM", 1),   # 64 LARGE tiles x 2 slices < 132; 256 MEDIUM ones
    (32, 300, 4096, "TF32_WIDE", 32),       # at most 32 rows; 3 tiles in 32 slices of 128
])
def test_the_tensor_core_plan_takes_large_tiles_when_split_k_fills_the_gpu(monkeypatch, m, n, k,
                                                                           tiling, split):
    from ops.gemm import choices, tilings
    monkeypatch.setattr(choices, "_multiprocessors", lambda: 132)   # the H200's
    config = choices.pick_config(m, n, k, False, False, mma="tf32")
    assert config == choices.GemmConfig(tilings.TILINGS[tiling], split)


@pytest.mark.parametrize("m, n, k, split", [
    (128, 4096, 4096, 8),    # 32 tiles: 8 slices make the one wave of 264 blocks, 9 a second
    (128, 4000, 4096, 8),    # 32 tiles again (the last one part-filled)
    (256, 4096, 4096, 4),    # 64 tiles: 264 // 64 (the register tilings' ceiling: 5)
    (128, 8192, 2048, 4),    # 64 tiles in slices of 512 at least: 264 // 64
])
def test_a_pipelined_split_stays_within_one_wave_of_blocks(monkeypatch, m, n, k, split):
    from ops.gemm import choices, tilings
    monkeypatch.setattr(choices, "_multiprocessors", lambda: 132)
    config = choices.pick_config(m, n, k, False, False, mma="tf32",
                                 pipelined=tilings.TF32_PIPELINED)
    assert config == choices.GemmConfig(tilings.TF32_PIPELINED, split)
