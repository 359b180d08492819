"""Poison mode, anomaly detection and the CUDA launch path's refusals."""
import numpy as np
import pytest
from numba import njit

import engine
from ops.cuda import cuda
from ops.device import to_device, to_host
from ops.launch import Kernel, elements
from ops.memory import empty


@njit
def _copy_but_the_last_cpu(x, out):
    for i in range(x.size - 1):   # the bug under test: out[-1] is never written
        out[i] = x[i]


@cuda.jit
def _copy_but_the_last_cuda(x, out):
    i = cuda.grid(1)
    if i < x.size - 1:
        out[i] = x[i]


COPY_BUT_THE_LAST = Kernel("copy_but_the_last", _copy_but_the_last_cpu, _copy_but_the_last_cuda,
                           elements(0))


def test_poison_fills_allocations_with_nan(device):
    before = engine.debug.is_poisoned()   # ENGINE_POISON=1 runs the suite poisoned throughout
    with engine.debug.poison():
        assert np.isnan(empty((3, 5), np.float32, device).copy_to_host()
                        if device == "cuda" else empty((3, 5), np.float32, device)).all()
        assert (empty(4, np.int64, "cpu") == np.iinfo(np.int64).max).all()
    assert engine.debug.is_poisoned() == before


def test_poison_mode_exposes_a_kernel_that_skips_an_element(device):
    """The mechanism the op suite relies on: a real kernel pair that leaves out[-1] unwritten,
    run on an output from ``ops.memory.empty``, shows NaN exactly there in poison mode."""
    x = to_device(np.arange(1.0, 6.0, dtype=np.float32), device)
    with engine.debug.poison():
        out = empty(5, np.float32, device)
        COPY_BUT_THE_LAST(x, out)
    host = to_host(out)
    assert np.isnan(host[-1]) and host[:-1].tolist() == [1, 2, 3, 4]


def test_anomaly_names_op_and_phase_forward(device):
    x = engine.tensor([1.0, -1.0], device=device, requires_grad=True)
    with engine.detect_anomaly():
        with pytest.raises(engine.AnomalyError,
                           match=r"log: 1 non-finite value\(s\) in the forward"):
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
