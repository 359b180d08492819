"""More of a PyTorch user's habits: a one-element integer tensor as an index, x.type(),
engine.float32-style dtype names."""
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
