"""More of a PyTorch user's habits: a one-element integer tensor as an index, x.type(),
engine.float32-style dtype names, requires_grad_() on any tensor."""
import numpy as np
import pytest

import engine


def test_an_integer_scalar_tensor_indexes_a_list():
    classes = ["cat", "dog", "bird"]
    scores = engine.tensor([0.1, 0.7, 0.2])
    assert classes[scores.argmax(0)] == "dog"
    assert list(range(10))[engine.tensor(np.int64(3)):engine.tensor(np.int64(5))] == [3, 4]
    with pytest.raises(TypeError, match=r"only one-element integer tensors can be used as an "
                                        r"index, this one has shape \(\) and dtype float32"):
        classes[engine.tensor(1.0)]


def test_type_names_and_casts():
    x = engine.tensor([1.5, 2.5])
    assert x.type() == "float32"
    assert x.type(engine.float64).dtype == np.float64
    assert x.type("torch.LongTensor").dtype == np.int64
    assert x.type(np.float32) is x


def test_requires_grad_in_place_on_any_tensor():
    x = engine.tensor([1.0, -2.0]).requires_grad_()
    assert x.requires_grad and x.is_leaf
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, -4.0])
    assert x.requires_grad_(False) is x and not x.requires_grad
    y = engine.tensor([1.0]).requires_grad_() * 2
    with pytest.raises(RuntimeError, match="a tensor computed from others cannot stop "
                                           "requiring grad; use .detach()"):
        y.requires_grad_(False)
    with pytest.raises(TypeError, match="only float32/float64 tensors can require grad"):
        engine.tensor([1, 2]).requires_grad_()


@pytest.mark.parametrize("name, dtype", [("float32", np.float32), ("float", np.float32),
                                         ("float64", np.float64), ("double", np.float64),
                                         ("long", np.int64), ("int64", np.int64),
                                         ("int32", np.int32), ("uint8", np.uint8),
                                         ("bool", np.bool_)])
def test_torch_dtype_names(name, dtype):
    assert getattr(engine, name) is dtype
    assert name in dir(engine)


def test_a_tensor_made_with_a_torch_style_dtype():
    assert engine.tensor([1, 2], dtype=engine.float64).dtype == np.float64
    assert engine.zeros((2,), dtype=engine.long).dtype == np.int64


@pytest.mark.parametrize("name, words", [
    ("MaxPooling2D", r"nn.MaxPool2D\(pool_size\).*engine.keras.layers.MaxPooling2D"),
    ("GlobalAveragePooling2D", "nn.AvgPool2D"), ("BatchNormalization", r"nn.BatchNorm\(\)")])
def test_keras_names_name_the_engine_s_equivalent(name, words):
    from engine import nn
    with pytest.raises(AttributeError, match=words):
        getattr(nn, name)


def test_a_channels_last_image_is_named_as_such():
    from engine import nn
    with pytest.raises(ValueError, match=r"looks channels last \(NHWC\); move the channels "
                                         r"first"):
        nn.Sequential([nn.Conv2D(32, 3, input_shape=(28, 28, 1))])
    nn.Sequential([nn.Conv2D(4, 3, input_shape=(1, 28, 28))])   # channels first: fine


def test_torch_s_initialisation_by_name():
    """kernel_initializer="torch": torch's Linear/Conv weights and biases, U(+-1/sqrt(fan_in))."""
    from engine import nn
    engine.manual_seed(0)
    dense = nn.Sequential([nn.Dense(300, kernel_initializer="torch", input_shape=(400,))])
    weight, bias = dense.layers[0].weight.numpy(), dense.layers[0].bias.numpy()
    limit = 1 / np.sqrt(400)
    assert np.abs(weight).max() <= limit and np.abs(weight).max() > 0.99 * limit
    assert np.abs(bias).max() <= limit and abs(bias.std() - limit / np.sqrt(3)) < 0.1 * limit
    conv = nn.Sequential([nn.Conv2D(64, 3, kernel_initializer="torch", input_shape=(2, 9, 9))])
    conv_limit = 1 / np.sqrt(2 * 3 * 3)
    assert np.abs(conv.layers[0].weight.numpy()).max() <= conv_limit
    assert np.abs(conv.layers[0].bias.numpy()).max() > 0.5 * conv_limit
    assert dense.get_config()["layers"][0]["config"]["kernel_initializer"] == "torch"
    plain = nn.Sequential([nn.Dense(3, input_shape=(4,))])
    assert not plain.layers[0].bias.numpy().any()   # the default keeps zero biases
