"""Poison mode, anomaly detection and the CUDA launch path's refusals."""
import numpy as np
import pytest

import engine
from ops.memory import empty


def test_poison_fills_allocations_with_nan(device):
    before = engine.debug.is_poisoned()   # ENGINE_POISON=1 runs the suite poisoned throughout
    with engine.debug.poison():
        assert np.isnan(empty((3, 5), np.float32, device).copy_to_host()
                        if device == "cuda" else empty((3, 5), np.float32, device)).all()
        assert (empty(4, np.int64, "cpu") == np.iinfo(np.int64).max).all()
    assert engine.debug.is_poisoned() == before


def test_poison_mode_exposes_an_unwritten_output():
    """The mechanism the op suite relies on: a kernel that skips an element is caught."""
    with engine.debug.poison():
        out = empty(4, np.float32, "cpu")
        out[:3] = 1.0   # "forgets" the last element
        assert np.isnan(out).any()


def test_anomaly_names_op_and_phase_forward(device):
    x = engine.tensor([1.0, -1.0], device=device, requires_grad=True)
    with engine.detect_anomaly():
        with pytest.raises(engine.AnomalyError, match=r"log: 1 non-finite value\(s\) in the forward"):
            x.log()


@pytest.mark.filterwarnings("ignore:divide by zero")   # the simulator computes it in NumPy
def test_anomaly_names_op_and_phase_backward(device):
    x = engine.tensor([0.0, 4.0], device=device, requires_grad=True)
    y = x.sqrt().sum()    # forward is finite, d sqrt / dx at 0 is Inf
    with engine.detect_anomaly():
        with pytest.raises(engine.AnomalyError, match="sqrt: .* in the backward"):
            y.backward()


@pytest.mark.cuda
def test_launch_refuses_host_arrays():
    from ops.shape import TRANSPOSE
    x = empty((2, 3), np.float32, "cuda")
    with pytest.raises(TypeError, match=r"transpose: argument 1 is a host NumPy array of "
                                        r"shape \(3, 2\)"):
        TRANSPOSE(x, np.zeros((3, 2), np.float32))
