"""The CPU kernels that split a large GEMM across the engine's threads (ops.cpu_threads) give
the same bits on 1 and 2 threads: a row block of the output is the same dot products summed
in the same order. So do the optimizers' updates split in blocks of their elements, and a
whole captured MLP training run."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from ops import cpu_threads
from ops.cpu_threads import (ELEMENT_ALIGN, MIN_BLOCK_MACS, SPLIT_MIN_ELEMENTS, SPLIT_MIN_MACS,
                             element_blocks, row_blocks)
from engine.parameter import FlatBuffer, Parameter
from ops.dense import DENSE
from ops.matmul import gemm
from ops.pointwise import ACTIVATIONS
from tests.support.training_step import cross_entropy_step

THREAD_COUNTS = (1, 2)


@pytest.fixture(autouse=True)
def follow_the_load_after():
    yield
    cpu_threads.set_threads(None)


def on_each_thread_count(compute, rows, macs):
    """``compute()``'s arrays at 1 and at 2 threads; at 2 a GEMM of ``rows`` output rows
    and ``macs`` multiply-adds really is split."""
    results = []
    for threads in THREAD_COUNTS:
        engine.set_num_threads(threads)
        assert engine.get_num_threads() == threads
        assert len(row_blocks(rows, macs) or [()]) == threads
        results.append([np.array(a, copy=True) for a in compute()])
    return results


def assert_same_bits(results):
    one, two = results
    for a, b in zip(one, two):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def _dense_step(batch, features, units, activation):
    """Random x, W, b and grad_out, and a function of them: a Dense layer's CPU forward and
    backward (every gradient), returning ``(out, grad_x, grad_w, grad_b)``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, features), np.float32)
    w = rng.standard_normal((features, units), np.float32) * np.float32(0.05)
    b = rng.standard_normal(units, np.float32)
    grad_out = rng.standard_normal((batch, units), np.float32)
    forward, backward = DENSE[ACTIVATIONS[activation]]
    alpha = np.float32(0.01)

    def compute():
        out = np.empty((batch, units), np.float32)
        forward.cpu(x, w, b, out, alpha)
        grad_x = np.empty_like(x)
        grad_w, grad_b = np.empty_like(w), np.empty_like(b)
        backward.cpu(x, w, out, grad_out, grad_x, grad_w, grad_b, alpha, True, True)
        return out, grad_x, grad_w, grad_b
    return x, w, b, grad_out, compute


# the MLP's first layer, and odd shapes whose blocks are uneven and not a multiple of 16
@pytest.mark.parametrize("batch, features, units, activation", [
    (128, 784, 256, "relu"), (100, 301, 290, "tanh"), (67, 1001, 131, None)])
def test_dense_forward_and_backward_are_the_same_bits_on_1_and_2_threads(
        batch, features, units, activation):
    macs = batch * features * units
    assert macs >= SPLIT_MIN_MACS   # big enough to be split
    x, w, b, grad_out, compute = _dense_step(batch, features, units, activation)
    results = on_each_thread_count(compute, batch, macs)
    assert len(row_blocks(features, macs)) == 2   # dW's blocks too
    assert_same_bits(results)
    out, grad_x, grad_w, grad_b = results[1]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    pre = x64 @ w64 + b
    expected = {"relu": np.maximum(pre, 0), "tanh": np.tanh(pre), None: pre}[activation]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    g = grad_out * {"relu": expected > 0, "tanh": 1 - out.astype(np.float64) ** 2,
                    None: 1.0}[activation]
    np.testing.assert_allclose(grad_x, g @ w64.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grad_w, x64.T @ g, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grad_b, g.sum(0), rtol=1e-4, atol=1e-3)


def test_the_mlp_s_first_layer_is_the_same_bits_in_the_capped_blocks_of_16_threads():
    macs = 128 * 784 * 256
    *_, compute = _dense_step(128, 784, 256, "relu")
    results = []
    for threads in (1, 16):   # more threads than this machine's cores: the split is the same
        engine.set_num_threads(threads)
        results.append([np.array(a, copy=True) for a in compute()])
    assert len(row_blocks(128, macs)) == 4 and len(row_blocks(784, macs)) == 12
    assert_same_bits(results)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False)])
def test_gemm_is_the_same_bits_on_1_and_2_threads(trans_a, trans_b):
    m, k, n = 97, 701, 130   # uneven row blocks
    rng = np.random.default_rng(1)
    a = rng.standard_normal((k, m) if trans_a else (m, k), np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), np.float32)
    results = on_each_thread_count(lambda: [gemm(a, b, trans_a, trans_b)], m, m * n * k)
    assert_same_bits(results)
    a64 = a.T.astype(np.float64) if trans_a else a.astype(np.float64)
    b64 = b.T.astype(np.float64) if trans_b else b.astype(np.float64)
    np.testing.assert_allclose(results[1][0], a64 @ b64, rtol=1e-4, atol=1e-3)


