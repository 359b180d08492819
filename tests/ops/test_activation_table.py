"""Every activation row of ``ops.pointwise.TABLE`` on every surface derived from it, checked
against torch: the function (``engine.<name>``, ``Tensor.<name>``), its op on both devices
(``check_op``: CASES), the layers that take its name (``nn.Activation``, ``Dense``,
``Conv2D``, and Keras's other names), torch interop both ways and ONNX export and import.
A new row is tested here without a line of this file; the tests at the end are the edge cases
of the rows added last."""
import hashlib
import pathlib

import numpy as np
import pytest

import engine
from engine import functional, nn
from engine.autograd import apply
from ops import conv_cpu, dense, elementwise, pointwise
from ops.conv import Conv2DOp
from ops.dense import DenseOp
from ops.gemm import plans, template
from tests.support.op_check import Case, check_op

torch = pytest.importorskip("torch")

from engine.interop import torch as interop  # noqa: E402  (it needs torch)

ACTIVATIONS = [entry for entry in pointwise.TABLE if entry.activation]
WITH_TORCH = [entry for entry in ACTIVATIONS if entry.torch]
NAMES = lambda entry: entry.name   # noqa: E731
PARAMETERS = {"leaky_relu": 0.2}   # the activations with a parameter: its value here
# both sides of 0, each activation's corners (-3, 3, 20), exp(+-x) overflowing and underflowing
POINTS = np.array([-800.0, -40.0, -20.0, -3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 3.0, 20.0, 40.0,
                   800.0, np.inf, -np.inf, np.nan])


def torch_module(entry):
    """The torch module of a row, with the parameter used here."""
    module = getattr(torch.nn, entry.torch)
    return module(PARAMETERS[entry.name]) if entry.name in PARAMETERS else module()


def torch_reference(entry):
    """The float64 NumPy function of the row's torch module: check_op's reference."""
    def reference(a):
        with torch.no_grad():
            return torch_module(entry)(torch.from_numpy(np.asarray(a, np.float64))).numpy()
    return reference


def engine_function(entry):
    """The row's engine function of a Tensor (a parameter passed as the layers pass it)."""
    if entry.name in PARAMETERS:
        return lambda x: getattr(functional, entry.name)(x, PARAMETERS[entry.name])
    return getattr(functional, entry.name)


def fused_dense_case(entry):
    """Dense with the row fused in its kernels (the CPU loops, the GEMM template's epilogue
    and derivative prologue on CUDA), odd shapes."""
    alpha = PARAMETERS.get(entry.name, 0.01)
    return Case("dense", ((5, 7), (7, 3), (3,)),
                lambda x, w, b: apply(DenseOp, x, w, b, activation=entry.name, alpha=alpha),
                lambda x, w, b: torch_reference(entry)(x @ w + b))


def fused_conv_case(entry):
    """Conv2D with the row fused (the CPU loops of its code, the implicit GEMM's on CUDA)."""
    alpha = PARAMETERS.get(entry.name, 0.01)

    def reference(x, w, b):
        with torch.no_grad():
            convolved = torch.nn.functional.conv2d(*(torch.from_numpy(a) for a in (x, w, b)))
        return torch_reference(entry)(convolved.numpy())
    return Case("conv2d", ((2, 2, 5, 4), (3, 2, 3, 2), (3,)),
                lambda x, w, b: apply(Conv2DOp, x, w, b, activation=entry.name, alpha=alpha),
                reference)


NAMED_CASES = ([(entry.name, Case(entry.name, ((3, 5),), engine_function(entry),
                                   torch_reference(entry), low=-5, high=5))
                for entry in WITH_TORCH if entry.doc]
               + [(f"{case.op}-{entry.name}", case) for entry in WITH_TORCH if entry.fuses
                  for case in (fused_dense_case(entry), fused_conv_case(entry))])
CASES = [case for _, case in NAMED_CASES]


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in NAMED_CASES])
def test_op(case, device):
    check_op(case, device)


