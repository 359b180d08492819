"""Conv2D, MaxPool2D, AvgPool2D and BatchNorm on every backend.

The ``check_op`` cases run on odd, tiny shapes (7x9 and 5x9 inputs, 3x2 kernels, stride 2, padding
1, dilation 2, groups 2) against float64 NumPy references written independently of the
kernels (a padded input sliced per tap); PyTorch checks the semantics where they are its
own (``padding="same"``, pooling ties, BatchNorm's running statistics). The ``gpu`` tests
run the network's shapes against torch in float64.
"""
import numpy as np
import pytest

import engine
from engine.autograd import apply
from engine.parameter import FlatBuffer, Parameter
from ops.batch_norm import BatchNormOp
from ops.conv import Conv2DOp
from ops.gemm import choices, tilings
from ops.gemm.choices import CONV_MODE_NAMES
from ops.gemm.conv_operands import ConvGeometry, conv_gemm_shape
from ops.gemm.tilings import CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT
from ops.pool import AvgPool2DOp, MaxPool2DOp
from ops.cuda import SIMULATOR
from ops.device import to_device, to_host
from ops.launch import LaunchRecorder
from tests.support.op_check import Case, check_op
from tests.support.references import batch_norm_case, np_batch_norm, np_conv2d, pair


# ------------------------------------------------------------------ NumPy references

