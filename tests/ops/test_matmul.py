"""matmul, fused Dense, softmax / log_softmax and the losses on every backend.

Simulator shapes are tiny and odd so they straddle the simulated 4x4 tiles and the K steps;
small forced tilings (``STRUCTURE_TILINGS``) carry the template's other structures (vec runs
of 2, rectangular tiles and sub-tiles, 8 threads) through the simulator; the ``gpu`` tests
run every real tiling of ``ops.gemm.tilings.TILINGS`` on large odd shapes against NumPy in
float64. A tiling and split-K are forced at a shape through an entry of
``ops.gemm.choices.GEMM_CHOICES`` that the test's monkeypatch removes again.
"""
import numpy as np
import pytest

import engine
import optim
from engine import losses, nn
from engine.autograd import apply
from engine.parameter import FlatBuffer, Parameter
from ops import matmul as mm
from ops.gemm import choices, tilings
from ops.dense import DenseOp
from ops.device import to_device, to_host
from ops.launch import LaunchRecorder
from ops.memory import empty
from tests.support.op_check import Case, check_op
from tests.support.references import ACTIVATIONS, np_activation
from tests.support.rounded_operands import ROUNDING_OF_FORMAT, assert_product_of_rounded
from tests.support.training_step import cross_entropy_step


def _np_log_softmax(x, axis=-1):
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _dense_case(activation, shapes=((5, 7), (7, 3), (3,)), grad=None, alpha=0.2):
    return Case(
        "dense", shapes,
        lambda x, w, b: apply(DenseOp, x, w, b, activation=activation, alpha=alpha),
        lambda x, w, b: np_activation(activation, x @ w + b, alpha), grad=grad)


def _labels_case(rows, classes, dtype=np.int64):
    def make(rng):
        return [rng.uniform(-3, 3, size=(rows, classes)),
                rng.integers(0, classes, size=rows).astype(dtype)]

    def ref(logits, labels):
        return -_np_log_softmax(logits)[np.arange(rows), labels].mean()

    return Case("cross_entropy", ((rows, classes), (rows,)), losses.cross_entropy, ref,
                make_inputs=make)


def _bce_ref(p, t):
    return -(t * np.log(p) + (1 - t) * np.log(1 - p)).mean()


def _bce_inputs(rng):
    return [rng.uniform(0.05, 0.95, size=(5, 3)), rng.uniform(0, 1, size=(5, 3))]


