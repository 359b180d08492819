"""Embedding: ``engine.embedding`` and ``nn.Embedding`` against NumPy and torch, its
deterministic backward (repeated ids, padding rows), bad ids, and a captured step."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from tests.support.op_check import Case, check_op
from tests.support.training_step import cross_entropy_step


def _ids_and_table(ids_shape, rows, dim, avoid=None):
    """Ids in [0, rows) and a table; with ``avoid`` (the padding row) the ids skip that row,
    whose gradient is zero by definition where a numeric gradient would see the row."""
    def make(rng):
        ids = rng.integers(0, rows - (avoid is not None), ids_shape)
        if avoid is not None:
            ids = ids + (ids >= avoid)
        return [ids, rng.uniform(-2, 2, (rows, dim))]
    return make


CASES = [
    Case("embedding", ((3, 4), (5, 3)), lambda ids, w: engine.embedding(ids, w),
         lambda ids, w: w[ids], make_inputs=_ids_and_table((3, 4), 5, 3)),
    Case("embedding", ((7,), (3, 9)), lambda ids, w: engine.embedding(ids, w, padding_idx=1),
         lambda ids, w: w[ids], make_inputs=_ids_and_table((7,), 3, 9, avoid=1)),
    Case("embedding", ((2, 1, 3), (4, 2)),
         lambda ids, w: engine.embedding(ids, w, padding_idx=-1),
         lambda ids, w: w[ids], make_inputs=_ids_and_table((2, 1, 3), 4, 2, avoid=3)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


def _grad(ids, weight, device, dtype=np.float64, padding_idx=None, seed=1):
    w = engine.tensor(weight, dtype=dtype, device=device, requires_grad=True)
    out = engine.embedding(engine.tensor(ids, device=device), w, padding_idx=padding_idx)
    g = np.random.default_rng(seed).standard_normal(out.shape)
    (out * engine.tensor(g, dtype=dtype, device=device)).sum().backward()
    return out.numpy(), w.grad.numpy()


@pytest.mark.torch
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_forward_and_gradient_match_torch(padding_idx):
    import torch
    rng = np.random.default_rng(3)
    ids, weight = rng.integers(0, 6, (4, 5)), rng.standard_normal((6, 3))
    out, grad = _grad(ids, weight, "cpu", padding_idx=padding_idx)
    w = torch.tensor(weight, requires_grad=True)
    expected = torch.nn.functional.embedding(torch.tensor(ids), w, padding_idx=padding_idx)
    g = np.random.default_rng(1).standard_normal(out.shape)
    (expected * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_repeated_ids_sum_their_rows_in_a_fixed_order(device):
    """Every id repeated many times: the float32 gradient is the float64 sum cast once,
    the same bits on every run and on both devices."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 3, 37)
    weight = rng.standard_normal((3, 5))
    g = np.random.default_rng(1).standard_normal((37, 5))
    _, first = _grad(ids, weight, device, np.float32)
    _, second = _grad(ids, weight, device, np.float32)
    expected = np.zeros((3, 5))
    np.add.at(expected, ids, g.astype(np.float32).astype(np.float64))
    assert first.tobytes() == second.tobytes()
    np.testing.assert_array_equal(first, expected.astype(np.float32))
    if device == "cuda":
        _, on_cpu = _grad(ids, weight, "cpu", np.float32)
        assert first.tobytes() == on_cpu.tobytes()


def test_buckets_of_every_size_give_the_cpu_bits(device):
    """Ids absent, once, a few times (the CUDA backward sorts those in shared memory) and
    many times (more than it sorts: it scans the ids instead), a padding row among them,
    and more columns than a block's tile: the float32 gradient is the CPU's, bit for bit."""
    ids = np.array([4, 1, 4, 0, 4, 2, 2, 4, 4, 1, 4, 4, 5, 2, 4, 1, 3, 3])
    weight = np.random.default_rng(2).standard_normal((7, 11))
    _, grad = _grad(ids, weight, device, np.float32, padding_idx=3)
    _, on_cpu = _grad(ids, weight, "cpu", np.float32, padding_idx=3)
    assert grad.tobytes() == on_cpu.tobytes()
    assert not grad[[3, 6]].any()   # the padding row, and an id that never occurs