def _np_pool(x, kernel_size, stride=None, padding=0, average=False):
    """Max (or mean, padded zeros counted) of each window of the padded input."""
    (kh, kw) = pair(kernel_size)
    (sh, sw) = (kh, kw) if stride is None else pair(stride)
    (ph, pw) = pair(padding)
    padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)),
                    constant_values=0.0 if average else -np.inf)
    oh = (padded.shape[2] - kh) // sh + 1
    ow = (padded.shape[3] - kw) // sw + 1
    taps = [padded[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
            for i in range(kh) for j in range(kw)]
    return np.mean(taps, axis=0) if average else np.max(taps, axis=0)


# ------------------------------------------------------------------ cases

def _conv_case(x_shape, w_shape, bias=True, grad=None, **params):
    shapes = (x_shape, w_shape) + (((w_shape[0],),) if bias else ())
    return Case("conv2d", shapes, lambda *t: apply(Conv2DOp, *t, **params),
                lambda *a: np_conv2d(*a, **params), grad=grad)


CONV_CASES = [
    _conv_case((2, 4, 7, 9), (6, 2, 3, 2), stride=2, padding=1, dilation=2, groups=2,
               activation="relu"),
    _conv_case((3, 2, 7, 9), (3, 2, 3, 2), padding="same", activation="tanh"),
    _conv_case((2, 3, 5, 9), (4, 3, 3, 2), bias=False, stride=(2, 1), padding=(1, 0)),
    _conv_case((2, 2, 7, 9), (4, 1, 3, 2), stride=(1, 2), dilation=(2, 1), groups=2,
               activation="leaky_relu", alpha=0.2),
    _conv_case((2, 3, 7, 9), (2, 3, 3, 2), padding="valid", activation="sigmoid"),
    _conv_case((3, 1, 7, 9), (2, 1, 3, 3), padding="same", activation="relu",
               grad=(False, True, True)),   # a first layer: the image needs no gradient
]


def _pool_case(op, x_shape, **params):
    cls, average = {"max_pool2d": (MaxPool2DOp, False), "avg_pool2d": (AvgPool2DOp, True)}[op]
    return Case(op, (x_shape,), lambda x: apply(cls, x, **params),
                lambda x: _np_pool(x, average=average, **params))


POOL_CASES = [
    _pool_case(op, shape, **params) for op in ("max_pool2d", "avg_pool2d")
    for shape, params in [((2, 3, 7, 9), dict(kernel_size=2)),   # the tails are dropped
                          ((2, 2, 7, 9), dict(kernel_size=(3, 2), stride=2, padding=1)),
                          ((1, 2, 7, 9), dict(kernel_size=3, stride=1, padding=1))]]


BATCH_NORM_CASES = [
    batch_norm_case((3, 2, 5, 7), training=True),
    batch_norm_case((5, 3), training=True, parameters=0),
    batch_norm_case((2, 3, 3, 5), training=True, parameters=1),
    batch_norm_case((3, 2, 5, 7), training=False),
    batch_norm_case((5, 3), training=False, parameters=1),
]

CASES = CONV_CASES + POOL_CASES + BATCH_NORM_CASES
# The simulator runs one OS thread per CUDA thread: a conv case takes 15-40 s there (a CI run
# took 20 min with all six). These three reach every branch of the CUDA conv kernels (groups,
# stride, dilation, padding, bias and none, no image gradient); the others differ only in
# their activation, which the pointwise table shares, and run on the CPU and a real GPU.
SIMULATED_CONV_CASES = (CONV_CASES[0], CONV_CASES[2], CONV_CASES[5])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    if (device == "cuda" and SIMULATOR and case in CONV_CASES
            and case not in SIMULATED_CONV_CASES):
        pytest.skip("one of the conv cases the CUDA simulator leaves to the CPU and a GPU")
    check_op(case, device)


# ------------------------------------------------------------------ Conv2D

def _conv_inputs(device, shapes, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [engine.tensor(rng.standard_normal(s), dtype=dtype, device=device,
                          requires_grad=True) for s in shapes]


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:Using padding='same'")   # torch on even kernels
@pytest.mark.parametrize("padding,dilation", [("same", 1), ("same", (2, 1)), (0, 1)])
def test_conv2d_matches_torch(device, padding, dilation):
    import torch
    x, w, b = _conv_inputs(device, ((2, 3, 7, 9), (4, 3, 3, 2), (4,)))
    y = apply(Conv2DOp, x, w, b, padding=padding, dilation=dilation)
    upstream = np.random.default_rng(1).standard_normal(y.shape)
    (y * engine.tensor(upstream, device=device)).sum().backward()
    tx, tw, tb = [torch.tensor(t.numpy(), requires_grad=True) for t in (x, w, b)]
    ty = torch.nn.functional.conv2d(tx, tw, tb, padding=padding, dilation=dilation)
    ty.backward(torch.tensor(upstream))
    for got, want in [(y, ty), (x.grad, tx.grad), (w.grad, tw.grad), (b.grad, tb.grad)]:
        np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_conv2d_backward_is_bit_reproducible(device):
    results = []
    for _ in range(2):
        x, w, b = _conv_inputs(device, ((3, 4, 7, 9), (6, 2, 3, 2), (6,)), dtype=np.float32)
        y = apply(Conv2DOp, x, w, b, stride=2, padding=1, groups=2, activation="relu")
        y.sum().backward()
        results.append([t.numpy() for t in (y, x.grad, w.grad, b.grad)])
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("shapes", [
    ((9, 16, 10, 12), (32, 16, 3, 3), (32,)),   # 144 taps: the direct loops
    ((9, 3, 25, 32), (32, 3, 3, 2), (32,))])  # 18 taps: im2col and BLAS
def test_conv2d_cpu_is_the_same_bits_in_blocks_on_1_and_2_threads(shapes):
    """The forward's samples and the backward's 8 batch slices run in blocks on the engine's
    threads (9 samples: slices of 1 and 2); each sample and each slice's partials are the
    same bits in any block, and the slices' partials add in order."""
    from ops import cpu_threads
    from ops.conv_cpu import _macs
    results = []
    try:
        for threads in (1, 2):
            engine.set_num_threads(threads)
            x, w, b = _conv_inputs("cpu", shapes, dtype=np.float32)
            y = apply(Conv2DOp, x, w, b, padding=1)
            meta = np.asarray(y._node.op.meta)
            assert len(cpu_threads.slice_blocks(9, _macs(meta)) or [()]) == threads
            assert len(cpu_threads.slice_blocks(8, 2 * _macs(meta)) or [()]) == threads
            (y * y).sum().backward()
            results.append([t.numpy() for t in (y, x.grad, w.grad, b.grad)])
    finally:
        cpu_threads.set_threads(None)
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)


def test_conv2d_writes_parameter_grads_into_the_flat_buffer(device):
    rng = np.random.default_rng(4)
    w = Parameter(to_device(rng.standard_normal((4, 3, 3, 2)), device))
    b = Parameter(to_device(rng.standard_normal(4), device))
    flat_buffer = FlatBuffer([w, b])
    x = engine.tensor(rng.standard_normal((2, 3, 7, 9)), device=device)
    apply(Conv2DOp, x, w, b, padding=1, activation="tanh").sum().backward()
    g = 1 - np.tanh(np_conv2d(x.numpy(), w.numpy(), b.numpy(), padding=1)) ** 2
    grads = to_host(flat_buffer.grad)
    np.testing.assert_allclose(grads[w.size:], g.sum(axis=(0, 2, 3)), rtol=1e-12)
    reference = engine.tensor(w.numpy(), requires_grad=True, device=device)
    apply(Conv2DOp, x, reference, engine.tensor(b.numpy(), device=device), padding=1,
          activation="tanh").sum().backward()
    np.testing.assert_allclose(grads[:w.size], reference.grad.numpy().ravel(), rtol=1e-12)
    assert x.grad is None


def test_conv2d_backward_returns_the_destination_buffers(device):
    rng = np.random.default_rng(5)
    x, w, b = [to_device(rng.standard_normal(s), device) for s in ((2, 3, 7, 9), (4, 3, 3, 2),
                                                                   (4,))]
    op = Conv2DOp(padding=1)
    op.needs_input_grad = (False, True, True)
    y = op(x, w, b)
    dw = to_device(np.full((4, 3, 3, 2), np.nan), device)
    db = to_device(np.full(4, np.nan), device)
    grads = op.backward(to_device(np.ones(y.shape), device), (None, dw, db))
    assert grads[0] is None and grads[1] is dw and grads[2] is db
    np.testing.assert_allclose(to_host(db), np.full(4, 2 * 7 * 10))   # N·OH·OW


def _conv_grads(device, arrays, requires, params, dtype=np.float64):
    """y and the gradients ``requires`` asks for, from a fixed upstream gradient."""
    tensors = [engine.tensor(a, dtype=dtype, device=device, requires_grad=r)
               for a, r in zip(arrays, requires)]
    y = apply(Conv2DOp, *tensors, **params)
    upstream = np.random.default_rng(1).standard_normal(y.shape)
    (y * engine.tensor(upstream, dtype=dtype, device=device)).sum().backward()
    return [y.numpy()] + [t.grad.numpy() for t in tensors if t.requires_grad]


def _forcing_conv(monkeypatch, mode, geometry, batch, split, tiling=None):
    """Force the config of one conv GEMM through an entry of ops.gemm.choices.CONV_CHOICES."""
    m, n, k = conv_gemm_shape(mode, geometry, batch)
    tiling = tiling or choices.pick_conv_tiling(m, n, k)
    monkeypatch.setitem(choices.CONV_CHOICES, (CONV_MODE_NAMES[mode], m, n, k),
                        choices.GemmConfig(tiling, split))


# groups 2, stride 2, padding 1, dilation 2, 7x9: dw's K is N·OH·OW = 2·3·5 = 30 positions
SPLIT_CASE = ((2, 4, 7, 9), (6, 2, 3, 2), dict(stride=2, padding=1, dilation=2, groups=2,
                                               activation="tanh"))
SPLIT_GEOMETRY = ConvGeometry(4, 7, 9, 6, 3, 5, 3, 2, 2, 2, 1, 1, 2, 2, 2, 1)


@pytest.mark.cuda
def test_conv2d_split_k_weight_gradient_matches_the_cpu(monkeypatch):
    """dw and db as partial products over 3 K slices per group, summed in slice order: equal
    to the CPU's in float64, bit equal run to run."""
    _forcing_conv(monkeypatch, CONV_GRAD_WEIGHT, SPLIT_GEOMETRY, 2, 3)
    x_shape, w_shape, params = SPLIT_CASE
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in (x_shape, w_shape, w_shape[:1])]
    requires = (False, True, True)
    with LaunchRecorder() as recorder:
        first = _conv_grads("cuda", arrays, requires, params)
    names = recorder.cuda_kernel_names()
    assert "conv2d_grad_weight_partial_cuda" in names
    assert "conv2d_grad_weight_sum_cuda" in names
    assert "conv2d_grad_input_gemm_cuda" not in names   # the image needs no gradient
    for got, want in zip(first, _conv_grads("cpu", arrays, requires, params)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    second = _conv_grads("cuda", arrays, requires, params)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("requires", [(True, False, True), (False, True, False)])
def test_conv2d_cuda_gradients_of_some_inputs_match_the_cpu(requires):
    """db without dw (dw then goes to scratch) and dw with a frozen bias (no ones column)."""
    x_shape, w_shape, params = SPLIT_CASE
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s) for s in (x_shape, w_shape, w_shape[:1])]
    for got, want in zip(_conv_grads("cuda", arrays, requires, params),
                         _conv_grads("cpu", arrays, requires, params)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("tiling", ["COMPACT_128", "WIDE"])   # vec runs of 4x2 and 2x4
def test_conv2d_under_a_real_tiling_matches_the_cpu(monkeypatch, tiling):
    """The tilings a GPU runs (runs of adjacent rows and columns per thread, 128 and 256
    threads; the simulator's own tiling has neither), forced on all three GEMMs, dw split."""
    for mode, split in ((CONV_FORWARD, 1), (CONV_GRAD_INPUT, 1),
                        (CONV_GRAD_WEIGHT, 2)):
        _forcing_conv(monkeypatch, mode, SPLIT_GEOMETRY, 2, split, tilings.TILINGS[tiling])
    x_shape, w_shape, params = SPLIT_CASE
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal(s) for s in (x_shape, w_shape, w_shape[:1])]
    for got, want in zip(_conv_grads("cuda", arrays, (True,) * 3, params),
                         _conv_grads("cpu", arrays, (True,) * 3, params)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_conv_choices_split_only_the_weight_gradient(monkeypatch):
    _forcing_conv(monkeypatch, CONV_FORWARD, SPLIT_GEOMETRY, 2, 2, tilings.COMPACT)
    m, n, k = conv_gemm_shape(CONV_FORWARD, SPLIT_GEOMETRY, 2)
    with pytest.raises(ValueError, match=r"CONV_CHOICES\[\('forward', 3, 30, 12\)\] asks for "
                                         r"split 2.*only grad_weight splits K"):
        choices.pick_conv_config(CONV_FORWARD, m, n, k, 2)


def test_conv_gemm_shapes_of_the_cnn():
    """(M, N, K) of one group's GEMM: channels by positions, positions the image's."""
    second = ConvGeometry(32, 14, 14, 64, 14, 14, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1)
    assert conv_gemm_shape(CONV_FORWARD, second, 128) == (64, 128 * 196, 32 * 9)
    assert conv_gemm_shape(CONV_GRAD_INPUT, second, 128) == (32, 128 * 196, 64 * 9)
    assert conv_gemm_shape(CONV_GRAD_WEIGHT, second, 128) == (64, 32 * 9 + 1, 128 * 196)
    assert conv_gemm_shape(CONV_GRAD_WEIGHT, SPLIT_GEOMETRY._replace(BIAS=0), 2) == (
        3, 2 * 3 * 2, 2 * 3 * 5)


def test_conv2d_rejects_bad_arguments(device):
    x = engine.zeros(2, 4, 7, 9, device=device)
    w = engine.zeros(6, 2, 3, 2, device=device)
    with pytest.raises(ValueError, match=r"conv2d: expects x \(N, C, H, W\).*x \(4, 7, 9\)"):
        apply(Conv2DOp, engine.zeros(4, 7, 9, device=device), w)
    with pytest.raises(ValueError, match=r"groups=1.*x \(2, 4, 7, 9\), w \(6, 2, 3, 2\)"):
        apply(Conv2DOp, x, w)
    with pytest.raises(ValueError, match=r"groups=3.*divide"):
        apply(Conv2DOp, x, w, groups=3)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\).*b \(5,\)"):
        apply(Conv2DOp, x, w, engine.zeros(5, device=device), groups=2)
    with pytest.raises(ValueError, match="padding='same' needs stride 1, got stride \\(2, 2\\)"):
        apply(Conv2DOp, x, w, groups=2, padding="same", stride=2)
    with pytest.raises(ValueError, match="padding must be an int, a pair, 'valid' or 'same'"):
        apply(Conv2DOp, x, w, groups=2, padding="full")
    with pytest.raises(ValueError, match="stride must be >= 1, got 0"):
        apply(Conv2DOp, x, w, groups=2, stride=0)
    with pytest.raises(ValueError, match=r"dilation must be an int or a pair of ints"):
        apply(Conv2DOp, x, w, groups=2, dilation=(1, 2, 3))
    with pytest.raises(ValueError, match=r"padded input \(7x9\) is smaller than the dilated "
                                         r"kernel \(9x2\)"):
        apply(Conv2DOp, x, w, groups=2, dilation=(4, 1))
    with pytest.raises(ValueError, match="conv2d: unknown activation 'gelu'"):
        apply(Conv2DOp, x, w, groups=2, activation="gelu")
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        apply(Conv2DOp, x, w, groups=2, activation="leaky_relu", alpha=-1)
    with pytest.raises(TypeError, match="conv2d: inputs have different dtypes"):
        apply(Conv2DOp, x, engine.zeros(6, 2, 3, 2, dtype=np.float64, device=device), groups=2)


