"""LayerNorm: ``engine.layer_norm`` and ``nn.LayerNorm`` against NumPy and torch, through
``check_op``, with rows far from zero, fixed-order parameter gradients and a captured step."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from tests.support.op_check import Case, check_op
from tests.support.training_step import training_step


def _reference(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


CASES = [
    Case("layer_norm", ((3, 5), (5,), (5,)),
         lambda x, w, b: engine.layer_norm(x, 5, w, b),
         lambda x, w, b: _reference(x, (5,), w, b)),
    Case("layer_norm", ((2, 3, 7),), lambda x: engine.layer_norm(x, (7,), eps=0.1),
         lambda x: _reference(x, (7,), eps=0.1)),
    Case("layer_norm", ((2, 3, 2), (3, 2)),
         lambda x, w: engine.layer_norm(x, (3, 2), weight=w),
         lambda x, w: _reference(x, (3, 2), w)),
    Case("layer_norm", ((4, 3), (3,)), lambda x, b: engine.layer_norm(x, (3,), bias=b),
         lambda x, b: _reference(x, (3,), bias=b)),
    Case("layer_norm", ((5, 2), (2,), (2,)), lambda x, w, b: engine.layer_norm(x, 2, w, b),
         lambda x, w, b: _reference(x, (2,), w, b), grad=(False, True, True)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


@pytest.mark.torch
def test_matches_torch_forward_and_gradients():
    import torch
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((4, 6, 8)), rng.standard_normal(8), rng.standard_normal(8)
    g = rng.standard_normal((4, 6, 8))
    tensors = [engine.tensor(a, requires_grad=True) for a in (x, w, b)]
    out = engine.layer_norm(tensors[0], (8,), tensors[1], tensors[2], eps=1e-3)
    (out * engine.tensor(g)).sum().backward()
    expected = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    ref = torch.nn.functional.layer_norm(expected[0], (8,), expected[1], expected[2], eps=1e-3)
    (ref * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(tensors, expected):
        np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-10,
                                   atol=1e-12)


def test_rows_far_from_zero_keep_their_precision(device):
    """A row at 1e4 with unit spread: the shifted moments keep float32's own precision."""
    rng = np.random.default_rng(1)
    x = 1e4 + rng.standard_normal((3, 33))
    out = engine.layer_norm(engine.tensor(x, dtype=np.float32, device=device), 33).numpy()
    expected = _reference(x.astype(np.float32).astype(np.float64), (33,))
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-3)


def test_rows_longer_than_a_sum_block_match_float64():
    """The CPU sums a row in x's dtype over blocks of SUM_BLOCK elements, the blocks in
    float64: rows of 2.5 blocks, off zero, keep float32's precision in y and every gradient."""
    from ops.layer_norm_cpu import SUM_BLOCK
    rng = np.random.default_rng(3)
    n = SUM_BLOCK * 5 // 2
    x = (3.0 + rng.standard_normal((5, n))).astype(np.float32).astype(np.float64)
    w, b = (rng.standard_normal(n).astype(np.float32).astype(np.float64) for _ in range(2))
    g = rng.standard_normal((5, n)).astype(np.float32).astype(np.float64)
    tensors = [engine.tensor(a, dtype=np.float32, requires_grad=True) for a in (x, w, b)]
    out = engine.layer_norm(tensors[0], n, tensors[1], tensors[2])
    out.backward(engine.tensor(g, dtype=np.float32))
    exact = [engine.tensor(a, requires_grad=True) for a in (x, w, b)]
    expected = engine.layer_norm(exact[0], n, exact[1], exact[2])
    expected.backward(engine.tensor(g))
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=0, atol=2e-6)
    for mine, reference in zip(tensors, exact):
        scale = np.abs(reference.grad.numpy()).max()
        np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), rtol=0,
                                   atol=2e-6 * scale)


def _in_order(rows):
    """The rows added one after another in their dtype, as a chunk's partial sum is, then
    widened to float64 for the fold."""
    total = np.zeros_like(rows[0])
    for row in rows:
        total = total + row
    return total.astype(np.float64)


