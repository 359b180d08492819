"""torch's layer names (engine.nn.torch_layers), engine.keras (Keras's names and defaults,
channels-last images), Sequential's inputs of another shape, float64 inputs alike as NumPy
arrays and Tensors, ``from engine.data import ...`` and ``engine.accelerator``."""
import numpy as np
import pytest
torch = pytest.importorskip("torch")

import engine
from engine import nn, optim
from engine.interop.torch import load_state_dict


def test_linear_and_relu_compute_torch_s_function():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3),
                                    torch.nn.Tanh(), torch.nn.Linear(3, 2), torch.nn.Softmax(dim=1))
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Tanh(),
                          nn.Linear(3, 2), nn.Softmax(dim=1))
    load_state_dict(model, reference.state_dict())
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(model(x).numpy(), reference(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_linear_starts_from_torch_s_distribution():
    engine.manual_seed(0)
    layer = nn.Sequential(nn.Linear(400, 300))[0]
    bound = 1 / np.sqrt(400)
    for values in (layer.weight.numpy(), layer.bias.numpy()):
        assert np.abs(values).max() <= bound and np.abs(values).max() > 0.95 * bound


def test_a_module_of_linears_has_its_parameters_before_its_first_call():
    """torch's habit: the optimizer is made from model.parameters() right after construction;
    the first call then packs the same Parameters into the flat buffer the optimizer steps."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(engine.relu(self.fc1(x)))

    model = Net()
    params = model.parameters()
    assert [p.shape for p in params] == [(4, 8), (8,), (8, 3), (3,)]
    opt = optim.SGD(params, lr=0.1)
    x = engine.tensor(np.random.default_rng(0).standard_normal((16, 4)))
    y = engine.tensor(np.arange(16) % 3)
    losses = []
    for _ in range(5):
        loss = nn.CrossEntropyLoss()(model(x.float()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.flat is model.flat_buffers()[0] for p in params)


def test_linear_checks_its_in_features():
    with pytest.raises(ValueError, match=r"declares input_shape \(None, 5\) but gets .* "
                                         r"output \(None, 3\)"):
        nn.Sequential([nn.Linear(4, 3), nn.Linear(5, 2)])
    with pytest.raises(ValueError, match="bias=False is not supported"):
        nn.Linear(4, 3, bias=False)


def test_conv2d_batchnorm2d_and_maxpool2d_match_torch():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3),
                                    torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                    torch.nn.Linear(3 * 4 * 4, 2)).eval()
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    model.build((2, 8, 8))
    load_state_dict(model, reference.state_dict())
    model.eval()
    x = np.random.default_rng(0).standard_normal((3, 2, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(model(x).numpy(), reference(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="Conv2d: built for 2 channels .* the input has 1"):
        nn.Sequential([nn.Conv2d(2, 3, 3)]).build((1, 8, 8))


def test_torch_named_layers_save_and_load(tmp_path):
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.LeakyReLU(0.2), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(2 * 3 * 3, 4), nn.GELU(), nn.Linear(4, 2))
    model.build((1, 8, 8))
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    assert [type(layer).__name__ for layer in loaded.layers] == [
        type(layer).__name__ for layer in model.layers]
    x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    model.eval(), loaded.eval()
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


# ------------------------------------------------------------------ Keras's names

def test_keras_facade_channels_last_equals_channels_first():
    from engine import keras
    from engine.keras import layers
    engine.manual_seed(0)
    last = keras.Sequential([keras.Input(shape=(8, 8, 2)),
                             layers.Conv2D(3, kernel_size=(3, 3), activation="relu"),
                             layers.MaxPooling2D(pool_size=(2, 2))])
    first = nn.Sequential([nn.Conv2D(3, 3, activation="relu", input_shape=(2, 8, 8)),
                           nn.MaxPool2D(2)])
    assert last.output_shape == (3, 3, 3) and last.layers[0].data_format == "channels_last"
    first.load_state_dict(last.state_dict())
    x = np.random.default_rng(0).standard_normal((2, 2, 8, 8)).astype(np.float32)
    expected = first(x).numpy()
    got = last(np.ascontiguousarray(np.moveaxis(x, 1, -1))).numpy()
    np.testing.assert_allclose(got, np.moveaxis(expected, 1, -1), rtol=1e-6, atol=1e-6)
    y = last(engine.tensor(np.moveaxis(x, 1, -1).copy(), requires_grad=True))
    y.sum().backward()   # the layout moves are differentiable


def test_keras_layers_start_glorot_uniform_with_zero_biases():
    from engine.keras import layers
    layer = layers.Dense(300, activation="relu", input_shape=(400,))
    nn.Sequential([layer])
    bound = np.sqrt(6 / 700)
    assert np.abs(layer.weight.numpy()).max() <= bound
    assert np.abs(layer.weight.numpy()).max() > 0.95 * bound
    assert not layer.bias.numpy().any()


def test_keras_input_comes_first_and_is_no_layer():
    model = nn.Sequential([nn.Input(shape=(3,)), nn.Dense(2)])
    assert model.built and len(model) == 1 and model.input_shape == (3,)
    with pytest.raises(ValueError, match="comes first"):
        nn.Sequential([nn.Dense(2, input_shape=(3,)), nn.Input(shape=(2,))])


def test_to_categorical():
    from engine import keras
    np.testing.assert_array_equal(keras.utils.to_categorical([2, 0], 3),
                                  [[0, 0, 1], [1, 0, 0]])
    assert keras.utils.to_categorical(np.array([[1], [0]])).shape == (2, 2)
    with pytest.raises(ValueError, match="outside \\[0, 3\\)"):
        keras.utils.to_categorical([3], 3)


def test_channels_last_conv_saves_its_layout(tmp_path):
    from engine.keras import layers
    model = nn.Sequential([layers.Conv2D(2, 3, input_shape=(6, 6, 1)), layers.Flatten()])
    model.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz")
    assert loaded.layers[0].data_format == "channels_last" and loaded.output_shape == (32,)


# ------------------------------------------------------------------ inputs

def test_a_sequential_takes_another_sequence_length_as_torch_does():
    model = nn.Sequential([nn.Embedding(10, 4), nn.Dense(3)])
    ids = np.array([[1, 2, 3]])
    assert model(ids).shape == (1, 3, 3)
    assert model(np.array([[1, 2, 3, 4, 5]])).shape == (1, 5, 3)


def test_float64_input_is_refused_alike_as_an_array_and_a_tensor():
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    data = np.ones((2, 3))
    with pytest.raises(TypeError, match=r"float64 \(a NumPy array\) does not match the model's "
                                        r"float32; convert the input \(x.astype\(np.float32\)\)"):
        model(data)
    with pytest.raises(TypeError, match="input dtype float64 does not match the layer's float32"):
        model(engine.tensor(data))
    assert model([[1.0, 2.0, 3.0]]).dtype == np.float32          # a list takes the model's
    assert model.predict(data).dtype == np.float32               # Keras's methods convert
    assert model.to(np.float64)(data).dtype == np.float64


def test_engine_data_and_optim_import_as_submodules():
    import data
    import optim as top_optim
    from engine.data import DataLoader, TensorDataset
    from engine.optim import SGD
    import engine.data.transforms
    assert DataLoader is data.DataLoader and SGD is top_optim.SGD
    assert engine.data.transforms is data.transforms and data.__spec__.name == "data"
    loader = DataLoader(TensorDataset(np.zeros((5, 2, 2), np.uint8), np.arange(5)), batch_size=2)
    assert len(loader.dataset) == 5 and len(loader) == 3


def test_torch_accelerator_idiom():
    device = (engine.accelerator.current_accelerator().type
              if engine.accelerator.is_available() else "cpu")
    assert device in ("cpu", "cuda")


def test_to_sequential_converts_torch_named_layers_and_refuses_channels_last():
    from engine.interop.torch import to_sequential
    from engine.keras import layers
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    module = to_sequential(model)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(module(torch.from_numpy(x)).detach().numpy(), model(x).numpy(),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="channels-last"):
        to_sequential(nn.Sequential([layers.Conv2D(2, 3, input_shape=(6, 6, 1))]))


def test_keras_input_with_a_variable_length_builds_on_the_first_call():
    model = nn.Sequential([nn.Input(shape=(None, 4)), nn.Dense(3)])
    assert not model.built
    assert model(np.ones((2, 5, 4), np.float32)).shape == (2, 5, 3)
    assert model(np.ones((2, 7, 4), np.float32)).shape == (2, 7, 3)


def test_linear_after_an_undeclared_layer_takes_any_rank_and_keeps_its_parameters():
    """A transformer's MLP: LayerNorm, then Linear(64, ...), on (N, T, 64)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.LayerNorm(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(x + self.mlp(x))

    model = Block()
    params = model.parameters() if model.mlp.built else None   # the mlp builds on the call
    assert params is None
    y = model(np.ones((2, 5, 8), np.float32))
    assert y.shape == (2, 5, 3)
    head = model.head.weight
    assert model(np.ones((2, 7, 8), np.float32)).shape == (2, 7, 3)
    assert model.head.weight is head


def test_layer_norm_takes_torch_s_normalized_shape():
    layer = nn.LayerNorm(8)
    assert layer.eps == 1e-5 and layer.normalized_shape == 8
    model = nn.Sequential([layer])
    assert model(np.ones((2, 3, 8), np.float32)).shape == (2, 3, 8)
    assert nn.LayerNorm((8,)).normalized_shape == 8 and nn.LayerNorm(1e-6).eps == 1e-6
    with pytest.raises(ValueError, match="normalized_shape is 4, the input's last axis 8"):
        nn.Sequential([nn.LayerNorm(4)])(np.ones((2, 8), np.float32))


def test_onnx_export_refuses_a_channels_last_layer(tmp_path):
    from engine import onnx
    from engine.keras import layers
    model = nn.Sequential([layers.Conv2D(2, 3, input_shape=(6, 6, 1)), layers.Flatten()])
    with pytest.raises(ValueError, match="channels-last"):
        onnx.export(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_global_average_pooling_2d(tmp_path):
    from engine.keras import layers
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 3)).astype(np.float32)
    model = nn.Sequential([layers.GlobalAveragePooling2D(input_shape=(4, 5, 3)), layers.Dense(2)])
    assert model.output_shape == (2,)
    pooled = model.layers[0](engine.tensor(x))
    np.testing.assert_allclose(pooled.numpy(), x.mean(axis=(1, 2)), rtol=1e-6)
    model.save(tmp_path / "m.npz")
    np.testing.assert_array_equal(nn.load(tmp_path / "m.npz")(x).numpy(), model(x).numpy())
    first = layers.GlobalAveragePooling2D(data_format="channels_first", keepdims=True)
    assert first(engine.tensor(np.moveaxis(x, -1, 1).copy())).shape == (2, 3, 1, 1)


def test_channels_last_layers_on_each_device(device):
    """The layout moves run on the model's device; tiny shapes for the simulator."""
    from engine.keras import layers
    engine.manual_seed(0)
    model = nn.Sequential([layers.Conv2D(2, 2, activation="relu", input_shape=(4, 4, 1)),
                           layers.MaxPooling2D(pool_size=(1, 1)),
                           layers.GlobalAveragePooling2D()])
    x = np.random.default_rng(0).random((2, 4, 4, 1), dtype=np.float32)
    expected = model(x).numpy()
    model.to(device)
    t = engine.tensor(x, device=device, requires_grad=True)
    y = model(t)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert t.grad.shape == x.shape


def test_keras_batch_normalization_channels_last_matches_channels_first(tmp_path):
    from engine.keras import layers
    x = np.random.default_rng(0).standard_normal((4, 3, 3, 2)).astype(np.float32)
    last = nn.Sequential([layers.BatchNormalization(momentum=0.9, input_shape=(3, 3, 2))])
    first = nn.Sequential([nn.BatchNorm(momentum=0.1, eps=1e-3, input_shape=(2, 3, 3))])
    got = last(x).numpy()   # training mode: batch statistics, running ones move
    expected = first(np.ascontiguousarray(np.moveaxis(x, -1, 1))).numpy()
    np.testing.assert_allclose(got, np.moveaxis(expected, 1, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last.state_dict()["batchnormalization.running_mean"],
                               first.state_dict()["batchnorm.running_mean"], rtol=1e-6)
    last.save(tmp_path / "m.npz")
    loaded = nn.load(tmp_path / "m.npz").eval()
    np.testing.assert_array_equal(loaded(x).numpy(), last.eval()(x).numpy())
    features = nn.Sequential([layers.BatchNormalization(input_shape=(5,))])
    assert features(np.ones((3, 5), np.float32)).shape == (3, 5)


@pytest.mark.parametrize("nested", [False, True])
def test_an_optimizer_given_parameters_before_the_first_call_trains_the_model(nested):
    """torch's ``nn.Sequential(nn.Flatten(), nn.Linear(...), ...)``: ``parameters()`` builds the
    Linears from their declared features before the first call; the call that builds the rest
    keeps them, so the optimizer holds the parameters the model runs (a second build had
    made new ones: the loss never moved, and zero_grad reached no gradient the model used)."""
    def stack():
        return nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = stack()

        def forward(self, x):
            return self.body(x)

    model = Net() if nested else stack()
    params = model.parameters()
    optimizer = engine.optim.SGD(params, lr=0.5)
    rng = np.random.default_rng(0)
    x = engine.tensor(rng.standard_normal((6, 1, 8)).astype(np.float32))
    y = engine.tensor(rng.integers(0, 3, 6))
    losses = []
    for _ in range(3):
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        assert all(p.grad is None for p in model.parameters())
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * 4
    assert losses[2] < losses[1] < losses[0]


def test_a_failed_first_call_keeps_the_parameters_handed_out():
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))
    params = model.parameters()
    with pytest.raises(ValueError, match="declares input_shape"):
        model(np.ones((2, 5), np.float32))
    assert model(np.ones((2, 8), np.float32)).shape == (2, 3)
    assert [p is q for p, q in zip(model.parameters(), params)] == [True, True]