# ------------------------------------------------------------------ pooling

@pytest.mark.torch
@pytest.mark.parametrize("cls", [MaxPool2DOp, AvgPool2DOp])
def test_pooling_matches_torch_on_ties_and_padding(device, cls):
    import torch
    rng = np.random.default_rng(6)
    x = np.round(rng.standard_normal((2, 3, 7, 9)), 0)   # many ties inside the windows
    params = dict(kernel_size=(3, 2), stride=(2, 1), padding=1)
    t = engine.tensor(x, device=device, requires_grad=True)
    y = apply(cls, t, **params)
    upstream = rng.standard_normal(y.shape)
    (y * engine.tensor(upstream, device=device)).sum().backward()
    functional = torch.nn.functional
    function = functional.max_pool2d if cls is MaxPool2DOp else functional.avg_pool2d
    tx = torch.tensor(x, requires_grad=True)
    ty = function(tx, **params)
    ty.backward(torch.tensor(upstream))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(t.grad.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_max_pool_gives_a_tied_window_gradient_to_its_first_maximum(device):
    x = engine.tensor(np.ones((1, 1, 2, 3)), device=device, requires_grad=True)
    apply(MaxPool2DOp, x, kernel_size=2, stride=1).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[[[1, 1, 0], [0, 0, 0]]]])