@pytest.mark.parametrize("entry", WITH_TORCH, ids=NAMES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_function_and_its_gradient_match_torch(entry, dtype):
    """Value and gradient at every corner of the function, inf and nan included, as torch."""
    x = engine.tensor(POINTS, dtype=dtype, requires_grad=True)
    y = engine_function(entry)(x)
    weights = np.linspace(0.5, 1.5, POINTS.size)
    (y * engine.tensor(weights, dtype=dtype)).sum().backward()
    xt = torch.tensor(POINTS.astype(dtype), requires_grad=True)
    yt = torch_module(entry)(xt)
    (yt * torch.tensor(weights.astype(dtype))).sum().backward()
    tolerance = 1e-12 if dtype == np.float64 else 1e-6
    finite = np.isfinite(POINTS)
    # float32: torch's vectorised float32 kernels differ at +-inf (its gelu(inf) is nan)
    compared = slice(None) if dtype == np.float64 else finite
    np.testing.assert_allclose(y.numpy()[compared], yt.detach().numpy()[compared],
                               rtol=tolerance * 10, atol=tolerance)
    # torch's gradients at +-inf differ by op (nan or the limit)
    np.testing.assert_allclose(x.grad.numpy()[finite], xt.grad.numpy()[finite],
                               rtol=tolerance * 10, atol=tolerance)


@pytest.mark.parametrize("entry", [entry for entry in ACTIVATIONS if entry.doc], ids=NAMES)
def test_a_row_with_a_doc_is_engine_functional_and_tensor_function(entry):
    function = getattr(engine, entry.name)
    assert function is getattr(functional, entry.name) is getattr(engine.Tensor, entry.name)
    assert function.__doc__ == entry.doc


@pytest.mark.parametrize("entry", WITH_TORCH, ids=NAMES)
def test_layers_take_the_name_and_compute_what_torch_does(entry):
    """Dense (fused in its kernel, or after it), Activation and Conv2D by the row's name, in
    float64 against torch's Linear, Conv2d and module, forward and gradients."""
    alpha = PARAMETERS.get(entry.name, 0.01)
    model = nn.Sequential([nn.Dense(5, activation=entry.name, alpha=alpha, input_shape=(7,),
                                    dtype=np.float64),
                           nn.Activation(entry.name, alpha=alpha)])
    x = np.random.default_rng(0).uniform(-4, 4, (3, 7))
    y = model(engine.tensor(x))
    y.sum().backward()
    dense_layer = model.layers[0]
    linear = torch.nn.Linear(7, 5).double()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(dense_layer.weight.numpy().T))
        linear.bias.copy_(torch.from_numpy(dense_layer.bias.numpy()))
    yt = torch_module(entry)(torch_module(entry)(linear(torch.from_numpy(x))))
    yt.sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dense_layer.weight.grad.numpy(), linear.weight.grad.numpy().T,
                               rtol=1e-10, atol=1e-12)
    conv = nn.Conv2D(2, 3, activation=entry.name, alpha=alpha, input_shape=(1, 5, 4),
                     dtype=np.float64)
    nn.Sequential([conv])   # builds it
    image = np.random.default_rng(1).uniform(-3, 3, (2, 1, 5, 4))
    reference = torch.nn.Conv2d(1, 2, 3).double()
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(conv.weight.numpy()))
        reference.bias.copy_(torch.from_numpy(conv.bias.numpy()))
        expected = torch_module(entry)(reference(torch.from_numpy(image))).numpy()
    np.testing.assert_allclose(conv(engine.tensor(image)).numpy(), expected, rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("entry", [entry for entry in ACTIVATIONS if entry.keras], ids=NAMES)
def test_layers_take_keras_other_names(entry):
    for alias in entry.keras:
        assert nn.Activation(alias).activation == entry.name
        assert nn.Dense(2, activation=alias).activation == entry.name
        assert nn.Conv2D(2, 3, activation=alias).activation == entry.name


@pytest.mark.parametrize("entry", WITH_TORCH, ids=NAMES)
def test_torch_interop_converts_the_module_both_ways(entry):
    """from_sequential fuses the module into the Linear before it where the row fuses, and
    to_sequential gives the module back."""
    module = torch_module(entry)
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 3), module, torch_module(entry)).double()
    model = interop.from_sequential(torch_model, (4,))
    x = np.random.default_rng(2).uniform(-3, 3, (5, 4))
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(engine.tensor(x)).numpy(), expected, rtol=1e-12,
                               atol=1e-12)
    back = interop.to_sequential(model)
    assert [type(m).__name__ for m in back].count(entry.torch) == 2
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(x)).numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("entry", [entry for entry in WITH_TORCH if entry.torch not in (
    "ReLU", "Sigmoid", "Tanh", "GELU", "LeakyReLU")], ids=NAMES)
