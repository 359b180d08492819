"""engine.onnx.load: an ONNX chain becomes an ``nn.Sequential`` that computes what the file
computes. Round trips (engine -> ONNX -> engine) give the engine's outputs; files that
``torch.onnx.export`` writes for the equivalent torch networks give torch's; graphs that are
not chains, operators without a layer and damaged files are ValueErrors naming the node or
the file.

Needs the onnx package (the onnx, formats and test extras); the torch cases need PyTorch."""
import warnings

import numpy as np
import pytest

import engine
from engine import nn
from engine import onnx as engine_onnx
from tests.support.damaged_files import each_flipped_byte

onnx = pytest.importorskip("onnx", reason="needs onnx: pip install -e '.[onnx]'")
helper = onnx.helper


def _random(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _eval_outputs(model, x):
    model.eval()
    with engine.no_grad():
        return model(engine.tensor(x, dtype=x.dtype, device=model.device)).numpy()


def _trained(model, x):
    """One training forward: BatchNorm's running statistics leave their initial values."""
    model.train()
    model(engine.tensor(x, dtype=x.dtype))
    return model


def _mlp(dtype=np.float32):
    return nn.Sequential([
        nn.Flatten(input_shape=(3, 4)), nn.Dense(9, activation="relu", dtype=dtype),
        nn.Dense(8, activation="leaky_relu", alpha=0.25, dtype=dtype), nn.Dropout(0.4),
        nn.Dense(7, activation="sigmoid", dtype=dtype), nn.BatchNorm(dtype=dtype),
        nn.Activation("leaky_relu", alpha=0.1), nn.Dense(6, activation="tanh", dtype=dtype),
        nn.Dense(5, dtype=dtype), nn.Dense(4, activation="softmax", dtype=dtype)])


def _cnn(dtype=np.float32):
    return nn.Sequential([
        nn.Reshape((2, 7, 6), input_shape=(84,)),
        nn.Conv2D(4, 2, padding="same", activation="relu", dtype=dtype),   # pads 0,0,1,1
        nn.Conv2D(4, 3, stride=2, padding=1, groups=2, use_bias=False, activation="tanh",
                  dtype=dtype),
        nn.BatchNorm(momentum=0.2, eps=1e-3, dtype=dtype),
        nn.MaxPool2D(2, stride=1, padding=1),
        nn.Conv2D(3, 2, dilation=(1, 2), padding=(1, 0), dtype=dtype),
        nn.AvgPool2D(3, stride=1, padding=1),
        nn.Flatten(), nn.Dense(5, activation="sigmoid", dtype=dtype)])


def _without_dropout(config):
    """The layers an export keeps: Dropout is the identity in eval mode, exported as one."""
    return [layer for layer in config["layers"] if layer["class_name"] != "Dropout"]


@pytest.mark.parametrize("make, shape", [(_mlp, (3, 4)), (_cnn, (84,))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_round_trip_gives_the_engine_s_model_and_outputs(tmp_path, make, shape, dtype):
    model = _trained(make(dtype), _random((6,) + shape, dtype, seed=1))
    path = tmp_path / "model.onnx"
    model.export_onnx(path)
    loaded = nn.load(path)
    assert _without_dropout(loaded.get_config()) == _without_dropout(model.get_config())
    for batch in (1, 37):
        x = _random((batch,) + shape, dtype, seed=batch)
        outputs = _eval_outputs(loaded, x)
        assert outputs.dtype == dtype
        # the same kernels on the same weights: equal up to the sum order of the BLAS
        np.testing.assert_allclose(outputs, _eval_outputs(model, x), rtol=0,
                                   atol=1e-6 if dtype == np.float32 else 1e-14)


def test_the_imported_model_trains(tmp_path):
    """A new model: in train mode, with parameters an optimizer can update."""
    import optim
    model = _mlp()
    path = tmp_path / "model.onnx"
    model.export_onnx(path)
    loaded = engine_onnx.load(path)
    assert loaded.training and loaded.device == "cpu"
    opt = optim.SGD(loaded.parameters(), lr=0.1)
    x, labels = _random((8, 3, 4)), engine.tensor(np.arange(8) % 4)
    before = loaded.state_dict()["dense.weight"].copy()
    opt.zero_grad()
    engine.losses.cross_entropy(loaded(engine.tensor(x)), labels).backward()
    opt.step()
    assert not np.array_equal(loaded.state_dict()["dense.weight"], before)


# ------------------------------------------------------------------ torch.onnx.export

def _torch_export(module, x, path, opset):
    """``torch.onnx.export`` of ``module`` with an open batch dimension: the TorchScript
    exporter at ``opset``, or with ``opset="dynamo"`` the torch.export-based one (torch's
    default since 2.9, which needs onnxscript), at its own opset."""
    import torch
    module.eval()
    if opset == "dynamo":
        pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript "
                                                 "(the test extra)")
        options = {"dynamo": True, "dynamic_shapes": ({0: torch.export.Dim("batch")},),
                   "verbose": False}   # its weights go to an external file, <path>.data
    else:
        options = {"dynamo": False, "opset_version": opset,
                   "dynamic_axes": {"x": {0: "batch"}, "y": {0: "batch"}}}
    with warnings.catch_warnings():   # torch's notes on its exporters' futures
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"],
                          **options)


def _torch_networks():
    import torch
    t = torch.nn
    mlp = t.Sequential(t.Flatten(), t.Linear(12, 9), t.ReLU(), t.Linear(9, 8), t.LeakyReLU(0.2),
                       t.Dropout(0.3), t.BatchNorm1d(8), t.Linear(8, 6), t.Sigmoid(),
                       t.Linear(6, 5), t.Tanh(), t.Linear(5, 4), t.Softmax(dim=-1))
    cnn = t.Sequential(t.Unflatten(1, (1, 8, 8)), t.Conv2d(1, 4, 3, padding=1), t.ReLU(),
                       t.MaxPool2d(2), t.Conv2d(4, 6, 3, padding=1, groups=2), t.ReLU(),
                       t.BatchNorm2d(6), t.AvgPool2d(2), t.Flatten(), t.Linear(24, 7),
                       t.ReLU(), t.Linear(7, 3))
    return {"mlp": (mlp, (3, 4)), "cnn": (cnn, (64,))}


@pytest.mark.torch
@pytest.mark.parametrize("opset", [13, 17, "dynamo"])
@pytest.mark.parametrize("network", ["mlp", "cnn"])
def test_torch_onnx_export_of_the_equivalent_network_imports_with_torch_s_outputs(
        tmp_path, network, opset):
    import torch
    torch.manual_seed(0)
    module, shape = _torch_networks()[network]
    module.train()
    module(torch.randn((16,) + shape))   # running statistics away from 0 and 1
    path = tmp_path / f"{network}.onnx"
    _torch_export(module, torch.randn((2,) + shape), path, opset)
    model = engine_onnx.load(path)
    for batch in (1, 37):
        x = _random((batch,) + shape, seed=batch)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(_eval_outputs(model, x), expected, rtol=0, atol=2e-6)


# ------------------------------------------------------------------ hand-built graphs

def _graph_file(path, nodes, initializers, inputs=None, opset=17, outputs=None):
    inputs = inputs or [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])]
    outputs = outputs or [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [onnx.numpy_helper.from_array(value, name)
                               for name, value in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path.write_bytes(model.SerializeToString())
    return path


WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
BIAS = np.array([0.5, -1.0, 2.0], np.float32)


def test_matmul_and_add_become_a_dense_layer(tmp_path):
    path = _graph_file(tmp_path / "matmul.onnx",
                       [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                        helper.make_node("Add", ["h", "b"], ["z"], name="bias"),
                        helper.make_node("Relu", ["z"], ["y"], name="relu")],
                       {"w": WEIGHT, "b": BIAS})
    model = engine_onnx.load(path)
    assert [type(layer).__name__ for layer in model.layers] == ["Dense"]
    assert model.layers[0].activation == "relu"
    x = _random((5, 4))
    np.testing.assert_allclose(_eval_outputs(model, x), np.maximum(x @ WEIGHT + BIAS, 0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nodes, initializers, words", [
    ([helper.make_node("Erf", ["x"], ["y"], name="the_erf")], {},
     r"node 'the_erf' \(Erf\): operator 'Erf' has no engine layer"),
    ([helper.make_node("Relu", ["x"], ["a"], name="left"),
      helper.make_node("Tanh", ["x"], ["c"], name="right"),
      helper.make_node("Mul", ["a", "c"], ["j"], name="join"),
      helper.make_node("Erf", ["j"], ["y"], name="joined_erf")], {},
     r"'joined_erf' \(Erf\): operator 'Erf' is not supported; the graph importer reads "
     r".*MatMul.*Softmax"),
    ([helper.make_node("Relu", ["x"], ["a"], name="r"),
      helper.make_node("Tanh", ["a"], ["y"], name="t"),
      helper.make_node("Sigmoid", ["a"], ["unused"], name="s")], {},
     r"value 'a' feeds \['t', 's'\]: the graph branches"),
    ([helper.make_node("Gemm", ["x", "w"], ["y"], name="g", transA=1)], {"w": WEIGHT},
     r"'g' \(Gemm\): transA=1"),
    ([helper.make_node("Add", ["x", "b"], ["y"], name="plus")], {"b": BIAS},
     r"'plus' \(Add\): adds a constant to a value that is not a Dense"),
    ([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=0)], {},
     r"'sm' \(Softmax\): softmax over axis 0"),
    ([helper.make_node("Flatten", ["x"], ["y"], name="f", axis=0)], {},
     r"'f' \(Flatten\): Flatten must keep the batch axis"),
    ([helper.make_node("Reshape", ["x", "s"], ["y"], name="r")], {"s": np.array([2, -1])},
     r"'r' \(Reshape\): reshapes a batch of \d .* keeps the batch dimension"),
    ([helper.make_node("Identity", ["x"], ["y"], name="i")], {},
     "the graph computes nothing but its input"),
])
def test_what_cannot_be_imported_is_named(tmp_path, nodes, initializers, words):
    path = _graph_file(tmp_path / "bad.onnx", nodes, initializers)
    with pytest.raises(ValueError, match=r"engine.onnx.load: '.*bad.onnx': .*" + words):
        engine_onnx.load(path)


def test_several_inputs_make_a_graph_model_and_unfixed_features_are_refused(tmp_path):
    two = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n", 4])
           for name in ("x", "x2")]
    path = _graph_file(tmp_path / "two.onnx", [helper.make_node("Add", ["x", "x2"], ["y"])],
                       {}, inputs=two)
    model = engine_onnx.load(path)   # engine.onnx.import_graph's GraphModel
    x, x2 = _random((3, 4)), _random((3, 4), seed=1)
    np.testing.assert_array_equal(model(engine.tensor(x), engine.tensor(x2)).numpy(), x + x2)
    loose = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", "features"])]
    path = _graph_file(tmp_path / "loose.onnx", [helper.make_node("Relu", ["x"], ["y"])], {},
                       inputs=loose)
    with pytest.raises(ValueError, match=r"input 'x' has shape \['n', 'features'\]"):
        engine_onnx.load(path)