def test_max_pool_propagates_nan(device):
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    y = apply(MaxPool2DOp, engine.tensor(x, device=device), kernel_size=2).numpy()
    assert np.isnan(y[0, 0, 0, 0]) and not np.isnan(y[0, 0, 1, 1])


def test_the_halving_pools_own_cpu_loop_gives_the_general_loop_s_bits():
    """2x2 at stride 2 (ops.pool_cpu._halving) runs a loop of its own on the CPU: the general
    loop's results bit for bit, written out in float32 in its order (ties to the first
    maximum, NaN to the last, sums from 0 in row-major order, then the scale), the odd
    row and column no window holds dropped (forward) or given 0 (backward)."""
    from ops.pool import AVG_POOL, AVG_POOL_GRAD, MAX_POOL
    rng = np.random.default_rng(3)
    planes, h, w = 6, 5, 7
    x = np.round(rng.standard_normal((planes, h, w)), 0).astype(np.float32)   # ties
    x[0, 0, 1] = x[1, 2, 2] = x[1, 3, 3] = np.nan
    x[2, :2, :2] = -0.0
    meta = (planes, h, w, 2, 3, 2, 2, 2, 2, 0, 0)
    windows = np.stack([x[:, 0:4:2, 0:6:2], x[:, 0:4:2, 1:6:2], x[:, 1:4:2, 0:6:2],
                        x[:, 1:4:2, 1:6:2]], axis=-1)   # (planes, 2, 3, 4), row-major taps
    offsets = np.array([0, 1, w, w + 1])
    first = (2 * np.arange(2)[:, None] * w + 2 * np.arange(3)[None, :])[None, :, :, None]
    best, best_at = windows[..., 0], first[..., 0]
    for tap in range(4):
        value = windows[..., tap]
        better = (value > best) | np.isnan(value)
        best, best_at = np.where(better, value, best), np.where(better, first[..., 0] +
                                                               offsets[tap], best_at)
    out, argmax = np.empty(planes * 6, np.float32), np.empty(planes * 6, np.int32)
    MAX_POOL(x.ravel(), out, argmax, meta)
    np.testing.assert_array_equal(out, best.ravel())
    np.testing.assert_array_equal(argmax, best_at.ravel())
    scale = np.float32(0.25)
    total = np.float32(0) + windows[..., 0]
    for tap in range(1, 4):
        total = total + windows[..., tap]
    averaged = np.empty(planes * 6, np.float32)
    AVG_POOL(x.ravel(), averaged, meta, scale)
    np.testing.assert_array_equal(averaged.view(np.int32), (total * scale).ravel().view(np.int32))
    grad_out = rng.standard_normal((planes, 2, 3)).astype(np.float32)
    grad_out[0, 0, 0] = -0.0
    expected = np.zeros((planes, h, w), np.float32)
    spread = (np.float32(0) + grad_out) * scale
    for i in range(2):
        for j in range(2):
            expected[:, i:4:2, j:6:2] = spread
    grad_in = np.full(planes * h * w, np.nan, np.float32)   # every element written
    AVG_POOL_GRAD(grad_out.ravel(), grad_in, meta, scale)
    np.testing.assert_array_equal(grad_in.view(np.int32), expected.ravel().view(np.int32))


