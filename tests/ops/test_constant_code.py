"""ops.constant_code: a kernel passing a constant code compiles only that code's branch, and
computes what the whole function computes."""
import math

import numpy as np
import pytest
from numba import njit

from ops import pointwise
from ops.constant_code import pruned
from ops.pointwise import TABLE, derivative, derivative_cpu, value, value_cpu
from tests.support.first_compile import assert_first_compile_is_quiet

POINTS = np.array([-3.0, -0.5, -0.0, 0.0, 0.25, 2.0, 100.0, math.inf, -math.inf, math.nan])


def test_pruned_keeps_only_the_codes_branch():
    relu = pruned(value, pointwise.RELU)
    assert "erf" not in relu.__code__.co_names and "tanh" not in relu.__code__.co_names
    assert "erf" in value.__code__.co_names
    assert relu.__code__.co_filename == value.__code__.co_filename   # errors name its source
    gelu = pruned(derivative, pointwise.GELU)
    assert "erf" in gelu.__code__.co_names and "tanh" not in gelu.__code__.co_names
    # NEG's test is an ``or`` of two codes; IDENTITY takes the final return
    assert pruned(derivative, pointwise.RSUB_SCALAR)(pointwise.RSUB_SCALAR, 2.0, 0.0, 1.0) == -1
    assert pruned(derivative, pointwise.IDENTITY)(pointwise.IDENTITY, 2.0, 2.0, 0.0) == 1
    assert pruned(value, pointwise.RELU) is relu   # made once per (function, code)


# the whole functions with a runtime code, as Numba compiled them before
_whole_value = njit(error_model="numpy")(value)
_whole_derivative = njit(error_model="numpy")(derivative)


@njit(error_model="numpy")
def _whole(code, x, p, values, derivatives):
    for i in range(x.size):
        values[i] = _whole_value(code, x[i], p)
        derivatives[i] = _whole_derivative(code, x[i], values[i], p)


def _constant_code_kernel(code):
    @njit(error_model="numpy")
    def kernel(x, p, values, derivatives):
        for i in range(x.size):
            values[i] = value_cpu(code, x[i], p)
            derivatives[i] = derivative_cpu(code, x[i], values[i], p)
    return kernel


@pytest.mark.parametrize("entry", TABLE, ids=lambda entry: entry.name)
def test_a_constant_code_computes_the_whole_function(entry):
    kernel = _constant_code_kernel(entry.code)
    for dtype, p in ((np.float64, 0.5), (np.float32, 3.0), (np.float32, 0.0)):
        x = POINTS.astype(dtype)
        got = np.empty_like(x), np.empty_like(x)
        expected = np.empty_like(x), np.empty_like(x)
        kernel(x, dtype(p), *got)
        _whole(entry.code, x, dtype(p), *expected)
        for name, mine, theirs in zip(("value", "derivative"), got, expected):
            np.testing.assert_array_equal(mine, theirs, err_msg=f"{entry.name} {name} "
                                          f"{np.dtype(dtype).name} p={p}")


@njit
def _runtime_code_value(code, x, p):
    return value_cpu(code, x, p)


def test_a_runtime_code_gets_the_whole_function():
    for entry in TABLE:
        assert _runtime_code_value(entry.code, 0.25, 0.5) == _whole_value(entry.code, 0.25, 0.5)


def test_a_first_compile_of_a_relu_convolution_prints_no_numba_ir_warning(tmp_path):
    """From an empty Numba cache, the CPU Conv2D with its fused relu compiles without Numba's
    NumbaIRAssumptionWarning (relu's returned conditional expression, inlined into the
    convolution's loops, left a phi its SSA check reported, asking the user to report it)."""
    assert_first_compile_is_quiet(
        "import numpy as np, engine\n"
        "from engine import nn\n"
        "layer = nn.Conv2D(2, 3, activation='relu')\n"
        "with engine.no_grad():\n"
        "    layer(engine.tensor(np.ones((1, 1, 5, 5), np.float32)))\n", tmp_path)