def test_parameter_gradients_repeat_bit_for_bit(device):
    """165 rows: six chunks of partial sums, folded in ops.layer_norm's lanes: the same bits
    every run; dbias (of g alone) the same bits on the CPU and CUDA too, and NumPy's: each
    chunk's rows added in order in float32, the six chunk sums then in float64 (exact,
    whatever the order; dweight reads each device's row statistics, whose sums run in each
    device's own fixed order)."""
    from ops.layer_norm import PARAM_CHUNK
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((165, 6)), rng.standard_normal((165, 6))
    g32 = g.astype(np.float32)
    chunk_sums = [_in_order(g32[c:c + PARAM_CHUNK]) for c in range(0, 165, PARAM_CHUNK)]
    expected_dbias = sum(chunk_sums[1:], chunk_sums[0]).astype(np.float32)
    results = []
    for where in (device, device, "cpu"):
        layer = nn.LayerNorm()
        inputs = engine.tensor(x, dtype=np.float32, device=where)
        layer.build((6,), where)
        layer(inputs).backward(engine.tensor(g, dtype=np.float32, device=where))
        results.append((layer.weight.grad.numpy(), layer.bias.grad.numpy()))
    assert results[0][0].tobytes() == results[1][0].tobytes()
    assert results[0][1].tobytes() == results[1][1].tobytes() == results[2][1].tobytes()
    assert results[0][1].tobytes() == expected_dbias.tobytes()
    np.testing.assert_allclose(results[0][0], results[2][0], rtol=1e-5, atol=1e-5)


def test_bad_shapes_name_the_op_and_the_shapes():
    x = engine.tensor(np.ones((2, 3)), dtype=np.float32)
    with pytest.raises(ValueError, match=r"layer_norm: normalized_shape \(4,\) must be the "
                                         r"trailing dims of the input, got input of shape "
                                         r"\(2, 3\)"):
        engine.layer_norm(x, 4)
    with pytest.raises(ValueError, match=r"layer_norm: weight of shape \(2,\) must have the "
                                         r"normalized_shape \(3,\)"):
        engine.layer_norm(x, 3, weight=engine.tensor(np.ones(2), dtype=np.float32))
    layer = nn.LayerNorm()
    layer(x)
    with pytest.raises(ValueError, match=r"built for 3 features on the last axis, got input "
                                         r"of shape \(2, 4\)"):
        layer(engine.tensor(np.ones((2, 4)), dtype=np.float32))
    with pytest.raises(ValueError, match="LayerNorm: eps must be a number > 0"):
        nn.LayerNorm(eps=0)


def test_captured_step_equals_eager(device):
    rng = np.random.default_rng(0)
    batches = [engine.tensor(rng.standard_normal((5, 3, 4)), dtype=np.float32, device=device)
               for _ in range(3)]
    results = []
    for captured in (False, True):
        engine.manual_seed(0)
        model = nn.Sequential([nn.LayerNorm(input_shape=(3, 4)), nn.Flatten(), nn.Dense(2)])
        model.to(device)
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = training_step(opt, lambda x: (model(x) ** 2).mean())
        step = engine.capture(step) if captured else step
        losses = [step(x).item() for x in batches * 2]
        results.append((losses, [np.array(v).tobytes() for v in model.state_dict().values()]))
    assert results[0] == results[1]
    assert step.replayed >= 3


def test_the_parameter_gradients_fold_in_lanes_on_both_devices(device):
    """17 chunks, lane 0 folding the first and the last: +1e20 in the first and -1e20 in
    the last cancel there, where added in chunk order they would swallow the chunks between:
    dbias is the lanes' order, modelled here, on the CPU and CUDA alike."""
    from ops.layer_norm import FOLD_LANES, PARAM_CHUNK
    rng = np.random.default_rng(5)
    rows = 17 * PARAM_CHUNK
    x = rng.standard_normal((rows, 2))
    g = rng.standard_normal((rows, 2))
    g[0], g[16 * PARAM_CHUNK] = 1e20, -1e20
    g = g.astype(np.float32)
    chunks = [_in_order(g[c:c + PARAM_CHUNK]) for c in range(0, rows, PARAM_CHUNK)]
    lanes = [np.zeros(2) for _ in range(FOLD_LANES)]
    for c, partial in enumerate(chunks):
        lanes[c % FOLD_LANES] = lanes[c % FOLD_LANES] + partial
    width = FOLD_LANES // 2
    while width:
        for lane in range(width):
            lanes[lane] = lanes[lane] + lanes[lane + width]
        width //= 2
    sequential = sum(chunks[1:], chunks[0])
    assert lanes[0].astype(np.float32).tobytes() != sequential.astype(np.float32).tobytes()
    for where in ("cpu", device):
        layer = nn.LayerNorm()
        layer.build((2,), where)
        layer(engine.tensor(x, dtype=np.float32, device=where)).backward(
            engine.tensor(g, dtype=np.float32, device=where))
        assert layer.bias.grad.numpy().tobytes() == lanes[0].astype(np.float32).tobytes()