def test_the_halving_max_pool_gradient_writes_the_scatter_s_bits_in_any_blocks():
    """The halving max's CPU gradient writes each element once, 16 windows at a time, lanes
    past a row into the next rows (ops.pool_cpu.max_pool_grad_cpu): in blocks of planes in
    any order each block writes its own planes only, every element ``0 + its window's
    gradient`` where it is the argmax (-0 to +0, NaN kept), else 0, as the zeroed plane and
    the general loop's scatter give; rows of 1 to 4 chunks, odd rows and columns."""
    from ops.pool_cpu import max_pool_cpu, max_pool_grad_cpu
    rng = np.random.default_rng(4)
    unwritten = np.int32(0x7FC01234)   # a NaN no kernel makes
    for planes, h, w in ((5, 28, 28), (4, 9, 70), (3, 5, 101), (6, 4, 4), (4, 7, 33)):
        oh, ow = h // 2, w // 2
        meta = np.asarray((planes, h, w, oh, ow, 2, 2, 2, 2, 0, 0), np.int64)
        x = np.round(rng.standard_normal(planes * h * w), 0).astype(np.float32)   # ties
        x[::37] = np.nan
        out = np.empty(planes * oh * ow, np.float32)
        argmax = np.empty(out.size, np.int32)
        max_pool_cpu(x, out, argmax, meta, 0, planes)
        grad_out = rng.standard_normal(out.size).astype(np.float32)
        grad_out[::5], grad_out[::11] = -0.0, np.nan
        expected = np.zeros((planes, h * w), np.float32)
        expected[np.arange(planes).repeat(oh * ow), argmax] = np.float32(0) + grad_out
        for blocks in ([(0, planes)], [(2, planes), (0, 2)], [(p, p + 1) for p in range(planes)]):
            grad_in = np.full((planes, h * w), unwritten, np.int32)
            done = np.zeros(planes, bool)
            for first, last in blocks:
                max_pool_grad_cpu(argmax, grad_out, grad_in.view(np.float32).ravel(), meta,
                                  first, last)
                done[first:last] = True
                assert (grad_in[~done] == unwritten).all(), (h, w, blocks)
            np.testing.assert_array_equal(grad_in, expected.view(np.int32))


def test_the_halving_average_pool_writes_only_its_block_s_planes_with_the_whole_run_s_bits():
    """The halving average's CPU loops run 16 windows at a time, lanes past a row writing the
    next rows (ops.pool_cpu._avg_halving_plane): in blocks of planes in any order each block
    writes its own planes' results only, and they are the bits of one run over all planes
    (forward and gradient; rows of 1 to 4 chunks, odd rows and columns, NaN, inf and -0)."""
    from ops.pool_cpu import avg_pool_cpu, avg_pool_grad_cpu
    rng = np.random.default_rng(5)
    unwritten = np.int32(0x7FC01234)   # a NaN no kernel makes
    scale = np.float32(0.25)
    for planes, h, w in ((5, 28, 28), (4, 9, 70), (3, 5, 101), (6, 4, 4), (4, 7, 33)):
        oh, ow = h // 2, w // 2
        meta = np.asarray((planes, h, w, oh, ow, 2, 2, 2, 2, 0, 0), np.int64)
        x = rng.standard_normal(planes * h * w).astype(np.float32)
        x[::37], x[::41], x[::43] = np.nan, np.inf, -0.0
        g = rng.standard_normal(planes * oh * ow).astype(np.float32)
        g[::5], g[::11] = -0.0, np.nan
        for kernel, source, size in ((avg_pool_cpu, x, oh * ow), (avg_pool_grad_cpu, g, h * w)):
            whole = np.empty(planes * size, np.float32)
            kernel(source, whole, meta, scale, 0, planes)
            for blocks in ([(2, planes), (0, 2)], [(p, p + 1) for p in reversed(range(planes))]):
                target = np.full((planes, size), unwritten, np.int32)
                done = np.zeros(planes, bool)
                for first, last in blocks:
                    kernel(source, target.view(np.float32).ravel(), meta, scale, first, last)
                    done[first:last] = True
                    assert (target[~done] == unwritten).all(), (kernel, h, w, blocks)
                np.testing.assert_array_equal(target.ravel(), whole.view(np.int32))


@pytest.mark.parametrize("cls", [MaxPool2DOp, AvgPool2DOp])
def test_pooling_rejects_bad_arguments(device, cls):
    name = cls.name
    x = engine.zeros(2, 3, 7, 9, device=device)
    with pytest.raises(ValueError, match=rf"{name}: expects x \(N, C, H, W\), got shape \(7, 9\)"):
        apply(cls, engine.zeros(7, 9, device=device), kernel_size=2)
    with pytest.raises(ValueError, match=rf"{name}: kernel_size must be an int or a pair"):
        apply(cls, x, kernel_size=None)
    with pytest.raises(ValueError, match=rf"{name}: stride must be >= 1"):
        apply(cls, x, kernel_size=2, stride=0)
    with pytest.raises(ValueError, match=rf"{name}: padding 2 must be at most half of "
                                         r"kernel_size 3"):
        apply(cls, x, kernel_size=3, padding=2)
    with pytest.raises(ValueError, match=r"kernel_size \(8, 2\) does not fit in the padded "
                                         r"input \(7x9\)"):
        apply(cls, x, kernel_size=(8, 2))