def test_old_opsets_and_other_domains_are_named(tmp_path):
    path = _graph_file(tmp_path / "old.onnx", [helper.make_node("Relu", ["x"], ["y"])], {},
                       opset=11)
    with pytest.raises(ValueError, match=r"operator set 11; the importer reads opsets 13 to"):
        engine_onnx.load(path)
    node = helper.make_node("Relu", ["x"], ["y"], name="custom", domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", onnx.TensorProto.FLOAT, ["n", 4])], [helper.make_tensor_value_info(
            "y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    (tmp_path / "custom.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ValueError, match=r"operator 'com.example.Relu' has no engine layer"):
        engine_onnx.load(tmp_path / "custom.onnx")


def _external_gemm(path, location, offset=0, length=None):
    """A one-Gemm model at ``path`` whose weight is kept in the external file ``location``."""
    weight = onnx.numpy_helper.from_array(WEIGHT, "w")
    weight.data_location = onnx.TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = weight.external_data.add()
            entry.key, entry.value = key, str(value)
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], name="g")], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                             ["n", 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT,
                                                             None)], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path


def test_external_data_is_read_from_the_model_s_folder_only(tmp_path):
    (tmp_path / "model.onnx.data").write_bytes(b"\0" * 16 + WEIGHT.tobytes())
    model = engine_onnx.load(_external_gemm(tmp_path / "model.onnx", "model.onnx.data", 16,
                                            WEIGHT.nbytes))
    np.testing.assert_array_equal(model.state_dict()["dense.weight"], WEIGHT)
    outside = tmp_path.parent / "outside.data"
    outside.write_bytes(WEIGHT.tobytes())
    for location in ("../outside.data", str(outside), "absent.data", ""):
        with pytest.raises(ValueError, match=r"'g' \(Gemm\): tensor 'w' keeps its data in .*"
                                             "not a file in the model's folder"):
            engine_onnx.load(_external_gemm(tmp_path / "bad.onnx", location))
    with pytest.raises(ValueError, match=r"tensor 'w': bytes 24 to 72 of 'model.onnx.data', "
                                         "which holds 64"):
        engine_onnx.load(_external_gemm(tmp_path / "long.onnx", "model.onnx.data", 24, 48))
    with pytest.raises(ValueError, match=r"tensor 'w' cannot be read"):
        engine_onnx.load(_external_gemm(tmp_path / "short.onnx", "model.onnx.data", 0, 8))


