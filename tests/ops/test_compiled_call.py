"""ops.compiled_call: an @njit kernel's call as a record a worker runs from compiled code."""
import numpy as np
import pytest
from numba import njit

from ops import compiled_call, cpu_pool
from ops.cpu_pool import run_calls


@njit(nogil=True, error_model="numpy")
def _scaled_add(x, y, table, scale, shift, negate, small):
    """y += scale x + shift (+ table's corner), every scalar kind a kernel takes."""
    sign = -1 if negate else 1
    for i in range(x.size):
        y[i] += sign * (scale * x[i] + shift) + table[1, 2] + small
    table[0, 0] += 1


@njit(nogil=True)
def _count_true(flags, out):
    for i in range(flags.size):
        out[0] += flags[i]


@njit(nogil=True)
def _returns(x):
    return x.sum()


@njit(nogil=True)
def _raises(x):
    if x.size:
        raise ValueError("raised in a block")


def _arguments(rng):
    x = rng.standard_normal(37).astype(np.float32)
    y = rng.standard_normal(37).astype(np.float32)
    table = np.asfortranarray(rng.standard_normal((3, 4)))   # 2-D, another layout
    return [(x[3:], y[3:], table, np.float32(2.5), 3, True, np.int8(-2)),
            (x[::2], y[::2], table, 0.75, np.int32(-4), False, np.uint16(9))]   # strided


@pytest.mark.parametrize("which", [0, 1])
def test_the_record_makes_the_python_call(which):
    expected = _arguments(np.random.default_rng(which))[which]
    got = _arguments(np.random.default_rng(which))[which]
    _scaled_add(*expected)   # compiles the overload the record calls
    fields = compiled_call.record(_scaled_add, got)
    assert fields is not None
    compiled_call.run(fields.ctypes.data)
    assert not compiled_call.failed(fields)
    for want, have in zip(expected, got):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(have, want)


def test_calls_it_cannot_make_run_from_python():
    x = np.ones(5, np.float32)
    assert compiled_call.record(lambda a: None, (x,)) is None   # not a dispatcher

    @njit(nogil=True)
    def fresh(a):
        a[0] = 1

    assert compiled_call.record(fresh, (x,)) is None   # no overload compiled yet
    fresh(x)
    assert compiled_call.record(fresh, (x,)) is not None
    _returns(x)
    assert compiled_call.record(_returns, (x,)) is None   # a result nobody would receive
    assert compiled_call.record(fresh, ((1, 2),)) is None   # a tuple: not an argument kind


def test_a_worker_runs_the_record_and_its_results_match_one_call():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(4001).astype(np.float32)
    whole = rng.standard_normal(4001).astype(np.float32)
    split = whole.copy()
    table = np.zeros((2, 3))
    _scaled_add(x, whole, table, np.float32(1.5), 2, False, 0.25)
    blocks = [(0, 1500), (1500, 2900), (2900, 4001)]
    run_calls([(_scaled_add, (x[a:b], split[a:b], table, np.float32(1.5), 2, False, 0.25))
               for a, b in blocks])
    np.testing.assert_array_equal(split, whole)
    worker = cpu_pool.workers(2)[0]
    assert worker.record is not None   # handed over as a compiled call, not a Python one


def test_a_kernel_that_raised_in_a_worker_raises_on_the_calling_thread():
    x = np.ones(3)
    _raises(x[:0])   # compiled; raises nothing on an empty array
    with pytest.raises(RuntimeError, match="_raises: a block a split's worker ran raised"):
        run_calls([(_raises, (x[:0],)), (_raises, (x,))])
    run_calls([(_raises, (x[:0],)), (_raises, (x[:0],))])   # the pool still works


def test_a_boolean_array_and_a_record_array():
    """Element types: a boolean array is described (its 1-byte elements), a structured one
    runs from Python."""
    flags = np.array([True, False, True, True])
    out = np.zeros(1, np.int64)
    _count_true(flags[1:], out)
    fields = compiled_call.record(_count_true, (flags[1:], out))
    compiled_call.run(fields.ctypes.data)
    assert out[0] == 4
    structured = np.zeros(3, dtype=[("a", np.float32), ("b", np.int16)])

    @njit(nogil=True)
    def touch(rows):
        rows[0].a = 1.0

    touch(structured)
    assert compiled_call.record(touch, (structured,)) is None
