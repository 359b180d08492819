"""Issue 47, "silently wrong numbers": each case here gave a wrong number (or lost one) without
an error before its fix; each is checked against torch's answer or against the exact value."""
import threading

import numpy as np
import pytest

import engine
from engine import nn


# ------------------------------------------------------------------ a reduction over size-1 axes

@pytest.mark.parametrize("reduce, shape, axis", [
    ("sum", (4, 1), 1),          # a Dense(1) scorer squeezed by .sum(-1)
    ("sum", (4, 1), -1),
    ("mean", (2, 3, 1, 1), (2, 3)),   # a 1x1 global average
    ("sum", (1, 5), 0),
    ("mean", (3, 1, 2), 1),
])
def test_a_reduction_over_size_one_axes_passes_each_gradient_element_back(device, reduce, shape,
                                                                          axis):
    x = engine.tensor(np.zeros(shape), device=device, requires_grad=True)
    out = getattr(x, reduce)(axis=axis)
    g = np.arange(1.0, out.size + 1).reshape(out.shape)
    out.backward(engine.tensor(g, dtype=np.float32, device=device))
    # every reduced axis has size 1: the gradient is g itself, element by element (it was
    # g's first element everywhere)
    np.testing.assert_array_equal(x.grad.numpy(), g.reshape(shape))


def test_expand_reads_the_same_shape_layout_element_by_element():
    from ops import reduce as rd
    g = np.arange(6.0).reshape(3, 2, 1)
    np.testing.assert_array_equal(rd.expand(g, (3, 2, 1), (2,), scale=0.5), g * 0.5)