def test_every_flipped_byte_is_a_value_error_or_a_model(tmp_path):
    """ONNX files carry no checksum: a flipped byte in a weight loads as another weight. Any
    other single-byte damage is a ValueError naming the file, never another exception."""
    model = nn.Sequential([nn.Reshape((1, 2, 2), input_shape=(4,)),
                           nn.Conv2D(2, 2, activation="relu"), nn.Flatten(),
                           nn.Dense(2, activation="tanh")])
    model.export_onnx(tmp_path / "good.onnx")
    content = (tmp_path / "good.onnx").read_bytes()
    damaged = tmp_path / "damaged.onnx"
    refused = 0
    for position in each_flipped_byte(content, damaged):
        try:
            assert isinstance(engine_onnx.load(damaged), nn.Sequential)
        except ValueError as error:
            assert "damaged.onnx" in str(error), (position, str(error))
            refused += 1
    assert refused > len(content) // 2   # 585 of 792 with onnx 1.23


def test_damaged_files_are_value_errors_naming_them(tmp_path):
    path = tmp_path / "model.onnx"
    _mlp().export_onnx(path)
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"'.*damaged.onnx' is not an ONNX model"):
        nn.load(damaged)
    (tmp_path / "text.onnx").write_text("not a model at all")
    with pytest.raises(ValueError, match=r"text.onnx"):
        nn.load(tmp_path / "text.onnx")