def test_nn_names_the_activation_for_torchs_module_name(entry):
    with pytest.raises(AttributeError, match=f"nn.Activation\\('{entry.name}'\\)"):
        getattr(nn, entry.torch)


@pytest.mark.parametrize("entry", ACTIVATIONS, ids=NAMES)
def test_onnx_export_and_import_or_a_refusal_naming_the_row(entry, tmp_path):
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    alpha = PARAMETERS.get(entry.name, 0.01)
    model = nn.Sequential([nn.Dense(3, activation=entry.name, alpha=alpha, input_shape=(4,)),
                           nn.Activation(entry.name, alpha=alpha)])
    path = tmp_path / "model.onnx"
    if entry.onnx is None:
        with pytest.raises(ValueError, match=f"no operator for its activation '{entry.name}'"):
            engine.onnx.export(model, path)
        return
    opset = max(engine.onnx.DEFAULT_OPSET, entry.onnx_opset)
    if entry.onnx_opset > engine.onnx.MIN_OPSET and entry.name != "gelu":
        with pytest.raises(ValueError, match=f"export with opset={entry.onnx_opset}"):
            engine.onnx.export(model, path, opset=entry.onnx_opset - 1)
    engine.onnx.export(model, path, opset=opset)
    x = np.random.default_rng(3).uniform(-4, 4, (2, 4)).astype(np.float32)
    expected = model(engine.tensor(x)).numpy()
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, rtol=1e-5,
                               atol=1e-6)
    loaded = engine.onnx.load(path)
    assert [getattr(layer, "activation", None) for layer in loaded.layers] == [entry.name] * 2
    np.testing.assert_allclose(loaded(engine.tensor(x)).numpy(), expected, rtol=1e-6,
                               atol=1e-7)


def test_the_codes_change_with_the_table_file():
    """Numba's cache never sees ops/pointwise.py: its codes are what change with it."""
    digest = hashlib.sha256(pathlib.Path(pointwise.__file__).read_bytes()).hexdigest()
    assert pointwise.IDENTITY == pointwise.CODES_BASE == int(digest[:10], 16) * 64
    codes = [entry.code for entry in pointwise.TABLE]
    assert sorted(codes) == list(range(pointwise.CODES_BASE, pointwise.CODES_BASE + len(codes)))


def test_the_kernels_of_every_fused_row_and_every_function_are_built_per_code():
    """The one constant-code mechanism: each fused row has Dense and CPU conv kernels of its
    own, each row its elementwise pair, all made by ``kernels_of_code`` factories."""
    fused = {code for code in pointwise.ACTIVATIONS.values()}
    assert fused == {entry.code for entry in pointwise.TABLE if entry.fuses} | {pointwise.IDENTITY}
    assert set(dense.DENSE) == fused
    assert set(elementwise.UNARY) == {entry.code for entry in pointwise.TABLE}
    for code in fused:
        assert len(conv_cpu.conv2d_cpu_kernels(code)) == 2
    for factory in (dense._dense_kernels, elementwise._unary_kernels, conv_cpu.conv2d_cpu_kernels,
                    template.gemm_kernels, plans._split_sum_kernel):
        assert factory.constant_code in ("act", "code"), factory
    with pytest.raises(ValueError, match="no fused CPU loop"):
        conv_cpu.conv2d_cpu_kernels(pointwise.GELU)
    # a NumPy integer is the same code: one build, typed as a literal
    assert conv_cpu.conv2d_cpu_kernels(np.int64(pointwise.RELU)) is \
        conv_cpu.conv2d_cpu_kernels(pointwise.RELU)