def test_a_captured_mlp_trains_to_the_same_bits_on_1_and_2_threads():
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((5, 128, 784)).astype(np.float32)
    ys = rng.integers(0, 10, (5, 128)).astype(np.int64)

    def compute():
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(256, activation="relu", input_shape=(784,)),
                               nn.Dense(128, activation="relu"), nn.Dense(10)])
        optimizer = optim.Adam(model.parameters(), lr=1e-3)
        step = engine.capture(cross_entropy_step(model, optimizer))
        losses = [step(engine.tensor(x), engine.tensor(y)).numpy() for x, y in zip(xs, ys)]
        assert step.eager_reason is None and step.recordings
        return losses + [p.numpy() for p in model.parameters()]

    assert_same_bits(on_each_thread_count(compute, 128, 128 * 784 * 256))


# 135,487 elements in one flat buffer: two blocks at 2 threads, the second not on a 64 edge
ELEMENT_SHAPES = [(301, 450), (37,)]


@pytest.mark.parametrize("make_optimizer", [
    lambda p: optim.Adam(p, lr=1e-2, weight_decay=1e-3),
    lambda p: optim.AdamW(p, lr=1e-2),
    lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda p: optim.RMSprop(p, lr=1e-2, momentum=0.5),
    lambda p: optim.Adagrad(p, lr=0.1)], ids=["adam", "adamw", "sgd", "rmsprop", "adagrad"])
def test_an_optimizer_s_update_is_the_same_bits_on_1_and_2_threads(make_optimizer):
    rng = np.random.default_rng(5)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in ELEMENT_SHAPES]
    grads = [[rng.standard_normal(shape).astype(np.float32) for shape in ELEMENT_SHAPES]
             for _ in range(3)]
    grads[1][0][7, 3] = np.nan   # a step skipped on every block alike
    size = sum(v.size for v in values)

    def compute():
        params = [Parameter(engine.tensor(v.copy())) for v in values]
        FlatBuffer(params)
        optimizer = make_optimizer(params)
        optimizer.skip_nonfinite = True
        for step in grads:
            for p, g in zip(params, step):
                p.grad = engine.tensor(g)
            if np.isnan(step[0]).any():
                with pytest.warns(RuntimeWarning):
                    optimizer.step()
            else:
                optimizer.step()
        assert optimizer.skipped_steps == 1
        state = optimizer.state_dict()["state"]
        return [p.numpy() for p in params] + [value for saved in state.values()
                                               for value in saved.values()
                                               if isinstance(value, np.ndarray)]

    results = []
    for threads in THREAD_COUNTS:
        engine.set_num_threads(threads)
        assert len(element_blocks(size) or [()]) == threads
        results.append([np.array(a, copy=True) for a in compute()])
    assert_same_bits(results)
    assert not np.array_equal(results[0][0], values[0])   # the updates really ran


def test_element_blocks_are_even_on_64_element_edges_and_small_kernels_run_whole():
    engine.set_num_threads(2)
    assert element_blocks(SPLIT_MIN_ELEMENTS - 1) is None
    assert element_blocks(235_146) == [(0, 117_568), (117_568, 235_146)]
    assert 117_568 % ELEMENT_ALIGN == 0
    engine.set_num_threads(16)   # capped at a block per 64k elements
    assert len(element_blocks(235_146)) == 3
    engine.set_num_threads(1)
    assert element_blocks(1 << 30) is None


def test_small_gemms_and_one_thread_run_unsplit_and_blocks_cover_the_rows():
    engine.set_num_threads(2)
    assert row_blocks(128, SPLIT_MIN_MACS - 1) is None
    assert row_blocks(63, SPLIT_MIN_MACS) is None   # blocks of at least 32 rows
    assert row_blocks(128, SPLIT_MIN_MACS) == [(0, 64), (64, 128)]
    assert row_blocks(784, SPLIT_MIN_MACS) == [(0, 384), (384, 784)]   # on 16-row edges
    engine.set_num_threads(3)
    assert row_blocks(100, 3 * MIN_BLOCK_MACS) == [(0, 32), (32, 64), (64, 100)]
    engine.set_num_threads(1)
    assert row_blocks(128, 1 << 40) is None


@pytest.mark.parametrize("rows, macs, blocks", [
    (128, 128 * 784 * 256, 4),   # the MLP's first layer on 16 threads: 32 rows a block
    (784, 784 * 256 * 128, 12),   # its dW: 25.7M multiply-adds, 12 blocks of 2M or more
    (128, 128 * 256 * 128, 2),   # its 4.2M second layer: two blocks
    (128, 128 * 128 * 128, 1),   # 2.1M: whole
    (4096, 4096 * 4096 * 4096, 16),   # a large GEMM: one block per thread
    (784, 3 * MIN_BLOCK_MACS - 1, 2)])
