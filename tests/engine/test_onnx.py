"""engine.onnx: the exported file, run in onnxruntime, computes what the engine computes
(atol 1e-5), on random inputs and on MNIST images; bad models and arguments are named.

Needs the onnx package and onnxruntime (the test extra); skipped without them."""
import os
import re
import sys

import numpy as np
import pytest

import data
import engine
import optim
from data.datasets import pixel_statistics
from engine import nn
from engine import onnx as engine_onnx
from engine.losses import cross_entropy
from engine.fit import fit
from engine.models import build_mlp

onnx = pytest.importorskip("onnx", reason="needs onnx: pip install -e '.[onnx]'")
onnxruntime = pytest.importorskip("onnxruntime",
                                  reason="needs onnxruntime: pip install -e '.[test]'")

ATOL = 1e-5


def _engine_outputs(model, inputs):
    model.eval()
    with engine.no_grad():
        return model(engine.tensor(inputs, dtype=inputs.dtype)).numpy()


def _onnx_outputs(path, inputs):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (outputs,) = session.run(None, {engine_onnx.INPUT: inputs})
    return outputs


def _random(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "sigmoid", "tanh", "softmax",
                                        None])
def test_dense_with_each_activation_runs_in_onnxruntime_as_in_the_engine(tmp_path, activation):
    model = nn.Sequential([nn.Dense(9, activation=activation, alpha=0.2, input_shape=(5,)),
                           nn.Dense(4, activation=activation, alpha=0.2)])
    path = tmp_path / "dense.onnx"
    model.export_onnx(path)
    for batch in (1, 33):   # the batch dimension is open
        inputs = _random((batch, 5), seed=batch)
        outputs = _onnx_outputs(path, inputs)
        assert outputs.shape == (batch, 4) and outputs.dtype == np.float32
        np.testing.assert_allclose(outputs, _engine_outputs(model, inputs), rtol=0, atol=ATOL)


def test_flatten_activation_and_dropout_layers(tmp_path):
    """Dropout exports as the identity it is in eval mode, also from a model in train mode."""
    model = nn.Sequential([nn.Flatten(input_shape=(3, 4, 2)), nn.Dense(16),
                           nn.Activation("leaky_relu", alpha=0.3), nn.Dropout(0.5),
                           nn.Dense(7), nn.Activation("tanh"), nn.Activation("softmax")])
    model.train()
    proto = engine_onnx.export(model, tmp_path / "mixed.onnx")
    assert [node.op_type for node in proto.graph.node] == [
        "Flatten", "Gemm", "LeakyRelu", "Identity", "Gemm", "Tanh", "Softmax"]
    inputs = _random((10, 3, 4, 2))
    np.testing.assert_allclose(_onnx_outputs(tmp_path / "mixed.onnx", inputs),
                               _engine_outputs(model, inputs), rtol=0, atol=ATOL)


def test_a_float64_model_exports_in_float64(tmp_path):
    model = nn.Sequential([nn.Dense(8, activation="tanh", dtype=np.float64, input_shape=(6,)),
                           nn.Dense(3, activation="softmax", dtype=np.float64)])
    model.export_onnx(tmp_path / "double.onnx")
    inputs = _random((12, 6), np.float64)
    outputs = _onnx_outputs(tmp_path / "double.onnx", inputs)
    assert outputs.dtype == np.float64
    np.testing.assert_allclose(outputs, _engine_outputs(model, inputs), rtol=0, atol=1e-12)


def test_a_trained_mnist_mlp_gives_the_engine_s_logits_on_mnist_images(tmp_path):
    (x_train, y_train), (x_test, _) = data.mnist.load()
    normalize = pixel_statistics(x_train[:1024])
    loader = data.DataLoader(x_train[:1024], y_train[:1024], batch_size=128, shuffle=True,
                             seed=0, normalize=normalize)
    model = build_mlp((28, 28), (256, 128), 10)
    fit(model, loader, optim.Adam(model.parameters(), lr=2e-3), cross_entropy, 2,
        progress=False, verbose=False)
    images = x_test[:500].astype(np.float32) / 255
    standardised = ((images - normalize[0]) / normalize[1]).astype(np.float32)
    expected = _engine_outputs(model, standardised)
    assert np.abs(expected).max() > 5   # trained logits, not a near-zero start
    model.export_onnx(tmp_path / "mlp.onnx")
    np.testing.assert_allclose(_onnx_outputs(tmp_path / "mlp.onnx", standardised), expected,
                               rtol=0, atol=ATOL)
    # with the standardisation inside, the file takes the images as scaled to [0, 1]
    model.export_onnx(tmp_path / "raw.onnx", normalize=normalize)
    np.testing.assert_allclose(_onnx_outputs(tmp_path / "raw.onnx", images), expected,
                               rtol=0, atol=ATOL)