@pytest.mark.cuda
def test_each_backward_launch_replayed_alone_stays_inside_its_arrays():
    """bench.gpu_step times every launch of a step replayed alone, several times: the
    counting sort's launches then see counts their own replays left (int32 sums that even
    overflow), and must still address nothing outside their arrays (on the H100 such a
    replay ended in CUDA_ERROR_ILLEGAL_ADDRESS)."""
    from ops import cuda as cuda_runtime
    from ops.launch import LaunchRecorder
    ids = np.array([4, 1, 4, 0, 4, 2, 2, 4, 4, 1, 4, 4, 5, 2, 4, 1, 3, 3])
    w = engine.tensor(np.ones((7, 3), np.float32), device="cuda", requires_grad=True)
    out = engine.embedding(engine.tensor(ids, device="cuda"), w)
    with LaunchRecorder() as recorder:
        out.backward(engine.tensor(np.ones((18, 3), np.float32), device="cuda"))
    launches = [r for r in recorder.runs if r.kernel.name == "embedding_grad"]
    assert len(launches) == 5
    for run in launches:
        for _ in range(3):
            cuda_runtime.launch(run.function, run.grid, run.block, run.args)
    cuda_runtime.cuda.synchronize()


@pytest.mark.gpu
def test_a_large_vocabulary_gives_the_cpu_bits():
    """GPT-2's vocabulary at nanoGPT's batch of ids, Zipf-distributed so that a few buckets
    outgrow the shared-memory sort: the bits of the CPU's gradient."""
    rng = np.random.default_rng(4)
    ids = np.minimum(rng.zipf(1.3, (64, 256)) - 1, 50303)
    weight = rng.standard_normal((50304, 40))
    _, grad = _grad(ids, weight, "cuda", np.float32)
    _, on_cpu = _grad(ids, weight, "cpu", np.float32)
    assert np.bincount(ids.ravel()).max() > 1024
    assert grad.tobytes() == on_cpu.tobytes()


@pytest.mark.parametrize("bad", [6, -1])
def test_a_bad_id_names_the_op_the_value_and_num_embeddings(device, bad):
    weight = engine.tensor(np.ones((6, 2)), device=device, requires_grad=True)
    ids = engine.tensor([0, 3, bad, 1], device=device)
    with pytest.raises(IndexError, match=rf"embedding: id {bad} at position 2 is out of "
                                         r"range for num_embeddings 6"):
        engine.embedding(ids, weight).numpy()
    with pytest.raises(IndexError, match=rf"id {bad} .*num_embeddings 6"):
        engine.embedding(np.array([bad]), weight)   # host ids: checked before any kernel


def test_a_single_id_gives_one_row():
    weight = engine.tensor(np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(engine.embedding(np.array(2), weight).numpy(), [4.0, 5.0])


def test_layer_shapes_padding_row_and_config():
    layer = nn.Embedding(10, 4, padding_idx=-2)
    out = layer(np.array([[1, 8], [8, 3]]))
    assert out.shape == (2, 2, 4) and layer.padding_idx == 8
    np.testing.assert_array_equal(layer.weight.numpy()[8], 0)
    out.sum().backward()
    np.testing.assert_array_equal(layer.weight.grad.numpy()[8], 0)
    np.testing.assert_array_equal(layer.weight.grad.numpy()[1], 1)
    assert layer.get_config() == {"num_embeddings": 10, "embedding_dim": 4, "padding_idx": 8}
    with pytest.raises(ValueError, match="Embedding: num_embeddings must be a positive int"):
        nn.Embedding(0, 4)
    with pytest.raises(ValueError, match=r"padding_idx 10 must be an int in \[-10, 10\)"):
        nn.Embedding(10, 4, padding_idx=10)


def _embedding_model(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Embedding(7, 3, input_shape=(4,)), nn.Flatten(), nn.Dense(5)])
    return model.to(device), optim.Adam(model.parameters(), lr=1e-2)


def test_captured_step_equals_eager_and_a_bad_id_changes_nothing(device):
    rng = np.random.default_rng(0)
    batches = [(engine.tensor(rng.integers(0, 7, (6, 4)), device=device),
                engine.tensor(rng.integers(0, 5, 6), device=device)) for _ in range(4)]
    results = []
    for captured in (False, True):
        model, opt = _embedding_model(device)
        step = cross_entropy_step(model, opt)
        step = engine.capture(step) if captured else step
        losses = [step(x, y).item() for x, y in batches * 2]
        results.append((losses, {k: np.array(v) for k, v in model.state_dict().items()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert value.tobytes() == results[1][1][name].tobytes(), name
    assert step.replayed >= 4
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    x, y = batches[0]
    bad = engine.tensor(np.where(np.arange(24).reshape(6, 4) == 5, 9, x.numpy()), device=device)
    with pytest.raises(IndexError, match="embedding: id 9 at position 5 .*num_embeddings 7"):
        step(bad, y).item()
    for name, value in model.state_dict().items():   # the replayed update was gated
        assert np.array(value).tobytes() == before[name].tobytes(), name