# ------------------------------------------------------------------ BatchNorm

def _batch_norm_inputs(device, shape, seed=7):
    rng = np.random.default_rng(seed)
    channels = shape[1]
    arrays = [rng.uniform(-2, 3, shape), rng.uniform(-1, 1, channels),
              rng.uniform(0.5, 2, channels), rng.standard_normal(channels),
              rng.standard_normal(channels)]
    return arrays, [engine.tensor(a, device=device) for a in arrays]


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 5, 7)])
def test_batch_norm_updates_running_statistics_as_torch(device, shape):
    import torch
    arrays, (x, running_mean, running_var, weight, bias) = _batch_norm_inputs(device, shape)
    mean_buffer, var_buffer = running_mean.data, running_var.data
    torch_mean, torch_var = torch.tensor(arrays[1]), torch.tensor(arrays[2])
    for step in range(3):
        batch = engine.tensor(arrays[0] * (step + 1), device=device)
        y = apply(BatchNormOp, batch, running_mean, running_var, weight, bias, training=True,
                  momentum=0.3)
        ty = torch.nn.functional.batch_norm(
            torch.tensor(arrays[0] * (step + 1)), torch_mean, torch_var,
            torch.tensor(arrays[3]), torch.tensor(arrays[4]), training=True, momentum=0.3)
        np.testing.assert_allclose(y.numpy(), ty.numpy(), rtol=1e-12, atol=1e-12)
    assert running_mean.data is mean_buffer and running_var.data is var_buffer   # in place
    np.testing.assert_allclose(running_mean.numpy(), torch_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(running_var.numpy(), torch_var.numpy(), rtol=1e-12)
    y = apply(BatchNormOp, x, running_mean, running_var, weight, bias)   # eval: torch's default
    ty = torch.nn.functional.batch_norm(torch.tensor(arrays[0]), torch_mean, torch_var,
                                        torch.tensor(arrays[3]), torch.tensor(arrays[4]))
    np.testing.assert_allclose(y.numpy(), ty.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(running_var.numpy(), torch_var.numpy(), rtol=1e-12)


def test_batch_norm_writes_parameter_grads_into_the_flat_buffer(device):
    arrays, (x, running_mean, running_var, _, _) = _batch_norm_inputs(device, (3, 2, 5, 7))
    weight, bias = (Parameter(to_device(a, device)) for a in arrays[3:])
    flat_buffer = FlatBuffer([weight, bias])
    upstream = np.random.default_rng(8).standard_normal(x.shape)
    y = apply(BatchNormOp, x, running_mean, running_var, weight, bias, training=True)
    (y * engine.tensor(upstream, device=device)).sum().backward()
    xhat = np_batch_norm(arrays[0], None, None, training=True)
    np.testing.assert_allclose(to_host(flat_buffer.grad),
                               np.concatenate([(upstream * xhat).sum(axis=(0, 2, 3)),
                                               upstream.sum(axis=(0, 2, 3))]), rtol=1e-10)


def test_batch_norm_rejects_bad_arguments(device):
    _, (x, running_mean, running_var, weight, bias) = _batch_norm_inputs(device, (3, 2, 5, 7))
    with pytest.raises(ValueError, match=r"batch_norm: expects x \(N, C\) or \(N, C, H, W\), "
                                         r"got shape \(6,\)"):
        apply(BatchNormOp, engine.zeros(6, dtype=np.float64, device=device), running_mean,
              running_var)
    with pytest.raises(ValueError, match=r"weight must have shape \(2,\) for x \(3, 2, 5, 7\), "
                                         r"got \(3,\)"):
        apply(BatchNormOp, x, running_mean, running_var,
              engine.zeros(3, dtype=np.float64, device=device))
    with pytest.raises(ValueError, match="momentum must be a number in \\[0, 1\\]"):
        apply(BatchNormOp, x, running_mean, running_var, training=True, momentum=None)
    with pytest.raises(ValueError, match="eps must be > 0, got 0"):
        apply(BatchNormOp, x, running_mean, running_var, eps=0)
    with pytest.raises(ValueError, match=r"more than one value per channel, got x \(1, 2\)"):
        apply(BatchNormOp, engine.zeros(1, 2, dtype=np.float64, device=device), running_mean,
              running_var, training=True)
    with pytest.raises(TypeError, match="batch_norm: inputs have different dtypes"):
        apply(BatchNormOp, x, running_mean, engine.ones(2, device=device))


# ------------------------------------------------------------------ large shapes on a real GPU

def _gpu_close(got, want, what):
    """float32 on the GPU against float64 on the host, relative to the largest value."""
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(np.abs(want).max(), 1.0),
                               err_msg=what)


def _run_twice_on_the_gpu(fn, arrays, requires):
    """``fn``'s output and input gradients from float32 CUDA tensors, twice (bit equal)."""
    results = []
    upstream = None
    for _ in range(2):
        tensors = [engine.tensor(a, dtype=np.float32, device="cuda", requires_grad=r)
                   for a, r in zip(arrays, requires)]
        y = fn(*tensors)
        if upstream is None:
            upstream = np.random.default_rng(1).standard_normal(y.shape)
        (y * engine.tensor(upstream, dtype=np.float32, device="cuda")).sum().backward()
        results.append([y.numpy()] + [t.grad.numpy() for t, r in zip(tensors, requires) if r])
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)
    return results[0], upstream


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("x_shape,w_shape,params", [
    ((128, 1, 28, 28), (32, 1, 3, 3), dict(padding="same")),     # the network's first conv
    ((128, 32, 14, 14), (64, 32, 3, 3), dict(padding="same")),   # and its second
    ((5, 6, 33, 31), (8, 3, 5, 4), dict(stride=2, padding=2, dilation=2, groups=2)),
])
def test_conv2d_on_large_shapes_matches_torch_in_float64(x_shape, w_shape, params):
    import torch
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(x_shape).astype(np.float32),
              (rng.standard_normal(w_shape) * 0.1).astype(np.float32),
              rng.standard_normal(w_shape[0]).astype(np.float32)]
    (y, *grads), upstream = _run_twice_on_the_gpu(
        lambda *t: apply(Conv2DOp, *t, activation="tanh", **params), arrays, (True,) * 3)
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    ty = torch.tanh(torch.nn.functional.conv2d(*tensors, **params))
    ty.backward(torch.tensor(upstream))
    _gpu_close(y, ty.detach().numpy(), "forward")
    for what, got, t in zip(("dx", "dw", "db"), grads, tensors):
        _gpu_close(got, t.grad.numpy(), what)