def test_the_file_is_a_checked_model_with_named_weights(tmp_path):
    model = nn.Sequential([nn.Flatten(input_shape=(2, 3)), nn.Dense(4, activation="relu")])
    path = tmp_path / "small.onnx"
    proto = model.export_onnx(path, opset=13)
    stored = onnx.load(str(path))
    onnx.checker.check_model(stored, full_check=True)
    assert stored.SerializeToString() == proto.SerializeToString()
    assert stored.opset_import[0].version == 13 and stored.producer_name == "numba-engine"
    weights = {tensor.name: onnx.numpy_helper.to_array(tensor)
               for tensor in stored.graph.initializer}
    np.testing.assert_array_equal(weights["dense.weight"], model.layers[1].weight.numpy())
    np.testing.assert_array_equal(weights["dense.bias"], model.layers[1].bias.numpy())
    dims = [d.dim_param or d.dim_value for d in stored.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 2, 3] and os.listdir(tmp_path) == ["small.onnx"]


class Doubling(nn.Layer):
    """A layer of the user's own: nothing to export it with."""

    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("make, error, words", [
    (lambda: nn.Sequential([nn.Dense(3, input_shape=(2,)), Doubling()]), ValueError,
     "layer 1 'doubling' (Doubling) has no ONNX export yet; exported layers: Dense"),
    (lambda: nn.Sequential([nn.Dense(3)]), ValueError, "the model is not built"),
    (lambda: nn.Dense(3, input_shape=(2,)), TypeError, "takes an nn.Sequential model"),
    (lambda: nn.Sequential([nn.Dense(3, input_shape=(2,)), nn.Dense(2, dtype=np.float64)]),
     ValueError, "mix dtypes"),
])
def test_what_cannot_be_exported_is_named(tmp_path, make, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        engine_onnx.export(make(), tmp_path / "m.onnx")
    assert not os.listdir(tmp_path)


def test_an_activation_without_an_onnx_operator_is_named(tmp_path, monkeypatch):
    """An ops.pointwise entry may name no ONNX operator: its layers are refused before any
    file is written, not exported as a node without an operator."""
    monkeypatch.setitem(engine_onnx.ACTIVATIONS, "tanh", None)
    model = nn.Sequential([nn.Dense(3, input_shape=(2,)), nn.Dense(2, activation="tanh")])
    exported = sorted(name for name, operator in engine_onnx.ACTIVATIONS.items() if operator)
    assert "tanh" not in exported and {"gelu", "relu", "softmax"} <= set(exported)
    with pytest.raises(ValueError, match="layer 1 'dense_1' \\(Dense\\): ONNX has no operator "
                                         "for its activation 'tanh'.*exported activations: "
                                         f"{', '.join(exported)}$"):
        engine_onnx.export(model, tmp_path / "m.onnx")
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("options, words", [
    ({"opset": 12}, "opset must be an integer from 13"), ({"opset": "17"}, "opset must be"),
    ({"normalize": (0.1, 0.0)}, "positive finite std"),
    ({"normalize": (np.zeros(3), 1.0)}, "broadcasting against one sample (4,)"),
    ({"normalize": 0.5}, "normalize must be (mean, std)")])
def test_bad_options_are_named(tmp_path, options, words):
    model = nn.Sequential([nn.Dense(2, input_shape=(4,))])
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        model.export_onnx(tmp_path / "m.onnx", **options)


def test_a_failed_export_leaves_the_previous_file(tmp_path, monkeypatch):
    model = nn.Sequential([nn.Dense(2, input_shape=(4,))])
    path = tmp_path / "m.onnx"
    model.export_onnx(path)
    before = path.read_bytes()
    wider = nn.Sequential([nn.Dense(5, input_shape=(4,))])
    monkeypatch.setattr(type(engine_onnx.to_onnx(wider)), "SerializeToString",
                        lambda self: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        wider.export_onnx(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.onnx"]


def test_without_the_onnx_package_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[onnx]'")):
        nn.Sequential([nn.Dense(2, input_shape=(4,))]).export_onnx(tmp_path / "m.onnx")
