"""Initialisers: the standard deviations and bounds they promise, seeding, and Dense's choice."""
import math

import numpy as np
import pytest

import engine
from engine import init, nn

# a wide weight, so the sample standard deviation is within ~1% of the true one
SHAPE = (300, 400)


@pytest.mark.parametrize("initializer, expected_std", [
    (init.he_normal, math.sqrt(2 / 300)),
    (init.he_uniform, math.sqrt(2 / 300)),
    (init.xavier_normal, math.sqrt(2 / 700)),
    (init.xavier_uniform, math.sqrt(2 / 700)),
])
def test_standard_deviation(initializer, expected_std):
    weight = initializer(SHAPE)
    assert weight.shape == SHAPE and weight.dtype == np.float32
    assert abs(weight.mean()) < 0.05 * expected_std
    np.testing.assert_allclose(weight.std(), expected_std, rtol=0.03)


@pytest.mark.parametrize("initializer", [init.he_normal, init.he_uniform])
def test_small_fan_in_is_not_integer_division(initializer):
    """``2 / n_in`` as integer division is 0 for n_in > 2: all-zero weights."""
    weight = initializer((3, 20000))
    np.testing.assert_allclose(weight.std(), math.sqrt(2 / 3), rtol=0.03)


@pytest.mark.parametrize("initializer, limit", [
    (init.he_uniform, math.sqrt(6 / 300)),
    (init.xavier_uniform, math.sqrt(6 / 700)),
])
def test_uniform_bounds(initializer, limit):
    weight = initializer(SHAPE, dtype=np.float64)
    assert weight.dtype == np.float64
    assert np.abs(weight).max() <= limit
    assert np.abs(weight).max() > 0.99 * limit


def test_zeros():
    assert not init.zeros((4, 5)).any()


def test_seeded_by_manual_seed():
    engine.manual_seed(7)
    first = init.he_normal((5, 6))
    engine.manual_seed(7)
    np.testing.assert_array_equal(init.he_normal((5, 6)), first)
    assert not np.array_equal(init.he_normal((5, 6)), first)   # the generator moves on


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"positive sizes.*\(0, 3\)"):
        init.he_normal((0, 3))
    with pytest.raises(TypeError, match="float32 or float64"):
        init.xavier_uniform((2, 3), dtype=np.int32)
    with pytest.raises(ValueError, match="unknown initialiser 'glorot'"):
        init.get("glorot")


@pytest.mark.parametrize("activation, expected_std", [
    ("relu", math.sqrt(2 / 300)), ("leaky_relu", math.sqrt(2 / 300)),
    ("sigmoid", math.sqrt(2 / 700)), ("tanh", math.sqrt(2 / 700)), (None, math.sqrt(2 / 700)),
])
def test_dense_picks_he_for_relu_family_and_xavier_otherwise(activation, expected_std):
    model = nn.Sequential([nn.Dense(400, activation=activation, input_shape=(300,))])
    weight, bias = (p.numpy() for p in model.parameters())
    np.testing.assert_allclose(weight.std(), expected_std, rtol=0.03)
    assert not bias.any()


def test_dense_takes_an_initialiser_by_name_or_callable():
    by_name = nn.Dense(50, kernel_initializer="zeros")
    by_callable = nn.Dense(50, kernel_initializer=init.he_uniform)
    nn.Sequential([nn.Flatten(input_shape=(20,)), by_name, by_callable])
    assert not by_name.weight.numpy().any()
    assert np.abs(by_callable.weight.numpy()).max() <= math.sqrt(6 / 50)
