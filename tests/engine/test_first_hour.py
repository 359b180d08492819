"""What a newcomer tries in the first hour: models that take raw images, PyTorch's names,
custom layers that load, and the errors that natural guesses meet."""
import re

import numpy as np
import pytest

import data
import engine
import optim
from engine import nn

RAW = data.mnist.load()[1][0][:40]   # uint8 test images, as the data set ships them
MEAN, STD = 0.1307, 0.3081


def _raw_image_model(hidden=8):
    return nn.Sequential([nn.Rescaling(1 / 255, input_shape=(28, 28)),
                          nn.Normalization(MEAN, STD ** 2), nn.Flatten(),
                          nn.Dense(hidden, activation="relu"), nn.Dense(10)])


# ------------------------------------------------------------------ the model takes raw images

def test_rescaling_and_normalization_compute_keras_formulas():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    rescaled = nn.Sequential([nn.Rescaling(0.5, offset=-1.0, input_shape=(3, 4))])(x).numpy()
    np.testing.assert_array_equal(rescaled, x * 0.5 - 1.0)
    mean, variance = np.linspace(0, 1, 4), np.array([4.0, 1.0, 0.0, 0.25])
    normalized = nn.Sequential([nn.Normalization(mean, variance, input_shape=(3, 4))])(x)
    expected = (x - mean) / np.maximum(np.sqrt(variance), 1e-7)   # Keras's floor on the std
    np.testing.assert_allclose(normalized.numpy(), expected.astype(np.float32), rtol=1e-6)


def test_a_model_with_them_takes_uint8_as_the_loader_s_model_takes_scaled_images():
    engine.manual_seed(0)
    raw_model = _raw_image_model()
    engine.manual_seed(0)
    plain = nn.Sequential([nn.Flatten(input_shape=(28, 28)), nn.Dense(8, activation="relu"),
                           nn.Dense(10)])
    loader = data.DataLoader(RAW, np.zeros(len(RAW), np.int64), batch_size=len(RAW),
                             normalize=(MEAN, STD))
    scaled, _ = next(iter(loader))
    np.testing.assert_allclose(raw_model.predict(RAW), plain(scaled).numpy(), rtol=0,
                               atol=1e-5)


def test_they_save_load_and_export_to_onnx_with_the_same_outputs(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    model = _raw_image_model()
    model.save(tmp_path / "m.npz")
    model.export_onnx(tmp_path / "m.onnx")
    loaded = nn.load(tmp_path / "m.npz")
    assert [type(layer).__name__ for layer in loaded.layers][:2] == ["Rescaling",
                                                                    "Normalization"]
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"),
                                           providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {"input": RAW})
    np.testing.assert_array_equal(loaded.predict(RAW), model.predict(RAW))
    np.testing.assert_allclose(exported, model.predict(RAW), rtol=0, atol=1e-5)


def test_uint8_given_to_a_float_layer_names_the_fix():
    model = nn.Sequential([nn.Flatten(input_shape=(28, 28)), nn.Dense(4)])
    for given in (RAW[:2], engine.tensor(RAW[:2])):
        with pytest.raises(TypeError, match=r"input dtype uint8 \(raw images\?\).*"
                                            r"nn\.Rescaling\(1 / 255\)"):
            model(given)
    assert model(np.zeros((1, 28, 28), np.int64).tolist()).shape == (1, 4)   # lists of ints


def test_normalization_refuses_statistics_that_do_not_fit():
    with pytest.raises(ValueError, match="pass the variance"):
        nn.Normalization(0.0, -1.0)
    with pytest.raises(ValueError, match=r"must broadcast against one sample of shape \(3,\)"):
        nn.Sequential([nn.Normalization(np.zeros(4), 1.0, input_shape=(3,))])


def test_predict_runs_in_batches_in_eval_mode_without_the_tape():
    model = nn.Sequential([nn.Dense(6, input_shape=(5,)), nn.Dropout(0.5), nn.Dense(3)])
    x = np.random.default_rng(0).standard_normal((11, 5)).astype(np.float32)
    model.eval()
    expected = model(x).numpy()
    model.train()
    for batch_size in (1, 4, 11, 256):
        out = model.predict(x, batch_size=batch_size)
        assert isinstance(out, np.ndarray)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert model.training and not engine.autograd.current_tape().nodes
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        model.predict(x, batch_size=0)


# ------------------------------------------------------------------ custom layers

@nn.register
class Square(nn.Layer):
    def forward(self, x):
        return x * x


@nn.register
class Scale(nn.Layer):
    def __init__(self, factor, input_shape=None):
        super().__init__(input_shape)
        self.factor = factor

    def forward(self, x):
        return x * self.factor

    def get_config(self):
        return {"factor": self.factor, **super().get_config()}


def test_a_registered_custom_layer_saves_and_loads(tmp_path):
    model = nn.Sequential([nn.Dense(3, input_shape=(2,)), Square(), Scale(2.5)])
    x = np.array([[1.0, -2.0]], np.float32)
    model.save(tmp_path / "custom.npz")
    loaded = nn.load(tmp_path / "custom.npz")
    assert [type(layer) for layer in loaded.layers[1:]] == [Square, Scale]
    assert loaded[2].factor == 2.5
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