CASES = (
    [Case("matmul", s, lambda a, b: a @ b, np.matmul)
     for s in [((5, 7), (7, 3)), ((1, 1), (1, 1)), ((9, 4), (4, 6)), ((2, 3, 5), (5, 4)),
               ((3, 9), (9, 1))]]
    + [_dense_case(act) for act in ACTIVATIONS]
    + [_dense_case("relu", grad=(False, True, True)), _dense_case("tanh", ((1, 9), (9, 5), (5,)))]
    + [Case("softmax", ((3, 5),), lambda x: x.softmax(), lambda x: np.exp(_np_log_softmax(x))),
       Case("softmax", ((2, 3, 4),), lambda x: engine.softmax(x, axis=1),
            lambda x: np.exp(_np_log_softmax(x, axis=1))),
       Case("softmax", ((),), lambda x: x.softmax(axis=0), lambda x: np.ones(())),
       Case("log_softmax", ((3, 5),), lambda x: x.log_softmax(), _np_log_softmax),
       Case("log_softmax", ((2, 3, 4),), lambda x: x.log_softmax(axis=0),
            lambda x: _np_log_softmax(x, axis=0)),
       Case("log_softmax", ((7,),), engine.log_softmax, _np_log_softmax)]
    + [_labels_case(6, 4), _labels_case(1, 1), _labels_case(5, 3, np.uint8)]
    + [Case("binary_cross_entropy", ((5, 3), (5, 3)), losses.binary_cross_entropy, _bce_ref,
            make_inputs=_bce_inputs),
       Case("binary_cross_entropy", ((7,), (7,)), losses.binary_cross_entropy, _bce_ref,
            make_inputs=lambda rng: [rng.uniform(0.1, 0.9, 7), rng.integers(0, 2, 7) * 1.0],
            grad=(True, False)),
       Case("mse", ((4, 3), (4, 3)), losses.mse, lambda p, t: ((p - t) ** 2).mean()),
       Case("mse", ((), ()), losses.mse, lambda p, t: (p - t) ** 2)]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


# ------------------------------------------------------------------ gemm, transposed variants

@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gemm_transposed_variants(device, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((5, 6))
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b
    out = to_device(np.full((7, 6), np.nan), device)
    result = mm.gemm(to_device(stored_a, device), to_device(stored_b, device),
                     trans_a=trans_a, trans_b=trans_b, out=out)
    assert result is out
    np.testing.assert_allclose(to_host(out), a @ b, rtol=1e-12, atol=1e-12)


def test_gemm_with_empty_inner_dimension_writes_zeros(device):
    a, b = to_device(np.ones((3, 0)), device), to_device(np.ones((0, 2)), device)
    with engine.debug.poison():
        np.testing.assert_array_equal(to_host(mm.gemm(a, b)), np.zeros((3, 2)))


# ------------------------------------------------------------------ fused Dense

def _composed(x, w, b, activation, alpha):
    z = x @ w + b
    if activation == "leaky_relu":
        return z.leaky_relu(alpha)
    return z if activation is None else getattr(z, activation)()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_dense_equals_composition(device, activation):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((6, 5)), rng.standard_normal((5, 7)), rng.standard_normal(7)]
    upstream = rng.standard_normal((6, 7))
    results = []
    for fused in (True, False):
        x, w, b = [engine.tensor(a, dtype=np.float64, device=device, requires_grad=True)
                   for a in arrays]
        y = (apply(DenseOp, x, w, b, activation=activation, alpha=0.1) if fused
             else _composed(x, w, b, activation, 0.1))
        (y * engine.tensor(upstream, dtype=np.float64, device=device)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), w.grad.numpy(), b.grad.numpy()])
    for what, got, want in zip(["output", "dx", "dW", "db"], *results):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"fused dense {activation} {what} on {device}")


def test_dense_writes_parameter_grads_into_the_flat_buffer(device):
    rng = np.random.default_rng(4)
    w = Parameter(to_device(rng.standard_normal((5, 3)), device))
    b = Parameter(to_device(rng.standard_normal(3), device))
    flat_buffer = FlatBuffer([w, b])
    x = engine.tensor(rng.standard_normal((4, 5)), dtype=np.float64, device=device)
    apply(DenseOp, x, w, b, activation="tanh").sum().backward()
    x_np, w_np, b_np = x.numpy(), w.numpy(), b.numpy()
    g = 1 - np.tanh(x_np @ w_np + b_np) ** 2
    np.testing.assert_allclose(to_host(flat_buffer.grad),
                               np.concatenate([(x_np.T @ g).ravel(), g.sum(axis=0)]), rtol=1e-12)
    assert x.grad is None


def test_dense_backward_returns_the_destination_buffers(device):
    rng = np.random.default_rng(5)
    x, w, b = [to_device(rng.standard_normal(s), device) for s in ((4, 5), (5, 3), (3,))]
    op = DenseOp(activation="relu")
    op.needs_input_grad = (False, True, True)
    op(x, w, b)
    dw, db = empty((5, 3), np.float64, device), empty((3,), np.float64, device)
    grads = op.backward(to_device(np.ones((4, 3)), device), (None, dw, db))
    assert grads[0] is None and grads[1] is dw and grads[2] is db


def test_dense_rejects_bad_arguments(device):
    x, w, b = [engine.zeros(*s, device=device) for s in ((4, 5), (5, 3), (3,))]
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        apply(DenseOp, x, w, b, activation="gelu")
    with pytest.raises(ValueError, match=r"\(4, 5\), \(4, 3\), \(3,\)"):
        apply(DenseOp, x, engine.zeros(4, 3, device=device), b)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        apply(DenseOp, x, w, b, activation="leaky_relu", alpha=-0.5)


