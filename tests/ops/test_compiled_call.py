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


def _halves(x, y, scale):
    """The block arguments of ``_scaled_add`` over ``x``, ``y`` cut in two."""
    table = np.zeros((3, 4))
    return lambda blocks: ([(x[a:b], y[a:b], table, scale, 0, False, 0) for a, b in blocks], ())


def test_kept_blocks_are_records_from_the_second_call_alike_until_one_differs():
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal(64).astype(np.float32), np.zeros(64, np.float32)
    blocks = [(0, 32), (32, 64)]
    kept = compiled_call.KeptBlocks()
    args = (x, y, 2.0)
    _scaled_add(*_halves(x, y.copy(), 2.0)(blocks)[0][0])   # compiles the overload
    first = kept.calls(_scaled_add, args, lambda repeated: blocks, _halves(x, y, 2.0))
    assert [function for function, _ in first] == [_scaled_add, _scaled_add]   # plain
    second = kept.calls(_scaled_add, args, lambda repeated: blocks, _halves(x, y, 2.0))
    assert all(type(function) is compiled_call.Kept for function, _ in second)
    assert kept.calls(_scaled_add, args, lambda repeated: blocks, None) is second
    run_calls(second)   # the kept records write what the plain calls write
    expected = np.zeros(64, np.float32)
    _scaled_add(x, expected, np.zeros((3, 4)), 2.0, 0, False, 0)
    np.testing.assert_array_equal(y, expected)
    # a scalar that differs, an array that is another object, other blocks: plain calls
    for other_args, other_blocks in [((x, y, 3.0), blocks), ((x.copy(), y, 2.0), blocks),
                                     (args, [(0, 16), (16, 64)])]:
        calls = kept.calls(_scaled_add, other_args, lambda repeated: other_blocks,
                           _halves(*other_args))
        assert all(function is _scaled_add for function, _ in calls)
    assert kept.calls(_scaled_add, args, lambda repeated: None, None) is None   # whole


def test_kept_blocks_hold_no_argument_alive():
    import gc
    import weakref
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    blocks = [(0, 32), (32, 64)]
    kept = compiled_call.KeptBlocks()
    for _ in range(2):
        kept.calls(_scaled_add, (x, y, 1.0), lambda repeated: blocks, _halves(x, y, 1.0))
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None
    repeated = []
    kept.calls(_scaled_add, (np.ones(64, np.float32), y, 1.0),
               lambda was: (repeated.append(was), blocks)[1], _halves(np.ones(64), y, 1.0))
    assert repeated == [False]


def test_a_kept_block_that_raised_raises_on_the_calling_thread():
    x = np.ones(3)
    _raises(x[:0])
    fields = compiled_call.record(_raises, (x,))
    with pytest.raises(RuntimeError, match="_raises: a block of a split raised"):
        compiled_call.Kept(fields, "_raises")()
    with pytest.raises(RuntimeError, match="_raises: a block a split's worker ran raised"):
        run_calls([(_raises, (x[:0],)), (compiled_call.Kept(fields, "_raises"), ())])