def test_an_unregistered_layer_is_refused_naming_register_and_names_do_not_clash(tmp_path):
    class Cube(nn.Layer):
        def forward(self, x):
            return x * x * x

    nn.Sequential([nn.Dense(3, input_shape=(2,)), Cube()]).save(tmp_path / "cube.npz")
    with pytest.raises(ValueError, match=r"unknown layer type 'Cube'.*@nn\.register"):
        nn.load(tmp_path / "cube.npz")

    class Dense(nn.Layer):
        pass
    with pytest.raises(ValueError, match="the layer name 'Dense' is taken by engine.nn.Dense"):
        nn.register(Dense)
    with pytest.raises(TypeError, match="expected an nn.Layer subclass"):
        nn.register(len)


# ------------------------------------------------------------------ PyTorch's names

def test_tensor_methods_of_torch():
    x = engine.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    assert x.float() is x and x.double().dtype == np.float64 and x.long().dtype == np.int64
    assert x.size == 6 and x.size() == (2, 3) and x.size(-1) == 3
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        x.size(2)
    copy = x.clone()
    assert copy.data is not x.data
    (copy * copy).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2 * x.numpy())
    grad = x.grad
    assert grad.zero_() is grad and not x.grad.numpy().any()   # in place: x.grad is zero
    with pytest.raises(RuntimeError, match="requires grad"):
        x.zero_()


def test_creation_functions_of_torch():
    assert engine.arange(4).numpy().tolist() == [0, 1, 2, 3]
    assert engine.arange(4).dtype == np.int64
    np.testing.assert_array_equal(engine.arange(1, 2, 0.25).numpy(),
                                  np.array([1, 1.25, 1.5, 1.75], np.float32))
    engine.manual_seed(3)
    first = engine.rand(2, 3).numpy()
    engine.manual_seed(3)
    assert first.shape == (2, 3) and ((first >= 0) & (first < 1)).all()
    np.testing.assert_array_equal(engine.rand(2, 3).numpy(), first)
    array = np.zeros(3, np.float32)
    shared = engine.from_numpy(array)
    array[1] = 7
    assert shared.numpy().tolist() == [0, 7, 0]
    with pytest.raises(ValueError, match="not C-contiguous"):
        engine.from_numpy(np.zeros((4, 4), np.float32)[:, ::2])


def test_sequential_habits_of_torch():
    first, second = nn.Dense(4, input_shape=(3,)), nn.Dense(2)
    model = nn.Sequential(first, second)   # torch's spelling: layers as arguments
    assert len(model) == 2 and model[0] is first and model[-1] is second
    assert model.cpu() is model and model.device == "cpu"
    with pytest.raises(TypeError, match="take model.layers"):
        model[0:1]


def test_cuda_and_cpu_move_the_model(device):
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    assert getattr(model, device)() is model and model.device == device
    assert model.parameters()[0].device == device


@pytest.mark.parametrize("name, engine_class", [
    ("Linear", "Dense"), ("Conv2d", "Conv2D"), ("ReLU", "Activation"), ("Module", "Model"),
    ("ModuleList", "LayerList")])
def test_torch_layer_names_are_the_engine_s_layers(name, engine_class):
    assert issubclass(getattr(nn, name), getattr(nn, engine_class))


def test_a_torch_name_the_engine_lacks_answers_with_the_engine_s():
    with pytest.raises(AttributeError, match=re.escape("no attribute 'Conv1d'; the engine's "
                                                       "equivalent is nn.Conv1D")):
        nn.Conv1d


# ------------------------------------------------------------------ natural guesses

def test_natural_guesses_meet_errors_that_say_what_to_do(tmp_path):
    unbuilt = nn.Sequential([nn.Dense(3)])
    with pytest.raises(RuntimeError, match=r"not built yet; give the first layer input_shape"):
        unbuilt.parameters()
    model = nn.Sequential([nn.Dense(3, input_shape=(2,))])
    with pytest.raises(FileNotFoundError, match=r"the folder '.*no/dir' of .* does not exist"):
        model.save(tmp_path / "no" / "dir" / "m.npz")
    assert nn.Dense(10, activation=engine.relu).activation == "relu"
    with pytest.raises(ValueError, match="activation takes a name"):
        nn.Dense(10, activation=np.exp)
    with pytest.raises(TypeError, match="name must be text"):
        nn.Sequential([nn.Dense(2)], name=nn.Dense(3))


def test_the_engine_s_names_are_listed_before_they_are_imported():
    names = dir(engine)
    assert {"tensor", "Tensor", "relu", "no_grad", "capture", "nn", "optim"} <= set(names)
    assert engine.tensor([1.0]).numpy().tolist() == [1.0]   # the function, not the submodule


def test_an_optimizer_given_the_model_names_model_parameters():
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    with pytest.raises(TypeError, match=r"pass model\.parameters\(\)"):
        optim.Adam(model)


def test_evaluate_given_a_pair_of_arrays_names_a_loader():
    from engine.fit import evaluate
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    x, y = np.zeros((4, 3), np.float32), np.zeros(4, np.int64)
    with pytest.raises(TypeError, match=r"pass a loader of batches"):
        evaluate(model, (x, y))