# the plain-FMA tilings, held to float32 accuracy (the tensor-core tilings round their
# operands: tests/ops/cuda/test_tensor_core.py checks the convolutions under them)
CONV_TILINGS = [name for name, tiling in tilings.TILINGS.items()
                if name != "SIMULATED" and tiling.mma is None]


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("tiling", CONV_TILINGS)
@pytest.mark.parametrize("x_shape,w_shape,params,split", [
    ((128, 32, 14, 14), (64, 32, 3, 3), dict(padding="same"), 3),   # the CNN's second conv
    ((5, 6, 33, 31), (8, 3, 5, 4), dict(stride=2, padding=2, dilation=2, groups=2), 7),
])
def test_conv2d_every_tiling_matches_torch_in_float64(monkeypatch, tiling, x_shape, w_shape,
                                                      params, split):
    """Each tiling the sweep may pick, forced on all three GEMMs (dw split in ``split``: 3 or 7
    slices per group, ragged)."""
    import torch
    rng = np.random.default_rng(12)
    arrays = [rng.standard_normal(x_shape).astype(np.float32),
              (rng.standard_normal(w_shape) * 0.1).astype(np.float32),
              rng.standard_normal(w_shape[0]).astype(np.float32)]
    op = Conv2DOp(activation="relu", **params)
    op.check(*arrays)
    geometry = ConvGeometry(*op.meta[1:])
    for mode, slices in ((CONV_FORWARD, 1), (CONV_GRAD_INPUT, 1),
                         (CONV_GRAD_WEIGHT, split)):
        _forcing_conv(monkeypatch, mode, geometry, x_shape[0], slices, tilings.TILINGS[tiling])
    with LaunchRecorder() as recorder:
        (y, *grads), upstream = _run_twice_on_the_gpu(
            lambda *t: apply(Conv2DOp, *t, activation="relu", **params), arrays, (True,) * 3)
    assert "conv2d_grad_weight_partial_cuda" in recorder.cuda_kernel_names()
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    ty = torch.relu(torch.nn.functional.conv2d(*tensors, **params))
    ty.backward(torch.tensor(upstream))
    _gpu_close(y, ty.detach().numpy(), f"forward under {tiling}")
    for what, got, t in zip(("dx", "dw", "db"), grads, tensors):
        _gpu_close(got, t.grad.numpy(), f"{what} under {tiling}, split {split}")


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("cls", [MaxPool2DOp, AvgPool2DOp])
@pytest.mark.parametrize("x_shape,params", [((128, 32, 28, 28), dict(kernel_size=2)),
                                            ((5, 7, 33, 31), dict(kernel_size=(3, 2), stride=2,
                                                                   padding=1))])
def test_pooling_on_large_shapes_matches_torch_in_float64(cls, x_shape, params):
    import torch
    x = np.random.default_rng(10).standard_normal(x_shape).astype(np.float32)
    (y, grad), upstream = _run_twice_on_the_gpu(lambda t: apply(cls, t, **params), [x],
                                                (True,))
    functional = torch.nn.functional
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty = (functional.max_pool2d if cls is MaxPool2DOp else functional.avg_pool2d)(tx, **params)
    ty.backward(torch.tensor(upstream))
    _gpu_close(y, ty.detach().numpy(), "forward")
    _gpu_close(grad, tx.grad.numpy(), "dx")


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("x_shape", [(128, 64, 14, 14), (256, 100)])
def test_batch_norm_on_large_shapes_matches_torch_in_float64(x_shape):
    import torch
    rng = np.random.default_rng(11)
    channels = x_shape[1]
    x = (rng.standard_normal(x_shape) * 3 + 2).astype(np.float32)
    weight, bias = (rng.standard_normal(channels).astype(np.float32) for _ in range(2))
    running = [engine.tensor(np.zeros(channels), dtype=np.float32, device="cuda"),
               engine.tensor(np.ones(channels), dtype=np.float32, device="cuda")]
    (y, *grads), upstream = _run_twice_on_the_gpu(
        lambda t, w, b: apply(BatchNormOp, t, *running, w, b, training=True),
        [x, weight, bias], (True, True, True))
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True)
               for a in (x, weight, bias)]
    torch_mean = torch.zeros(channels, dtype=torch.float64)
    torch_var = torch.ones(channels, dtype=torch.float64)
    for _ in range(2):   # the engine's two runs updated its running statistics twice
        ty = torch.nn.functional.batch_norm(tensors[0], torch_mean, torch_var, *tensors[1:],
                                            training=True)
    ty.backward(torch.tensor(upstream))
    _gpu_close(y, ty.detach().numpy(), "forward")
    for what, got, t in zip(("dx", "dweight", "dbias"), grads, tensors):
        _gpu_close(got, t.grad.numpy(), what)
    _gpu_close(running[0].numpy(), torch_mean.numpy(), "running_mean")
    _gpu_close(running[1].numpy(), torch_var.numpy(), "running_var")