# ------------------------------------------------------------------ bad inputs

def test_matmul_rejects_bad_shapes(device):
    a = engine.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match=r"inner dimensions differ: \(3, 4\) @ \(5, 2\)"):
        a @ engine.zeros(5, 2, device=device)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\) @ \(3, 4, 2\) do not broadcast"):
        engine.zeros(2, 3, 4, device=device) @ engine.zeros(3, 4, 2, device=device)
    with pytest.raises(ValueError, match=r"got shapes \(3, 4\) and \(\)"):
        a @ engine.zeros(device=device)


def _raise_from_cross_entropy(logits, labels):
    # on a real GPU the bad label is flagged by the kernel and raised by the next call
    for _ in range(2):
        losses.cross_entropy(logits, labels).item()


@pytest.mark.parametrize("bad", [4, -1])
def test_cross_entropy_rejects_labels_out_of_range(device, bad):
    logits = engine.zeros(3, 4, device=device, requires_grad=True)
    labels = np.array([0, 1, bad])
    with pytest.raises(ValueError, match=rf"label {bad} at row 2 is outside \[0, 4\)"):
        _raise_from_cross_entropy(logits, labels)   # host labels: checked before the copy
    with pytest.raises(ValueError, match=rf"label {bad} at row 2 is outside \[0, 4\)"):
        _raise_from_cross_entropy(logits, engine.tensor(labels, device=device))
    ok = losses.cross_entropy(logits, engine.tensor([0, 1, 3], device=device))
    assert np.isclose(ok.item(), np.log(4))   # the flag was cleared by the raise


def test_cross_entropy_rejects_bad_shapes_and_dtypes(device):
    logits = engine.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match=r"labels \(N,\), got \(3, 4\) and \(2,\)"):
        losses.cross_entropy(logits, [0, 1])
    with pytest.raises(TypeError, match="labels must be integers, got float64"):
        losses.cross_entropy(logits, np.zeros(3))


def test_bce_and_mse_reject_bad_inputs(device):
    p = engine.tensor([0.5, 0.2], device=device)
    with pytest.raises(ValueError, match=r"prediction \(2,\) and target \(3,\)"):
        losses.mse(p, engine.zeros(3, device=device))
    with pytest.raises(ValueError, match=r"prediction \(2,\) and target \(1,\)"):
        losses.binary_cross_entropy(p, [1.0])
    bad = engine.tensor([0.5, 1.5], device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"must lie in \[0, 1\], got 1.5"):
            losses.binary_cross_entropy(bad, [1.0, 0.0])
    else:   # no host round trip on CUDA: the loss becomes NaN
        assert np.isnan(losses.binary_cross_entropy(bad, [1.0, 0.0]).item())


def test_bce_is_finite_at_saturated_probabilities(device):
    p = engine.tensor([0.0, 1.0, 1.0], dtype=np.float64, device=device, requires_grad=True)
    loss = losses.BCELoss()(p, [1.0, 0.0, 1.0])
    assert np.isclose(loss.item(), 200 / 3)
    loss.backward()
    assert np.all(np.isfinite(p.grad.numpy()))


def test_cross_entropy_takes_the_upstream_gradient(device):
    logits = engine.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], dtype=np.float64,
                           device=device, requires_grad=True)
    loss = losses.CrossEntropyLoss()(logits, engine.tensor([1, 2], device=device))
    (loss * 3.0).backward()
    probs = np.exp(_np_log_softmax(logits.numpy()))
    expected = (probs - np.eye(3)[[1, 2]]) * 3.0 / 2
    np.testing.assert_allclose(logits.grad.numpy(), expected, rtol=1e-12)