@pytest.mark.gpu
def test_an_imported_model_runs_on_the_gpu_as_onnxruntime_does(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _trained(_cnn(), _random((6, 84), seed=1))
    path = tmp_path / "cnn.onnx"
    model.export_onnx(path)
    loaded = nn.load(path, device="cuda")
    assert loaded.device == "cuda"
    x = _random((256, 84), seed=2)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {engine_onnx.INPUT: x})
    np.testing.assert_allclose(_eval_outputs(loaded, x), expected, rtol=0, atol=1e-5)


@pytest.mark.cuda
def test_nn_load_puts_an_imported_model_on_the_cuda_device(tmp_path):
    """A tiny model, for Numba's simulator on a CPU machine."""
    model = nn.Sequential([nn.Dense(3, activation="tanh", input_shape=(2,)), nn.Dense(2)])
    model.export_onnx(tmp_path / "tiny.onnx")
    loaded = nn.load(tmp_path / "tiny.onnx", device="cuda")
    assert loaded.device == "cuda"
    x = _random((3, 2))
    np.testing.assert_allclose(_eval_outputs(loaded, x), _eval_outputs(model, x), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("first_layers", [
    [nn.Rescaling(1 / 255, input_shape=(3, 4)), nn.Normalization(0.13, 0.09)],
    [nn.Rescaling(2.0, offset=-1.0, input_shape=(3, 4)),
     nn.Normalization(np.linspace(0.1, 0.4, 4), np.linspace(0.5, 2.0, 4))]])
def test_rescaling_and_normalization_round_trip_on_raw_images(tmp_path, first_layers):
    """The layers a model of python -m engine.train starts with: uint8 in, as the data set
    ships images (a Cast, a Mul and an Add, a Sub and a Div)."""
    model = nn.Sequential(first_layers + [nn.Flatten(), nn.Dense(5, activation="relu")])
    model.export_onnx(tmp_path / "raw.onnx")
    loaded = nn.load(tmp_path / "raw.onnx")
    assert [type(layer).__name__ for layer in loaded.layers] == [
        "Rescaling", "Normalization", "Flatten", "Dense"]
    images = np.random.default_rng(0).integers(0, 256, (7, 3, 4)).astype(np.uint8)
    model.eval()
    loaded.eval()
    with engine.no_grad():
        np.testing.assert_allclose(loaded(images).numpy(), model(images).numpy(), rtol=0,
                                   atol=1e-6)


def test_the_export_s_normalize_nodes_import_as_a_normalization(tmp_path):
    model = nn.Sequential([nn.Flatten(input_shape=(3, 4)), nn.Dense(5)])
    model.export_onnx(tmp_path / "normalized.onnx", normalize=(0.1307, 0.3081))
    loaded = nn.load(tmp_path / "normalized.onnx")
    x = _random((6, 3, 4))
    standardised = (x - np.float32(0.1307)) / np.float32(0.3081)
    np.testing.assert_allclose(_eval_outputs(loaded, x), _eval_outputs(model, standardised),
                               rtol=0, atol=1e-6)