# ------------------------------------------------------------------ the benchmark script

def test_bench_conv_ops_quick_smoke(tmp_path, capsys):
    import json

    from bench import conv_ops
    path = tmp_path / "conv_ops.json"
    conv_ops.main(["--quick", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [(row["op"], row["phase"]) for row in rows] == [
        (name, phase) for name, _, _ in conv_ops.LAYERS for phase in ("forward", "backward")]
    assert all(row["us_per_call"]["engine"] > 0 for row in rows)
    assert "| conv2d relu | backward | 4x32x14x14 |" in capsys.readouterr().out


@pytest.mark.cuda
def test_bench_conv_ops_runs_on_cuda(monkeypatch, tmp_path):
    import json

    from bench import conv_ops, gpu_time
    tiny = [("conv2d relu", (1, 5, 5), dict(out=2, kernel=3, needs_x=False)),
            ("max_pool2d", (2, 5, 5), dict(kernel_size=2)),
            ("conv2d relu", (2, 4, 4), dict(out=3, kernel=3, needs_x=True)),
            ("batch_norm", (3, 4, 4), {}),
            ("avg_pool2d", (3, 4, 4), dict(kernel_size=2))]   # the simulator is slow
    monkeypatch.setattr(conv_ops, "LAYERS", tiny)
    monkeypatch.setattr(conv_ops, "QUICK_BATCH", 2)
    monkeypatch.setattr(conv_ops, "ROUNDS", 1)
    monkeypatch.setattr(conv_ops, "GPU_CALLS", 1)
    monkeypatch.setattr(gpu_time, "BUSY_SIZE", 4)   # the busy product, in the simulator
    path = tmp_path / "conv_ops.json"
    conv_ops.main(["--device", "cuda", "--quick", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["device"] == "cuda"
    # a conv's backward GEMMs get rows of their own on CUDA: dw alone, dx only where needed
    assert [(row["op"], row["phase"]) for row in result["rows"]] == [
        ("conv2d relu", "forward"), ("conv2d relu", "backward"), ("conv2d relu", "grad_weight"),
        ("max_pool2d", "forward"), ("max_pool2d", "backward"),
        ("conv2d relu", "forward"), ("conv2d relu", "backward"), ("conv2d relu", "grad_input"),
        ("conv2d relu", "grad_weight"), ("batch_norm", "forward"), ("batch_norm", "backward"),
        ("avg_pool2d", "forward"), ("avg_pool2d", "backward")]
    # the simulator's events time nothing (-1000 ms): the GPU column is there, its values not
    assert all(row["us_per_call"]["engine"] > 0 and "engine" in row["gpu_us_per_call"]
               for row in result["rows"])


@pytest.mark.cuda
def test_bench_conv_ops_sweep_prints_conv_choices_entries(monkeypatch, capsys):
    from bench import conv_ops, gpu_time
    monkeypatch.setattr(conv_ops, "LAYERS", [
        ("conv2d relu", (1, 5, 5), dict(out=2, kernel=3, needs_x=False)),
        ("conv2d relu", (2, 4, 4), dict(out=3, kernel=3, needs_x=True))])
    monkeypatch.setattr(conv_ops, "QUICK_BATCH", 2)
    monkeypatch.setattr(conv_ops, "SWEEP_SPLITS", (1, 2))
    monkeypatch.setattr(conv_ops, "SWEEP_ROUNDS", 1)
    monkeypatch.setattr(conv_ops, "GPU_CALLS", 1)
    monkeypatch.setattr(gpu_time, "BUSY_SIZE", 4)
    # one candidate the simulator can run (the sweep leaves ops.gemm.tilings.SIMULATED out)
    monkeypatch.setattr(tilings, "TILINGS", {"TINY": tilings.Tiling(4, 4, 4, 2, 2)})
    choices_before = dict(choices.CONV_CHOICES)
    conv_ops.main(["--device", "cuda", "--quick", "--sweep"])
    out = capsys.readouterr().out
    entries = out.split("## CONV_CHOICES entries of the winners")[1]
    assert "('forward', 2, 50, 9): GemmConfig(TINY, 1)" in entries
    assert "('grad_input', 2, 32, 27): GemmConfig(TINY, 1)" in entries
    assert entries.count("GemmConfig(TINY") == 5   # forward and dw, then forward, dx and dw
    assert "max rel diff" in out and choices.CONV_CHOICES == choices_before
