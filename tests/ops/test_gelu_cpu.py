"""The exact GELU's CPU kernels (ops.gelu_cpu): float32 by vectorisable erf and exp code,
within torch's own float32 error of the float64 values; float64 by the library calls, the
same bits as ``ops.pointwise``; the same bits on 1 and 2 threads; the loop vectorised."""
import math

import numpy as np
import pytest
import torch
from numba import njit

import engine
from ops import cpu_threads
from ops.elementwise import UNARY
from ops.gelu_cpu import exp_nonpositive_float32, gelu_cpu, gelu_grad_cpu
from ops.pointwise import GELU, derivative_cpu, value_cpu
from tests.support.first_compile import assert_first_compile_is_quiet

# the GPT's hidden activations' range and beyond: both tails, zero, the erf clamp at +-4 sqrt2
X = np.concatenate([np.random.default_rng(0).standard_normal(50_000) * 3,
                    np.linspace(-30, 30, 20_001), [0.0, -0.0, 5.656854, -5.656854]])


def _float64_reference(x):
    erf = np.vectorize(math.erf)(x / math.sqrt(2))
    value = 0.5 * x * (1 + erf)
    derivative = 0.5 * (1 + erf) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return value, derivative


def _kernels(x):
    out, grad = np.empty_like(x), np.empty_like(x)
    p = x.dtype.type(0)
    gelu_cpu(x, out, p)
    gelu_grad_cpu(x, out, np.ones_like(x), grad, p)
    return out, grad


def test_float32_gelu_and_derivative_are_as_close_to_float64_as_torch_s_float32():
    x = X.astype(np.float32)
    value, derivative = _kernels(x)
    ref_value, ref_derivative = _float64_reference(x.astype(np.float64))
    tx = torch.from_numpy(x.copy()).requires_grad_()
    torch.nn.functional.gelu(tx).sum().backward()
    torch_value = torch.nn.functional.gelu(tx).detach().numpy().astype(np.float64)
    torch_derivative = tx.grad.numpy().astype(np.float64)
    for ours, theirs, ref in ((value, torch_value, ref_value),
                              (derivative, torch_derivative, ref_derivative)):
        error = np.abs(ours.astype(np.float64) - ref)
        assert error.max() <= max(1.5 * np.abs(theirs - ref).max(), 1e-7)
        assert error.max() <= 2e-6   # float32 ulps of values up to 30, and cancellation in 1+erf
    np.testing.assert_array_equal(value[x > 5.7], x[x > 5.7])   # erf(x/sqrt2) is 1 in float32
    assert np.all(value[x < -6] <= 0) and np.all(value[x < -6] >= -2e-6)


def test_the_exp_is_float32_accurate_and_zero_below_its_floor():
    a = -np.linspace(0, 100, 100_001).astype(np.float32)
    ours = np.array([exp_nonpositive_float32(v) for v in a[::97]], dtype=np.float64)
    ref = np.exp(a[::97].astype(np.float64))
    normal = a[::97] >= -87   # below, e^a is under 1.7e-38: flushed to 0
    assert np.all(np.abs(ours - ref)[normal] <= 2 * np.spacing(ref[normal].astype(np.float32)))
    assert np.all(ours[a[::97] < -87] == 0)


@njit
def _pointwise_gelu(x, value, derivative):
    for i in range(x.size):
        value[i] = value_cpu(GELU, x[i], 0.0)
        derivative[i] = derivative_cpu(GELU, x[i], x[i], 0.0)


def test_float64_keeps_the_library_functions_bit_for_bit():
    value, derivative = _kernels(X.copy())
    library_value, library_derivative = np.empty_like(X), np.empty_like(X)
    _pointwise_gelu(X, library_value, library_derivative)
    assert np.array_equal(value, library_value)
    assert np.array_equal(derivative, library_derivative)


def test_nan_and_infinities_come_out_as_the_float64_path_s():
    x = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    for ours, library in zip(_kernels(x), _kernels(x.astype(np.float64))):
        np.testing.assert_array_equal(ours, library.astype(np.float32))   # nan where nan


def test_the_gelu_op_runs_the_float32_kernels_and_is_the_same_bits_on_1_and_2_threads():
    x = (np.random.default_rng(1).standard_normal(393_216) * 2).astype(np.float32)
    results = []
    try:
        for threads in (1, 2):
            engine.set_num_threads(threads)
            t = engine.tensor(x, requires_grad=True)
            y = t.gelu()
            y.backward(engine.tensor(np.ones_like(x)))
            results.append((y.numpy().copy(), t.grad.numpy().copy()))
    finally:
        cpu_threads.set_threads(None)
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])
    assert np.array_equal(results[0][0], _kernels(x)[0])
    assert UNARY[GELU][0].cpu.__wrapped__ is gelu_cpu


@pytest.mark.parametrize("kernel, arrays", [(gelu_cpu, 2), (gelu_grad_cpu, 4)])
def test_the_float32_loops_vectorise(kernel, arrays):
    fresh = njit(error_model="numpy")(kernel.py_func)   # cached code cannot be inspected
    x = np.ones(64, np.float32)
    fresh(*[x.copy() for _ in range(arrays)], np.float32(0))
    assert "vector.body" in fresh.inspect_llvm(fresh.signatures[0])


def test_a_first_compile_of_gelu_and_attention_prints_no_numba_ir_warning(tmp_path):
    """From an empty Numba cache, the float32 GELU and CPU attention compile without Numba's
    NumbaIRAssumptionWarning (an inlined conditional expression used to leave a phi that its
    SSA check reported at every first compile)."""
    assert_first_compile_is_quiet(
        "import numpy as np, engine\n"
        "q = engine.tensor(np.ones((1, 2, 5, 4), np.float32), requires_grad=True)\n"
        "engine.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()\n"
        "x = engine.tensor(np.ones(7, np.float32), requires_grad=True)\n"
        "engine.gelu(x).sum().backward()\n", tmp_path)


def test_select_takes_one_type_and_a_boolean_condition():
    from numba.core.errors import TypingError
    from ops.gelu_cpu import select

    @njit
    def pick(c, a, b):
        return select(c, a, b)

    assert pick(True, np.float32(1), np.float32(2)) == 1 and pick(False, 1.5, 2.5) == 2.5
    with pytest.raises(TypingError):
        pick(True, np.float32(1), 2.0)   # float32 and float64: no silent conversion
    with pytest.raises(TypingError):
        pick(1, 1.0, 2.0)   # an int condition


def test_running_max_is_the_maximum_and_takes_one_float_type():
    from numba.core.errors import TypingError
    from ops.gelu_cpu import running_max

    @njit
    def row_max(row, keys):
        top = row.dtype.type(-np.inf)
        for j in range(keys):
            top = running_max(top, row[j])
        return top

    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        row = rng.standard_normal(67).astype(dtype)
        row[[5, 40]] = -np.inf
        for keys in (0, 1, 7, 8, 9, 33, 67):   # around the vector widths, and none
            expected = row[:keys].max() if keys else -np.inf
            assert row_max(row, keys) == expected
    with pytest.raises(TypingError):
        row_max(np.arange(4), 4)   # integers: not a float maximum