def _values_and_gradients(name, x, dtype):
    """engine's and torch.nn.functional's ``name`` of ``x`` as ``dtype``, each summed and
    backpropagated: ``(y, grad, expected_y, expected_grad)`` as NumPy arrays."""
    mine = engine.tensor(x, dtype=dtype, requires_grad=True)
    y = getattr(engine, name)(mine)
    y.sum().backward()
    theirs = torch.tensor(x.astype(dtype), requires_grad=True)
    expected = getattr(torch.nn.functional, name)(theirs)
    expected.sum().backward()
    return y.numpy(), mine.grad.numpy(), expected.detach().numpy(), theirs.grad.numpy()


# ------------------------------------------------------------------ mish

def test_mish_saturates_as_torch_where_exp_overflows():
    """float32's exp overflows past 88: mish is x there (tanh(inf) = 1) and its gradient 1;
    far left both go to -0 and 0, as torch's."""
    x = np.concatenate([np.linspace(-30, 30, 121), [85.0, 88.5, 89.0, 100.0, 1e4, -1e4]])
    for dtype in (np.float32, np.float64):
        y, grad, expected_y, expected_grad = _values_and_gradients("mish", x, dtype)
        assert np.isfinite(grad).all()
        np.testing.assert_allclose(y, expected_y, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_mish_runs_after_the_layers_kernel_and_exports_from_opset_18(tmp_path):
    """Its derivative is not a function of y: Dense and Conv2D keep x for it."""
    assert "mish" not in pointwise.ACTIVATIONS
    model = nn.Sequential([nn.Dense(3, activation="mish", input_shape=(4,))])
    with pytest.raises(ValueError, match="ONNX's Mish .* from opset 18 on; export with "
                                         "opset=18 or later, got 17"):
        engine.onnx.export(model, tmp_path / "m.onnx")


# ------------------------------------------------------------------ hardswish

def test_hardswish_gradient_at_its_corners_is_torchs():
    """torch's backward takes x / 3 + 1/2 strictly inside (-3, 3): 0 at -3 and 1 at 3, not the
    -0.5 and 1.5 of the inside's formula there; a NaN input gives a NaN value, gradient 1."""
    x = np.array([-3.0001, -3.0, -2.9999, -1.5, 0.0, 2.9999, 3.0, 3.0001, np.nan])
    for dtype in (np.float32, np.float64):
        y, grad, expected_y, expected_grad = _values_and_gradients("hardswish", x, dtype)
        np.testing.assert_allclose(y, expected_y, rtol=1e-6)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-6)
        np.testing.assert_array_equal(grad[[1, 6, 8]], [0.0, 1.0, 1.0])
        assert np.isnan(y[8])


def test_hardswish_takes_keras_names_and_exports_from_opset_14(tmp_path):
    assert nn.Activation("hard_silu").activation == "hardswish"
    assert nn.Dense(2, activation="hard_swish").get_config()["activation"] == "hardswish"
    model = nn.Sequential([nn.Dense(3, activation="hardswish", input_shape=(4,))])
    with pytest.raises(ValueError, match="ONNX's HardSwish .* from opset 14 on"):
        engine.onnx.export(model, tmp_path / "m.onnx", opset=13)


# ------------------------------------------------------------------ softsign

def test_softsign_fuses_and_its_gradient_from_y_is_torchs():
    """The one fused row added this way: Dense and Conv2D apply it in their kernels and take
    its derivative (1 - |y|)^2 from the output they keep, which matches torch's from x far
    out too (float64: 1 / (1 + |x|)^2 to 1e-9 relative at |x| = 1e4)."""
    assert "softsign" in pointwise.ACTIVATIONS
    assert pointwise.ACTIVATIONS["softsign"] in dense.DENSE
    x = np.array([-1e4, -50.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 50.0, 1e4])
    _, grad, _, expected_grad = _values_and_gradients("softsign", x, np.float64)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-9)
    np.testing.assert_allclose(grad, 1 / (1 + np.abs(x)) ** 2, rtol=1e-9)
