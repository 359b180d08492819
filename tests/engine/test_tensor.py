"""Tensor creation, dtypes, devices and conversions."""
import numpy as np
import pytest

import engine


def test_creation_copies_and_defaults_to_float32(device):
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = engine.tensor(source, device=device)
    source[0, 0] = 100
    assert x.shape == (2, 3) and x.ndim == 2 and x.size == 6 and x.device == device
    assert x.dtype == np.float32 and x.numpy()[0, 0] == 0
    assert engine.tensor([[1.0, 2.0]]).dtype == np.float32
    assert engine.tensor([1, 2]).dtype == np.int64
    assert engine.tensor(np.ones(2)).dtype == np.float64
    assert engine.tensor([[1.0, 2.0]], dtype=np.float64, device=device).dtype == np.float64


@pytest.mark.parametrize("dtype", [np.float16, np.complex64, np.int16])
def test_unsupported_dtype_is_a_type_error(dtype):
    with pytest.raises(TypeError, match=str(np.dtype(dtype))):
        engine.tensor(np.zeros(2, dtype=dtype))
    with pytest.raises(TypeError, match=str(np.dtype(dtype))):
        engine.zeros(2, dtype=dtype)


def test_bool_tensors_hold_masks(device):
    mask = engine.tensor([True, False], device=device)
    assert mask.dtype == np.bool_ and mask.device == device
    assert engine.tensor(np.array([[0, 1]]) > 0, device=device).dtype == np.bool_
    assert engine.zeros(3, dtype=bool, device=device).numpy().tolist() == [False] * 3
    assert engine.ones(2, dtype=np.bool_, device=device).numpy().tolist() == [True] * 2
    assert "dtype=bool" in repr(mask)
    assert engine.tensor(mask, dtype=np.float64, device=device).numpy().tolist() == [1, 0]
    with pytest.raises(TypeError, match="bool"):
        mask.requires_grad = True


def test_tensor_of_a_tensor_converts_its_dtype_on_its_device(device):
    x = engine.tensor([1.5, -2.5], device=device)
    y = engine.tensor(x, dtype=np.int32, device=device)
    assert y.dtype == np.int32 and y.device == device and y.numpy().tolist() == [1, -2]
    z = engine.tensor(x, dtype=np.float64, device="cpu")
    assert z.dtype == np.float64 and z.device == "cpu" and z.numpy().tolist() == [1.5, -2.5]


def test_to_takes_a_dtype_as_its_first_argument(device):
    x = engine.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = x.to(np.float64)
    assert y.dtype == np.float64 and y.device == device and not y.is_leaf
    moved = x.to("cpu", np.float64)
    assert moved.dtype == np.float64 and moved.device == "cpu"
    with pytest.raises(TypeError, match="two dtypes"):
        x.to(np.float64, np.float32)


def test_integer_tensors_never_require_grad():
    with pytest.raises(TypeError, match="int64"):
        engine.tensor([1, 2], requires_grad=True)
    with pytest.raises(TypeError, match="exp: input 0 has dtype int64"):
        engine.tensor([1, 2]).exp()


def test_factories_and_seeding(device):
    assert engine.zeros(2, 3, device=device).numpy().sum() == 0
    assert engine.ones((2, 3), device=device).numpy().sum() == 6
    engine.manual_seed(5)
    a = engine.randn(4, 3, device=device).numpy()
    engine.manual_seed(5)
    b = engine.randn(4, 3, device=device).numpy()
    np.testing.assert_array_equal(a, b)
    assert abs(engine.randn(20000, seed=1).numpy().std() - 1) < 0.03


def test_item_to_and_repr(device):
    x = engine.tensor([[2.5]], device=device, requires_grad=True)
    assert x.item() == 2.5
    assert x.to("cpu").device == "cpu" and x.to(device) is x
    assert "requires_grad=True" in repr(x)
    with pytest.raises(ValueError, match="one-element"):
        engine.zeros(2).item()
    with pytest.raises(ValueError, match="unknown device"):
        engine.zeros(2, device="tpu")


def test_numpy_operands_and_reflected_scalars(device):
    x = engine.tensor([1.0, 2.0], device=device)
    np.testing.assert_allclose((np.array([1.0, 1.0], np.float32) + x).numpy(), [2, 3])
    np.testing.assert_allclose((1 - x).numpy(), [0, -1])
    np.testing.assert_allclose((2 / x).numpy(), [2, 1])
    np.testing.assert_allclose((x ** 2).numpy(), [1, 4])
    with pytest.raises(TypeError, match="exponent"):
        x ** x


# ------------------------------------------------------------------ device names

def test_auto_device_never_picks_the_cuda_simulator():
    """"auto" means a real GPU: in a process running Numba's simulator it is the CPU, while
    "cuda" still asks for the simulator there (as the CUDA tests do)."""
    import os
    import subprocess
    import sys
    code = ("from ops.device import check_device, cuda_available\n"
            "import engine\n"
            "print(cuda_available(), check_device('auto'), check_device('cuda'),"
            " engine.zeros(2, device='auto').device)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "cpu", "cuda", "cpu"]


def test_unusable_cuda_names_the_cuda_extra_and_not_the_simulator(monkeypatch):
    import ops.device
    monkeypatch.setattr(ops.device, "SIMULATOR", False)
    monkeypatch.setattr(ops.device, "cuda_available", lambda: False)
    assert ops.device.check_device("auto") == "cpu"
    for name in ("cuda", "CUDA:0"):
        with pytest.raises(RuntimeError) as error:
            ops.device.check_device(name)
        message = str(error.value)
        assert "no CUDA GPU is usable here" in message and ".[cuda]" in message
        assert "NUMBA_ENABLE_CUDASIM" not in message and "simulator" not in message
        assert "\n" not in message