def test_loss_objects_match_functions(device):
    p = engine.tensor([[0.2, 0.7]], device=device)
    t = engine.tensor([[0.0, 1.0]], device=device)
    assert losses.MSELoss()(p, t).item() == losses.mse(p, t).item()
    assert repr(losses.MSELoss()) == "MSELoss()"


# ------------------------------------------------------------------ real GPU, large shapes

def _gpu_tolerance(k):
    return dict(rtol=1e-4, atol=2e-5 * max(k, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1000, 513, 257), (128, 784, 256), (784, 128, 256),
                                   (1537, 300, 1539), (4096, 17, 4097), (3, 1000, 5)])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
def test_gpu_gemm_large_shapes_against_float64(m, k, n, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b
    out = mm.gemm(to_device(stored_a, "cuda"), to_device(stored_b, "cuda"), trans_a, trans_b)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out.copy_to_host(), expected, **_gpu_tolerance(k))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n,fan_in,fan_out", [(128, 784, 256), (128, 256, 128), (128, 128, 10),
                                              (1000, 513, 257)])
def test_gpu_dense_mlp_shapes_against_float64(activation, n, fan_in, fan_out):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, fan_in)).astype(np.float32)
    w = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
    b = rng.standard_normal(fan_out).astype(np.float32)
    upstream = rng.standard_normal((n, fan_out)).astype(np.float32)
    xt, wt, bt = [engine.tensor(v, device="cuda", requires_grad=True) for v in (x, w, b)]
    y = apply(DenseOp, xt, wt, bt, activation=activation, alpha=0.1)
    (y * engine.tensor(upstream, device="cuda")).sum().backward()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    y64 = np_activation(activation, x64 @ w64 + b, 0.1)
    dz = upstream * {None: 1.0, "relu": (y64 > 0) * 1.0, "leaky_relu": np.where(y64 > 0, 1, 0.1),
                     "sigmoid": y64 * (1 - y64), "tanh": 1 - y64 ** 2}[activation]
    np.testing.assert_allclose(y.numpy(), y64, **_gpu_tolerance(fan_in))
    np.testing.assert_allclose(xt.grad.numpy(), dz @ w64.T, **_gpu_tolerance(fan_out))
    np.testing.assert_allclose(wt.grad.numpy(), x64.T @ dz, **_gpu_tolerance(n))
    np.testing.assert_allclose(bt.grad.numpy(), dz.sum(axis=0), **_gpu_tolerance(n))


