"""The chunked (two-launch) CUDA reductions of ``ops.reduce`` and the lane-group softmax rows of
``ops.softmax``: against NumPy in float64, bit for bit against the documented fixed order, and
run to run.

The shapes are built from ``CHUNK_MIN`` and ``REDUCE_THREADS``, which the simulator shrinks
(8 threads a block there), so the same cases split into uneven chunks and lane groups with
tail rows in the simulator and on the GPU. On the CPU the same cases check the serial kernels.
"""
import numpy as np
import pytest

import engine
from ops.block_reduce import MAX, REDUCE_THREADS, SUM, group_reduce_cuda
from ops.cuda import cuda, multiprocessor_count
from ops.launch import LaunchRecorder
from ops.reduce import (BLOCKS_PER_MULTIPROCESSOR, CHUNK_MIN, THREAD_RUNS_MIN_OUTPUTS,
                        chunking)
from ops.softmax import LANE_ELEMENTS, row_group
from tests.support.op_check import Case, check_op

# one output over a whole array: 4 chunks (the simulator's 4 blocks; on the GPU 4 chunks of
# CHUNK_MIN or more), the last one shorter (75, 75, 75, 74 elements in the simulator)
WHOLE = (CHUNK_MIN // 5 + 1, 23)
# two outputs, each a contiguous run of 2 chunks (the last shorter)
TWO_ROWS = (2, 2 * CHUNK_MIN + 23)
# two outputs, each a run strided by 2 (a column): 2 chunks
TWO_COLUMNS = (2 * CHUNK_MIN + 21, 2)
# two outputs over two reduced dims (general index arithmetic): 2 chunks
TWO_OF_3D = (7, 2, 2 * CHUNK_MIN // 7 + 3)
CHUNKED = [(WHOLE, None), (TWO_ROWS, 1), (TWO_COLUMNS, 0), (TWO_OF_3D, (0, 2))]

# softmax rows: each shape's lane group, and rows that leave a block part empty
ROWS_OF_GROUP = {2: (5, 2 * LANE_ELEMENTS - 3), 4: (3, 4 * LANE_ELEMENTS - 3),
                 8: (3, 8 * LANE_ELEMENTS - 3)}
WIDE_ROWS = (2, 25 * REDUCE_THREADS + 3)   # a whole block per row, many elements a lane


def _np_log_softmax(a, axis=-1):
    shifted = a - a.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


# (op, shapes and axes): mean is the sum's kernel with a scale, so one shape covers it
CHUNKED_CALLS = ([(name, shape, axis) for name in ("sum", "max", "min") for shape, axis in CHUNKED]
                 + [("mean", WHOLE, None), ("argmax", WHOLE, None), ("argmin", WHOLE, None),
                    ("argmax", TWO_COLUMNS, 0), ("argmin", TWO_ROWS, 1)])

# check_op (gradcheck, CPU parity, poison) on one chunked reduction whose backward reads the
# chunked forward, and on softmax rows of 4 lanes with a half-empty block: ~5 s each in the
# simulator
CASES = [
    Case("max", (TWO_COLUMNS,), lambda a: a.max(axis=0), lambda a: a.max(axis=0),
         gradcheck_kwargs={"fast": True}),   # thousands of elements on the GPU-sized CPU run
    Case("log_softmax", (ROWS_OF_GROUP[4],), lambda x: x.log_softmax(), _np_log_softmax),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


def test_chunked_reductions_match_numpy_in_float64(device):
    """Every output and partial written (poison mode), the values NumPy's; on CUDA through the
    two-launch path."""
    rng = np.random.default_rng(0)
    for name, shape, axis in CHUNKED_CALLS:
        a = rng.standard_normal(shape)
        x = engine.tensor(a, device=device)
        with engine.debug.poison(), LaunchRecorder() as recorder:
            result = getattr(x, name)(axis=axis).numpy()
        launches = [run for run in recorder.runs if run.kernel.name != "fill"]
        if name.startswith("arg"):
            np.testing.assert_array_equal(result, getattr(np, name)(a, axis=axis), err_msg=name)
        else:
            np.testing.assert_allclose(result, getattr(a, name)(axis=axis), rtol=1e-12,
                                       atol=1e-12, err_msg=f"{name} {shape} axis={axis}")
        if device == "cuda":
            assert len(launches) == 2, (name, shape, axis, recorder.cuda_kernel_names())


@pytest.mark.cuda
def test_chunking_splits_runs_into_non_empty_chunks_of_at_least_chunk_min():
    target = BLOCKS_PER_MULTIPROCESSOR * multiprocessor_count()
    for outputs, n_reduced in [(1, 2 * CHUNK_MIN), (1, 37 * CHUNK_MIN + 5), (2, 3 * CHUNK_MIN - 1),
                               (3, 10 ** 6 + 7), (0, 5 * CHUNK_MIN)]:
        chunks, length = chunking(outputs, n_reduced)
        assert (chunks - 1) * length < n_reduced <= chunks * length, (outputs, n_reduced)
        assert length >= CHUNK_MIN, (outputs, n_reduced, length)
        if outputs:
            assert outputs * chunks < target + outputs, (outputs, n_reduced, chunks)
    # short runs and outputs that fill the GPU alone: one block per output, no second pass
    assert chunking(1, 2 * CHUNK_MIN - 1) == (1, 2 * CHUNK_MIN - 1)
    assert chunking(target, 100 * CHUNK_MIN)[0] == 1
    assert chunking(5, 0) == (1, 1)


@pytest.mark.cuda
def test_many_outputs_keep_one_block_per_output():
    outputs = BLOCKS_PER_MULTIPROCESSOR * multiprocessor_count()   # enough blocks alone
    a = np.random.default_rng(6).standard_normal((outputs, 2 * CHUNK_MIN))
    x = engine.tensor(a, device="cuda")
    with engine.debug.poison(False), LaunchRecorder() as recorder:
        result = x.sum(axis=1).numpy()
    assert recorder.cuda_kernel_names() == ["reduce_cuda"]
    np.testing.assert_allclose(result, a.sum(axis=1), rtol=1e-12)


def _block_fold(values, start):
    """What one block of REDUCE_THREADS threads makes of ``values``: thread t adds up
    values[t::REDUCE_THREADS] in order from ``start``, then the halving tree of
    ops.block_reduce."""
    partial = [start] * REDUCE_THREADS
    for t in range(REDUCE_THREADS):
        for value in values[t::REDUCE_THREADS]:
            partial[t] = partial[t] + float(value)
    return _halving_tree(partial, REDUCE_THREADS)[0]


@pytest.mark.cuda
def test_chunked_sum_is_the_documented_fixed_order_bit_for_bit():
    """The float32 whole-array sum and mean equal, bit for bit, the order the module
    describes: each chunk folded by one block in float64, the partials folded by one more."""
    a = np.random.default_rng(0).standard_normal(WHOLE).astype(np.float32).reshape(-1)
    chunks, length = chunking(1, a.size)
    partials = [_block_fold(a[c * length:(c + 1) * length], 0.0) for c in range(chunks)]
    total = _block_fold(partials, 0.0)
    x = engine.tensor(a.reshape(WHOLE), device="cuda")
    assert x.sum().numpy().tobytes() == np.float32(total).tobytes()
    assert x.mean().numpy().tobytes() == np.float32(total * (1.0 / a.size)).tobytes()


def test_reductions_and_softmax_rows_are_bit_reproducible(device):
    rng = np.random.default_rng(1)
    a = engine.tensor(rng.standard_normal(WHOLE).astype(np.float32), device=device)
    rows = engine.tensor(rng.standard_normal(WIDE_ROWS).astype(np.float32), device=device,
                         requires_grad=True)
    grad = engine.tensor(rng.standard_normal(WIDE_ROWS).astype(np.float32), device=device)

    def results():
        rows.grad = None
        y = rows.log_softmax()
        y.backward(grad)
        return [a.sum().numpy(), a.max(axis=0).numpy(), a.argmin().numpy(), y.numpy(),
                rows.grad.numpy()]

    first, second = results(), results()
    for k, (one, two) in enumerate(zip(first, second)):
        assert one.tobytes() == two.tobytes(), f"result {k} differs between two runs"


def test_nan_in_one_chunk_reaches_the_result(device):
    a = np.random.default_rng(2).standard_normal(WHOLE)
    a.flat[a.size // 2] = np.nan   # in a middle chunk
    a.flat[a.size - 3] = np.nan   # in the last chunk: argmax keeps the first
    x = engine.tensor(a, device=device)
    for name in ("sum", "max", "min"):
        assert np.isnan(getattr(x, name)().item()), name
    assert x.argmax().item() == a.size // 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wide_softmax_rows_keep_huge_tied_logits_normalised(device, dtype):
    n = WIDE_ROWS[1]
    logits = np.zeros((2, n))
    logits[0, [1, n - 2]] = 1e17          # two tied maxima at the ends of the row
    logits[1, :] = -1e17
    logits[1, [0, n // 2]] = 5.0
    x = engine.tensor(logits, dtype=dtype, device=device)
    expected = np.zeros((2, n))
    expected[0, [1, n - 2]] = 0.5
    expected[1, [0, n // 2]] = 0.5
    np.testing.assert_allclose(np.exp(x.log_softmax().numpy().astype(np.float64)), expected,
                               atol=1e-6)
    np.testing.assert_allclose(x.softmax().numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("shape", list(ROWS_OF_GROUP.values()) + [WIDE_ROWS], ids=str)
def test_softmax_rows_in_lane_groups_match_numpy_forward_and_backward(shape, device):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(shape) * 3
    g = rng.standard_normal(shape)
    log_p = _np_log_softmax(a)
    p = np.exp(log_p)
    expected = {False: (p, p * (g - (g * p).sum(axis=-1, keepdims=True))),
                True: (log_p, g - p * g.sum(axis=-1, keepdims=True))}
    for log, (y_ref, grad_ref) in expected.items():
        x = engine.tensor(a, device=device, requires_grad=True)
        with engine.debug.poison():
            y = x.log_softmax() if log else x.softmax()
            y.backward(engine.tensor(g, device=device))
        np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-12, atol=1e-15, err_msg=str(log))
        np.testing.assert_allclose(x.grad.numpy(), grad_ref, rtol=1e-10, atol=1e-13,
                                   err_msg=str(log))


def test_softmax_row_groups_fit_the_rows():
    assert row_group(10, 1) == 2 and row_group(LANE_ELEMENTS, 1) == 1
    assert row_group(1000, 1) == min(128, REDUCE_THREADS)
    assert row_group(10 ** 6, 1) == REDUCE_THREADS
    assert row_group(1000, 7) == 1   # strided rows: a thread per row reads neighbouring rows
    for n in (1, 3, 17, 255, 4097):
        group = row_group(n, 1)
        assert group & (group - 1) == 0 and REDUCE_THREADS % group == 0
        assert group == REDUCE_THREADS or group * LANE_ELEMENTS >= n


# ------------------------------------------------------------------ the real GPU, large shapes

@pytest.mark.gpu
@pytest.mark.parametrize("shape, axis", [((1024, 1024), None), (((1 << 22) + 3,), None),
                                         ((100003, 3), 0), ((9, 33, 2049), (0, 2)),
                                         ((4099, 1000), 0), ((4099, 1000), 1)], ids=str)
def test_gpu_large_reductions_match_numpy_in_float64_and_repeat_bit_for_bit(shape, axis):
    a = np.random.default_rng(3).standard_normal(shape)
    x = engine.tensor(a, device="cuda")
    for name in ("sum", "mean", "max", "min"):
        first = getattr(x, name)(axis=axis).numpy()
        np.testing.assert_allclose(first, getattr(a, name)(axis=axis), rtol=1e-12, atol=1e-9,
                                   err_msg=name)
        assert first.tobytes() == getattr(x, name)(axis=axis).numpy().tobytes(), name
    if not isinstance(axis, tuple):
        np.testing.assert_array_equal(x.argmax(axis=axis).numpy(), a.argmax(axis=axis))
        np.testing.assert_array_equal(x.argmin(axis=axis).numpy(), a.argmin(axis=axis))


@pytest.mark.gpu
@pytest.mark.torch
def test_gpu_float32_reductions_match_torch():
    import torch
    a = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    x, t = engine.tensor(a, device="cuda"), torch.from_numpy(a).cuda()
    np.testing.assert_allclose(x.sum().item(), t.double().sum().item(), rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(x.mean(axis=0).numpy(), t.mean(dim=0).cpu().numpy(),
                               rtol=1e-5, atol=1e-6)
    assert x.max().item() == t.max().item() and x.min().item() == t.min().item()
    assert x.argmax().item() == t.argmax().item()


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.parametrize("shape", [(4096, 1000), (128, 10), (7, 70000)], ids=str)
def test_gpu_softmax_rows_match_torch(shape):
    import torch
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(shape) * 5).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    for log in (False, True):
        x = engine.tensor(a, device="cuda", requires_grad=True)
        y = x.log_softmax() if log else x.softmax()
        y.backward(engine.tensor(g, device="cuda"))
        again = x.log_softmax() if log else x.softmax()
        assert y.numpy().tobytes() == again.numpy().tobytes(), "two runs differ"
        t = torch.from_numpy(a).cuda().requires_grad_()
        ty = torch.log_softmax(t, dim=-1) if log else torch.softmax(t, dim=-1)
        ty.backward(torch.from_numpy(g).cuda())
        np.testing.assert_allclose(y.numpy(), ty.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
        # dx = y * (g - sum(g * y)) cancels: float32 roundings of two different orders differ
        # by a few ulp of the O(1) terms (2.6e-6 at one of 4M elements on the H200)
        np.testing.assert_allclose(x.grad.numpy(), t.grad.cpu().numpy(), rtol=1e-4, atol=1e-5)


def _halving_tree(values, group):
    """Each aligned group's total as ops.block_reduce's tree adds it: round by round lane l
    takes lane l + step's value, step halving from group / 2."""
    values = [float(v) for v in values]
    totals = []
    for first in range(0, len(values), group):
        lanes = values[first:first + group]
        step = group // 2
        while step:
            for lane in range(step):
                lanes[lane] = lanes[lane] + lanes[lane + step]
            step //= 2
        totals += [lanes[0]] * group
    return np.array(totals)


@cuda.jit
def _group_totals(values, code, group, out):
    t = cuda.threadIdx.x
    out[t] = group_reduce_cuda(code, values[t], group)


@pytest.mark.cuda
def test_group_reduce_is_the_halving_tree_bit_for_bit_at_every_group_size():
    """On a GPU the rounds inside a warp are shuffles, in the simulator shared-array rounds:
    both the same pairs in the same order, float32 inputs summed in float64, every thread
    given its group's total; MAX as NumPy's, NaN winning."""
    rng = np.random.default_rng(11)
    values = (rng.standard_normal(REDUCE_THREADS)
              * 10.0 ** rng.integers(-7, 8, REDUCE_THREADS)).astype(np.float32)
    values[3] = np.nan   # in the first group of every size but 1, 2 and 4 (max)
    group = 1
    while group <= REDUCE_THREADS:
        for code in (SUM, MAX):
            out = cuda.device_array(REDUCE_THREADS, np.float64)
            _group_totals[1, REDUCE_THREADS](cuda.to_device(values), code, group, out)
            if code == SUM:
                expected = _halving_tree(values, group)
            else:
                groups = values.astype(np.float64).reshape(-1, group)
                expected = np.repeat(np.where(np.isnan(groups).any(axis=1), np.nan,
                                              np.where(np.isnan(groups), -np.inf,
                                                       groups).max(axis=1)), group)
            assert out.copy_to_host().tobytes() == expected.tobytes(), (code, group)
        group *= 2


@pytest.mark.cuda
def test_many_short_runs_take_a_thread_each_with_the_cpus_bits():
    """Many outputs over short runs (a sum over a leading axis, or over two dims around the
    kept one) fold a run a thread, in order: the CPU kernel's bits, and NaN where it has NaN
    (not its payload: on the H200 the min of a column holding NaN came out as a NaN of
    another payload than the CPU's)."""
    rng = np.random.default_rng(12)
    cases = [((7, THREAD_RUNS_MIN_OUTPUTS + 5), 0),
             ((5, THREAD_RUNS_MIN_OUTPUTS + 3, 3), (0, 2))]
    for shape, axis in cases:
        a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)).astype(np.float32)
        a[(2, 1) if len(shape) == 2 else (2, 1, 1)] = np.nan
        for name in ("sum", "mean", "max", "min"):
            expected = getattr(engine.tensor(a), name)(axis=axis).numpy()
            with engine.debug.poison(), LaunchRecorder() as recorder:
                result = getattr(engine.tensor(a, device="cuda"), name)(axis=axis).numpy()
            names = [n for n in recorder.cuda_kernel_names() if n != "fill_cuda"]   # poison
            assert names == ["reduce_runs_cuda"], (shape, name)
            nan = np.isnan(expected)
            assert np.array_equal(np.isnan(result), nan), (shape, axis, name)
            assert result[~nan].tobytes() == expected[~nan].tobytes(), (shape, axis, name)


def test_cpu_sums_over_leading_axes_fold_each_run_in_order():
    """On the CPU a reduction whose runs stride across the outputs (a leading axis, or an
    inner one with kept dims on both sides) takes the runs' r-th elements together: each
    output still folds its run in order from 0 in float64, so the bits are a loop over the
    reduced rows (sum, mean, max and min, NaN kept)."""
    rng = np.random.default_rng(13)
    for shape, axis in (((7, 33), 0), ((5, 4, 9), 0), ((3, 6, 5), 1), ((4, 3, 2, 5), (0, 1))):
        a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)).astype(np.float32)
        a.flat[7] = np.nan
        rows = np.moveaxis(a, axis if isinstance(axis, tuple) else (axis,),
                           tuple(range(len(axis) if isinstance(axis, tuple) else 1)))
        rows = rows.reshape(-1, *rows.shape[len(axis) if isinstance(axis, tuple) else 1:])
        for name, fold, sign, start in (("sum", np.add, 1.0, 0.0), ("mean", np.add, 1.0, 0.0),
                                        ("max", np.maximum, 1.0, -np.inf),
                                        ("min", np.maximum, -1.0, -np.inf)):
            total = np.full(rows.shape[1:], start)
            for row in rows:
                total = fold(total, sign * row.astype(np.float64))
            scale = 1.0 / rows.shape[0] if name == "mean" else 1.0
            expected = (sign * total * scale).astype(np.float32)
            result = getattr(engine.tensor(a), name)(axis=axis).numpy()
            nan = np.isnan(expected)
            assert np.array_equal(np.isnan(result), nan), (shape, axis, name)
            assert result[~nan].tobytes() == expected[~nan].tobytes(), (shape, axis, name)