def test_the_blocks_of_a_split_are_capped_by_the_work_per_block(rows, macs, blocks):
    engine.set_num_threads(16)
    split = row_blocks(rows, macs) or [(0, rows)]
    assert len(split) == blocks and macs // len(split) >= MIN_BLOCK_MACS
    assert split[0][0] == 0 and split[-1][1] == rows
    assert all(stop == start for (_, stop), (start, _) in zip(split, split[1:]))


def test_an_error_in_a_worker_s_block_reaches_the_caller():
    def fails():
        raise ValueError("block 2")

    with pytest.raises(ValueError, match="block 2"):
        cpu_threads.run_blocks([(lambda: None, ()), (fails, ())])


def test_a_forked_child_splits_on_a_pool_of_its_own():
    import os
    import select
    import signal
    engine.set_num_threads(2)
    a = np.ones((128, 784), np.float32)
    b = np.ones((784, 256), np.float32)
    gemm(a, b)   # the parent's pool exists now
    read, write = os.pipe()
    child = os.fork()
    if child == 0:   # the child: the same split must run, not wait on the parent's threads
        try:
            ok = bool(np.all(gemm(a, b) == 784))
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        answered, _, _ = select.select([read], [], [], 60)
        if not answered:
            os.kill(child, signal.SIGKILL)
        assert answered and os.read(read, 1) == b"1", "the child's split hung or failed"
    finally:
        os.waitpid(child, 0)
        os.close(read)


def test_a_large_unary_op_and_its_gradient_are_the_same_bits_on_1_and_2_threads():
    """The exact GELU over 300k elements runs in blocks on 2 threads (ops.elementwise)."""
    from ops.cpu_threads import element_blocks
    x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    results = []
    for threads in THREAD_COUNTS:
        engine.set_num_threads(threads)
        assert len(element_blocks(x.size) or [()]) == threads
        t = engine.tensor(x, requires_grad=True)
        y = engine.gelu(t)
        y.backward(engine.tensor(np.ones_like(x)))
        results.append([y.numpy().copy(), t.grad.numpy().copy()])
    assert_same_bits(results)


def test_layer_norm_and_its_gradients_are_the_same_bits_on_1_and_2_threads(monkeypatch):
    """LayerNorm over 6001 rows of 96 (not whole chunks of rows): once their pace is measured
    (ops.kernel_pace), its forward and its backward's chunk loop run in blocks of rows on 2
    threads (ops.layer_norm_cpu), the same bits as whole on one."""
    from ops import kernel_pace, layer_norm_cpu
    splits = []
    run_blocks = layer_norm_cpu.run_blocks
    monkeypatch.setattr(layer_norm_cpu, "run_blocks", lambda calls: (
        splits.append((calls[0][0].__name__, len(calls))), run_blocks(calls)))
    rng = np.random.default_rng(1)
    rows, n = 6001, 96
    x, g = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    weight, bias = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    results = []
    for threads in THREAD_COUNTS:
        engine.set_num_threads(threads)
        for _ in range(kernel_pace.TIMED_CALLS + 2):   # past the timed whole calls
            splits.clear()
            tensors = [engine.tensor(a, requires_grad=True) for a in (x, weight, bias)]
            y = engine.layer_norm(tensors[0], (n,), tensors[1], tensors[2])
            y.backward(engine.tensor(g))
        assert splits == ([] if threads == 1 else
                          [("layer_norm_cpu", 2), ("layer_norm_chunks_cpu", 2)])
        results.append([y.numpy().copy()] + [t.grad.numpy().copy() for t in tensors])
    assert_same_bits(results)


def test_pools_and_batch_norm_are_the_same_bits_in_blocks_on_1_and_2_threads(monkeypatch):
    """The pools' planes and BatchNorm's channels run in blocks on 2 threads
    (ops.cpu_threads.in_blocks): each of the six kernels splits, and every result and
    gradient is the same bits as on one thread."""
    splits = []
    run_blocks = cpu_threads.run_blocks
    monkeypatch.setattr(cpu_threads, "run_blocks",
                        lambda calls: (splits.append(calls[0][0].__name__), run_blocks(calls)))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 16, 64, 63)).astype(np.float32)
    results = []
    for threads in THREAD_COUNTS:
        splits.clear()
        engine.set_num_threads(threads)
        t = engine.tensor(x, requires_grad=True)
        weight, bias = (engine.tensor(np.full(16, v, np.float32), requires_grad=True)
                        for v in (1.5, 0.25))
        y = engine.batch_norm(t, engine.zeros(16), engine.ones(16), weight, bias,
                              training=True)
        y = engine.max_pool2d(y, 3, 2, 1) + engine.avg_pool2d(y, 3, 2, 1)
        (y * y).sum().backward()
        results.append([y.numpy().copy()] + [a.grad.numpy().copy() for a in (t, weight, bias)])
        assert len(splits) == (6 if threads == 2 else 0), splits
    assert_same_bits(results)