@pytest.mark.gpu
def test_gpu_softmax_cross_entropy_large():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4099, 1000)).astype(np.float32) * 5
    labels = rng.integers(0, 1000, 4099)
    t = engine.tensor(logits, device="cuda", requires_grad=True)
    loss = losses.cross_entropy(t, engine.tensor(labels, device="cuda"))
    loss.backward()
    log_p = _np_log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(loss.item(), -log_p[np.arange(4099), labels].mean(), rtol=1e-5)
    expected = (np.exp(log_p) - np.eye(1000)[labels]) / 4099
    np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(engine.softmax(t, axis=0).numpy(),
                               np.exp(_np_log_softmax(logits.astype(np.float64), axis=0)),
                               rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ split-K

# the simulator's tiling: 4x4 tiles, K steps of 4; the shapes below straddle tiles and steps
SPLIT_TILING = tilings.SIMULATED


def _forcing(monkeypatch, key, split, tiling=SPLIT_TILING):
    monkeypatch.setitem(choices.GEMM_CHOICES, key, choices.GemmConfig(tiling, split))


def _cuda_kernels_launched(recorder):
    """The CUDA kernels a recorder saw, poison mode's fills left out."""
    return [name for name in recorder.cuda_kernel_names() if name != "fill_cuda"]


@pytest.mark.parametrize("k", [0, 1, 4, 11, 31, 128, 784])
@pytest.mark.parametrize("split", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("bk", [4, 16, 32])
def test_k_slices_cover_k_in_whole_steps_without_an_empty_slice(k, split, bk):
    slices = choices.k_slices(k, split, bk)
    assert 1 <= slices <= max(split, 1)
    steps = -(-k // bk)
    per_slice = -(-steps // slices) * bk if steps else 0   # the kernel's rule from its grid
    assert slices * per_slice >= k                           # every k is in a slice
    assert (slices - 1) * per_slice < k or k == 0            # the last slice is not empty


@pytest.mark.parametrize("trans_a,trans_b,split", [(False, False, 2), (False, False, 3),
                                                   (False, True, 3), (True, False, 3),
                                                   (True, True, 3)])
def test_split_k_gemm_against_float64(device, monkeypatch, trans_a, trans_b, split):
    m, k, n = 7, 11, 6   # K = 11: 3 steps of 4 in slices of 8 + 3 (split 2) or 4 + 4 + 3
    _forcing(monkeypatch, (m, n, k, trans_a, trans_b), split)
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b
    with engine.debug.poison(), LaunchRecorder() as recorder:
        out = mm.gemm(to_device(stored_a, device), to_device(stored_b, device), trans_a, trans_b)
    np.testing.assert_allclose(to_host(out), a @ b, rtol=1e-12, atol=1e-12)
    if device == "cuda":
        assert _cuda_kernels_launched(recorder) == ["gemm_partial_cuda", "gemm_sum_cuda"]


def _dense_reference(activation, x, w, b, upstream, alpha, y_seen=None):
    """y, dx, dW, db; the derivative read from ``y_seen`` when given (the y the kernels saw:
    in float32 a relu input within rounding of 0 may land on either side)."""
    y = np_activation(activation, x @ w + b, alpha)
    y_seen = y if y_seen is None else y_seen
    dz = upstream * {None: 1.0, "relu": (y_seen > 0) * 1.0,
                     "leaky_relu": np.where(y_seen > 0, 1, alpha),
                     "sigmoid": y_seen * (1 - y_seen), "tanh": 1 - y_seen ** 2}[activation]
    return y, dz @ w.T, x.T @ dz, dz.sum(axis=0)


def _dense_step(device, x, w, b, upstream, activation, alpha):
    """Dense forward and backward (all three gradients) on ``device``: the results on the host
    and the CUDA kernels that ran."""
    op = DenseOp(activation=activation, alpha=alpha)
    op.needs_input_grad = (True, True, True)
    with LaunchRecorder() as recorder:
        y = op(*[to_device(v, device) for v in (x, w, b)])
        grads = op.backward(to_device(upstream, device), (None, None, None))
    return [to_host(v) for v in (y, *grads)], _cuda_kernels_launched(recorder)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_split_k_dense_every_mode_against_float64(device, monkeypatch, activation):
    batch, fan_in, fan_out, alpha = 9, 10, 6, 0.2
    # forward K = 10 in slices 4+4+2; dX K = 6 in 4+2; dW K = 9 in 4+4+1, 11 rows with db's
    for key in [(batch, fan_out, fan_in, False, False), (batch, fan_in, fan_out, False, True),
                (fan_in, fan_out, batch, True, False)]:
        _forcing(monkeypatch, key, 3)
    rng = np.random.default_rng(7)
    x, w, b = (rng.standard_normal(s) for s in ((batch, fan_in), (fan_in, fan_out), (fan_out,)))
    upstream = rng.standard_normal((batch, fan_out))
    with engine.debug.poison():
        got, kernels = _dense_step(device, x, w, b, upstream, activation, alpha)
    for what, value, want in zip(["y", "dx", "dW", "db"], got,
                                 _dense_reference(activation, x, w, b, upstream, alpha)):
        np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"split-K dense {activation} {what} on {device}")
    if device == "cuda":
        assert kernels == ["gemm_partial_cuda", "dense_forward_sum_cuda",
                           "dense_grad_input_partial_cuda", "gemm_sum_cuda",
                           "dense_grad_params_partial_cuda", "dense_grad_params_sum_cuda"]


def test_split_k_is_bit_reproducible(device, monkeypatch):
    batch, fan_in, fan_out = 9, 10, 6
    for key in [(batch, fan_out, fan_in, False, False), (batch, fan_in, fan_out, False, True),
                (fan_in, fan_out, batch, True, False)]:
        _forcing(monkeypatch, key, 3)
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal(s).astype(np.float32)
              for s in ((batch, fan_in), (fan_in, fan_out), (fan_out,), (batch, fan_out))]
    first, _ = _dense_step(device, *arrays, "tanh", 0.01)
    second, _ = _dense_step(device, *arrays, "tanh", 0.01)
    for one, other in zip(first, second):
        np.testing.assert_array_equal(one.view(np.uint32), other.view(np.uint32))


@pytest.mark.cuda
def test_gemm_rejects_a_table_entry_with_no_slice(monkeypatch):
    _forcing(monkeypatch, (3, 2, 5, False, False), 0)
    a, b = to_device(np.ones((3, 5)), "cuda"), to_device(np.ones((5, 2)), "cuda")
    with pytest.raises(ValueError, match=r"GEMM_CHOICES\[\(3, 2, 5, False, False\)\] asks "
                                         r"for split 0"):
        mm.gemm(a, b)


# the pipelined tilings copy operands as they are, rows of a multiple of 4 elements, not these
# odd shapes: tests/ops/cuda/test_tensor_core.py runs them on odd shapes they can take
REAL_TILINGS = [name for name in tilings.TILINGS
                if name != "SIMULATED" and not tilings.TILINGS[name].stages]
# the plain-FMA tilings, held to float32 accuracy; a tensor-core tiling rounds its operands
# (tests.support.rounded_operands): the split-K test below compares it with the product of
# the rounded operands, and tests/ops/cuda/test_tensor_core.py checks Dense and the
# convolutions under it
FMA_TILINGS = [name for name in REAL_TILINGS if tilings.TILINGS[name].mma is None]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", REAL_TILINGS)
@pytest.mark.parametrize("split", [1, 2, 7])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gpu_split_k_gemm_against_float64(monkeypatch, tiling, split, trans_a, trans_b):
    m, k, n = 131, 1001, 67   # K: a ragged last step and a ragged last slice for every tiling
    _forcing(monkeypatch, (m, n, k, trans_a, trans_b), split, tilings.TILINGS[tiling])
    rng = np.random.default_rng(9)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b
    with LaunchRecorder() as recorder:
        out = mm.gemm(to_device(stored_a, "cuda"), to_device(stored_b, "cuda"), trans_a, trans_b)
    assert recorder.cuda_kernel_names() == (["gemm_cuda"] if split == 1 else
                                            ["gemm_partial_cuda", "gemm_sum_cuda"])
    mma = tilings.TILINGS[tiling].mma
    if mma is None:
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(out.copy_to_host(), want, **_gpu_tolerance(k))
    else:
        ra, rb = (ROUNDING_OF_FORMAT[mma](v).astype(np.float64) for v in (a, b))
        assert_product_of_rounded(out.copy_to_host(), ra @ rb, np.abs(ra) @ np.abs(rb), k,
                                  f"{tiling} split {split}")


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [name for name in FMA_TILINGS if name != "LARGE"])
@pytest.mark.parametrize("split", [1, 3, 8])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_gpu_dense_configs_every_mode_against_float64(monkeypatch, tiling, split, activation):
    batch, fan_in, fan_out, alpha = 130, 785, 257, 0.1   # the MLP's first layer, made odd
    for key in [(batch, fan_out, fan_in, False, False), (batch, fan_in, fan_out, False, True),
                (fan_in, fan_out, batch, True, False)]:
        _forcing(monkeypatch, key, split, tilings.TILINGS[tiling])
    rng = np.random.default_rng(10)
    x = rng.standard_normal((batch, fan_in)).astype(np.float32)
    w = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
    b = rng.standard_normal(fan_out).astype(np.float32)
    upstream = rng.standard_normal((batch, fan_out)).astype(np.float32)
    got, kernels = _dense_step("cuda", x, w, b, upstream, activation, alpha)
    assert len(kernels) == (3 if split == 1 else 6)
    want = _dense_reference(activation, *(v.astype(np.float64) for v in (x, w, b, upstream)),
                            alpha, got[0].astype(np.float64))
    for what, value, expected, k in zip(["y", "dx", "dW", "db"], got, want,
                                        [fan_in, fan_out, batch, batch]):
        np.testing.assert_allclose(value, expected, **_gpu_tolerance(k),
                                   err_msg=f"{tiling} split {split} {activation} {what}")
    again, _ = _dense_step("cuda", x, w, b, upstream, activation, alpha)
    for one, other in zip(got, again):   # reproducible to the bit on the real GPU too
        np.testing.assert_array_equal(one.view(np.uint32), other.view(np.uint32))


# ------------------------------------------------------------------ tilings

# small tilings the simulator runs quickly (4 or 8 threads a block) that carry the structures
# of the sweep's candidates: vec runs of 4 beside runs of 2 and tall tiles (TALL), wide
# strided sub-tiles (WIDE without vec), TY != TX and a K step wider than the tile
# (COMPACT_128 and COMPACT_K64); on a real GPU they run as they are
STRUCTURE_TILINGS = {
    "tall, vec runs of 4 and 2": tilings.Tiling(8, 4, 2, 4, 2, True),
    "wide, strided": tilings.Tiling(2, 8, 4, 1, 4),
    "8 threads, BK wider than the tile": tilings.Tiling(4, 8, 8, 2, 2, True),
}


@pytest.mark.parametrize("tiling", STRUCTURE_TILINGS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gemm_tilings_every_layout_against_float64(device, monkeypatch, tiling, trans_a,
                                                   trans_b):
    m, k, n = 9, 19, 10   # straddles every tiling's rows, columns and K steps (3 slices)
    # split-K: the partial kernel and the sum; the dense test below runs the single kernels
    _forcing(monkeypatch, (m, n, k, trans_a, trans_b), 3, STRUCTURE_TILINGS[tiling])
    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b
    with engine.debug.poison():
        out = mm.gemm(to_device(stored_a, device), to_device(stored_b, device), trans_a, trans_b)
    np.testing.assert_allclose(to_host(out), a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tiling", STRUCTURE_TILINGS)
@pytest.mark.parametrize("split", [1, 3])
def test_dense_tilings_every_mode_against_float64(device, monkeypatch, tiling, split):
    batch, fan_in, fan_out, alpha = 9, 10, 11, 0.2   # K of 9 to 11: split 3 splits at BK <= 8
    for key in [(batch, fan_out, fan_in, False, False), (batch, fan_in, fan_out, False, True),
                (fan_in, fan_out, batch, True, False)]:
        _forcing(monkeypatch, key, split, STRUCTURE_TILINGS[tiling])
    rng = np.random.default_rng(13)
    x, w, b = (rng.standard_normal(s) for s in ((batch, fan_in), (fan_in, fan_out), (fan_out,)))
    upstream = rng.standard_normal((batch, fan_out))
    with engine.debug.poison():
        got, kernels = _dense_step(device, x, w, b, upstream, "tanh", alpha)
    for what, value, want in zip(["y", "dx", "dW", "db"], got,
                                 _dense_reference("tanh", x, w, b, upstream, alpha)):
        np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{tiling} split {split} {what} on {device}")
    if device == "cuda":
        assert len(kernels) == (3 if split == 1 else 6)


@pytest.mark.parametrize("name", list(tilings.TILINGS))
def test_every_named_tiling_is_valid_for_float32(name):
    tilings.check_tiling(tilings.TILINGS[name], np.float32)


@pytest.mark.parametrize("tiling,message", [
    (tilings.Tiling(32, 32, 16, 3, 2), r"not a whole number of 3x2 sub-tiles"),
    (tilings.Tiling(64, 64, 8, 1, 2), r"2048 threads, more than a block's 1024"),
    (tilings.Tiling(32, 32, 6, 2, 2), r"whole number of loads per thread for 256 threads"),
    (tilings.Tiling(128, 128, 32, 8, 8), r"67584 bytes of shared memory for float32"),
    (tilings.Tiling(4, 4, 0, 2, 2), r"every extent must be at least 1"),
])
def test_check_tiling_names_what_is_wrong(tiling, message):
    with pytest.raises(ValueError, match=message):
        tilings.check_tiling(tiling)


@pytest.mark.cuda
def test_gemm_rejects_an_invalid_tiling_in_the_table(monkeypatch):
    _forcing(monkeypatch, (3, 2, 5, False, False), 1, tilings.Tiling(4, 4, 3, 2, 1))
    a, b = to_device(np.ones((3, 5)), "cuda"), to_device(np.ones((5, 2)), "cuda")
    with pytest.raises(ValueError, match=r"loads per thread for 8 threads"):
        mm.gemm(a, b)


@pytest.mark.cuda
def test_float64_takes_the_rule_tiling_where_the_table_tiling_overflows_shared_memory(
        monkeypatch):
    m, k, n = 7, 11, 6
    assert tilings.shared_bytes(tilings.WIDE, np.float64) > tilings.STATIC_SHARED_BYTES
    _forcing(monkeypatch, (m, n, k, False, False), 2, tilings.WIDE)
    rng = np.random.default_rng(14)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    out = mm.gemm(to_device(a, "cuda"), to_device(b, "cuda"))
    np.testing.assert_allclose(to_host(out), a @ b, rtol=1e-12, atol=1e-12)


def test_split_k_dense_in_a_captured_step_equals_eager(device, monkeypatch):
    batch, fan_in, fan_out = 6, 9, 5   # forward K = 9 in slices 8 + 1, dW K = 6 in 4 + 2
    for key in [(batch, fan_out, fan_in, False, False), (fan_in, fan_out, batch, True, False)]:
        _forcing(monkeypatch, key, 2)
    rng = np.random.default_rng(11)
    batches = [(engine.tensor(rng.standard_normal((batch, fan_in)), dtype=np.float32,
                              device=device),
                engine.tensor(rng.integers(0, fan_out, batch), device=device)) for _ in range(3)]

    def train(captured):
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(fan_out, activation="tanh", input_shape=(fan_in,))])
        model = model.to(device)
        opt = optim.SGD(model.parameters(), lr=0.1)
        step = cross_entropy_step(model, opt)
        step = engine.capture(step) if captured else step
        with engine.debug.poison(False), LaunchRecorder() as recorder:
            values = [step(x, y).item() for x, y in batches]
        return values, model.state_dict(), _cuda_kernels_launched(recorder), step

    eager_losses, eager_weights, kernels, _ = train(False)
    values, weights, _, step = train(True)
    if device == "cuda":
        assert {"gemm_partial_cuda", "dense_forward_sum_cuda", "dense_grad_params_partial_cuda",
                "dense_grad_params_sum_cuda"} <= set(kernels)
    assert step.eager_reason is None
    assert values == eager_losses
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)


@pytest.mark.cuda
def test_cross_entropy_rows_across_the_gpu_give_the_one_blocks_bits(monkeypatch):
    """Over ONE_BLOCK_LOGITS a thread a row computes the losses and one block sums them in
    the order the one-block kernel does: the same loss and probabilities, bit for bit."""
    from ops import loss as loss_module
    rng = np.random.default_rng(3)
    logits = rng.uniform(-3, 3, (37, 5)).astype(np.float32)
    labels = rng.integers(0, 5, 37)
    results = []
    for limit in (0, logits.size):
        monkeypatch.setattr(loss_module, "ONE_BLOCK_LOGITS", limit)
        x = engine.tensor(logits, device="cuda", requires_grad=True)
        out = losses.cross_entropy(x, labels)
        out.backward()
        results.append((out.numpy().tobytes(), x.grad.numpy().tobytes()))
    assert results[0] == results[1]
