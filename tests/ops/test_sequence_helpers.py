"""The helpers a transformer's code reaches for, against NumPy (``check_op``) and torch:
tril/triu, masked_fill, split/chunk, transpose/permute of any rank, max/min over a dim as
(values, indices), maximum/minimum, topk and multinomial."""
import numpy as np
import pytest

import engine
from tests.support.op_check import Case, check_op


def _distinct(shape):
    """Values with no ties (a numeric gradient at a tie of max or topk is undefined)."""
    def make(rng):
        return [rng.permutation(np.prod(shape)).reshape(shape) * 0.37 - 2.0]
    return make


def _one_hot_rows(rows, n, hot):
    def make(rng):
        probs = rng.uniform(0.1, 1.0, (rows, n))
        probs[np.arange(n)[None, :] != np.array(hot)[:, None]] = 0
        return [probs]
    return make


def _pairs_and_rest(rng):
    probs = np.zeros((3, 5))
    probs[0, [1, 4]] = [0.3, 0.7]
    probs[1, [0, 2]] = [2.0, 1.0]
    probs[2, [3, 4]] = [0.5, 0.5]
    return [probs]


def _picked(p, samples, seed):
    """The weights of the categories drawn: which ones are drawn does not depend on the
    seed where each row has as many positive weights as draws. The draw reads the weights
    clipped at 0, so gradcheck's nudges of the zeros stay valid weights."""
    drawn = engine.multinomial(engine.maximum(p, 0.0), samples, seed=seed)
    return p[np.arange(p.shape[0])[:, None], drawn.numpy()]


CASES = [
    Case("triangle", ((2, 3, 5),), lambda x: engine.tril(x), lambda x: np.tril(x)),
    Case("triangle", ((4, 3),), lambda x: x.triu(1), lambda x: np.triu(x, 1)),
    Case("triangle", ((3, 4),), lambda x: engine.tril(x, -1), lambda x: np.tril(x, -1)),
    Case("maximum", ((3, 5), (3, 5)), engine.maximum, np.maximum),
    Case("maximum", ((2, 1, 3), (4, 1)), engine.maximum, np.maximum),
    Case("minimum", ((3, 5), (5,)), engine.minimum, np.minimum),
    Case("topk", ((3, 7),), lambda x: engine.topk(x, 3).values,
         lambda x: -np.sort(-x, axis=-1)[:, :3], make_inputs=_distinct((3, 7))),
    Case("topk", ((2, 5, 3),), lambda x: x.topk(2, dim=1, largest=False).values,
         lambda x: np.sort(x, axis=1)[:, :2], make_inputs=_distinct((2, 5, 3))),
    Case("take_along_rows", ((4, 5),), lambda x: x.max(1).values, lambda x: x.max(axis=1),
         make_inputs=_distinct((4, 5))),
    Case("take_along_rows", ((3, 2, 4),), lambda x: x.min(dim=0, keepdim=True)[0],
         lambda x: x.min(axis=0, keepdims=True), make_inputs=_distinct((3, 2, 4))),
    Case("multinomial", ((3, 4),), lambda p: _picked(p, 1, seed=3),
         lambda p: p.max(axis=1, keepdims=True), make_inputs=_one_hot_rows(3, 4, [2, 0, 3])),
    Case("multinomial", ((3, 5),), lambda p: _picked(p, 2, seed=1).sum(1),
         lambda p: p.sum(axis=1), make_inputs=_pairs_and_rest),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


def _torch_and_engine(x):
    import torch
    return torch.tensor(x, requires_grad=True), engine.tensor(x, requires_grad=True)


def _same_forward_and_grad(ours, theirs, a, b, seed=0):
    g = np.random.default_rng(seed).standard_normal(tuple(theirs.shape))
    import torch
    (theirs * torch.tensor(g)).sum().backward()
    (ours * engine.tensor(g)).sum().backward()
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-12)


@pytest.mark.torch
def test_masks_and_pieces_match_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 5))
    for build in (lambda t: t.tril(), lambda t: t.triu(-2), lambda t: t.tril(3),
                  lambda t: t.transpose(1, 3), lambda t: t.permute(2, 0, 3, 1),
                  lambda t: t.masked_fill(t > 0.3, -7.5)):
        theirs, ours = _torch_and_engine(x)
        _same_forward_and_grad(build(ours), build(theirs), ours, theirs)
    for pieces in (lambda t: t.split(2, dim=2), lambda t: t.split([1, 4], dim=-1),
                   lambda t: t.chunk(3, dim=2), lambda t: t.chunk(4, dim=-1)):
        theirs, ours = _torch_and_engine(x)
        mine, reference = pieces(ours), pieces(theirs)
        assert [p.shape for p in mine] == [tuple(p.shape) for p in reference]
        _same_forward_and_grad(engine.cat([p * (k + 1) for k, p in enumerate(mine)], dim=-2
                                          if len(mine) and mine[0].shape[-1] == 5 else -1),
                               __import__("torch").cat([p * (k + 1) for k, p in
                                                        enumerate(reference)],
                                                       dim=-2 if reference[0].shape[-1] == 5
                                                       else -1), ours, theirs)


@pytest.mark.torch
def test_extrema_match_torch_with_ties_and_nan():
    import torch
    x = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 0.5, 2.0], [0.0, np.nan, 1.0, 4.0]])
    t = torch.tensor(x)
    e = engine.tensor(x)
    for dim in (0, 1, -1):
        for name in ("max", "min"):
            ours, theirs = getattr(e, name)(dim), getattr(t, name)(dim)
            np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())
            np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
    for largest in (True, False):
        ours, theirs = e.topk(3, largest=largest), t.topk(3, largest=largest)
        np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())
        # torch leaves the order of tied positions open; ours: the lower position first
        np.testing.assert_array_equal(np.take_along_axis(x, ours.indices.numpy(), 1),
                                      ours.values.numpy())
        assert ours.indices.numpy()[1].tolist() == ([0, 1, 3] if largest else [2, 0, 1])
    a, b = x[:2], np.array([[1.0, 2.0, 3.0, 2.0], [2.0, 1.0, np.nan, 2.0]])
    for name in ("maximum", "minimum"):
        ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
        ea, eb = engine.tensor(a, requires_grad=True), engine.tensor(b, requires_grad=True)
        _same_forward_and_grad(getattr(engine, name)(ea, eb), getattr(torch, name)(ta, tb),
                               ea, ta)
        np.testing.assert_array_equal(eb.grad.numpy(), tb.grad.numpy())


def test_max_reads_its_arguments_as_torch_and_numpy():
    x = engine.tensor(np.array([[1.0, 5.0], [7.0, 2.0]]))
    assert x.max().item() == 7.0
    np.testing.assert_array_equal(x.max(axis=1).numpy(), [5.0, 7.0])   # NumPy: values
    values, indices = x.max(1)                                          # torch: a pair
    np.testing.assert_array_equal(values.numpy(), [5.0, 7.0])
    np.testing.assert_array_equal(indices.numpy(), [1, 0])
    assert x.min(dim=0, keepdim=True).indices.shape == (1, 2)
    np.testing.assert_array_equal(x.max(engine.tensor(np.array([3.0, 3.0]))).numpy(),
                                  [[3, 5], [7, 3]])


def test_multinomial_repeats_from_a_seed_and_follows_the_weights(device):
    probs = engine.tensor(np.array([[0.1, 0.0, 0.6, 0.3]] * 4), device=device)
    first = engine.multinomial(probs, 3, seed=5).numpy()
    assert (first == engine.multinomial(probs, 3, seed=5).numpy()).all()
    assert all(sorted(row) == [0, 2, 3] for row in first)   # without replacement: each once
    draws = engine.multinomial(engine.tensor(np.array([0.2, 0.0, 0.8]), device=device), 4000,
                               replacement=True, seed=0).numpy()
    counts = np.bincount(draws, minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.2, 0.0, 0.8], atol=0.03)


def test_bad_arguments_name_the_op_and_the_values():
    x = engine.tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"tril: needs a tensor of 2 or more dims"):
        engine.tril(engine.tensor(np.ones(3)))
    with pytest.raises(ValueError, match=r"masked_fill: the mask of shape \(4,\) does not "
                                         r"broadcast to the tensor's shape \(2, 3\)"):
        x.masked_fill(np.ones(4, bool), 0.0)
    with pytest.raises(ValueError, match=r"split: the sizes \[1, 1\] must be >= 0 and sum"):
        x.split([1, 1])
    with pytest.raises(ValueError, match=r"topk: k 4 is outside \[0, 3\]"):
        x.topk(4)
    with pytest.raises(ValueError, match="multinomial: row 1 of the probabilities has a "
                                         "negative"):
        engine.multinomial(engine.tensor([[1.0, 0.0], [0.0, 0.0]]), 1)
    with pytest.raises(ValueError, match="multinomial: row 0 of the probabilities has 1 "
                                         "positive weights for 2 draws"):
        engine.multinomial(engine.tensor([1.0, 0.0, 0.0]), 2)


def test_every_cpu_permute_of_odd_shapes_is_numpy_s_transpose():
    """Every permutation of odd shapes up to 6-D, rows of 9 and 8 kept whole (ops.shape's
    row copies) or not (its element loop), a zero-size axis among them."""
    import itertools
    rng = np.random.default_rng(3)
    for shape in ((3, 5, 9), (2, 3, 4, 1, 9), (2, 1, 3, 2, 2, 8), (4, 0, 9)):
        x = rng.standard_normal(shape).astype(np.float32)
        for axes in itertools.permutations(range(len(shape))):
            np.testing.assert_array_equal(engine.tensor(x).permute(*axes).numpy(),
                                          x.transpose(axes))


@pytest.mark.gpu
def test_float32_permute_on_the_gpu_copies_vectors_or_elements():
    """The CUDA permute's 16-byte copies (float32, the innermost axis kept, rows of a multiple
    of 4, both arrays aligned) and its element path (rows of 6 or 7, an input one element
    past its allocation's alignment) give NumPy's copy."""
    from ops.device import to_device, to_host
    from ops.shape import permute
    rng = np.random.default_rng(0)
    for shape, axes in (((2, 3, 5, 8), (0, 2, 1, 3)), ((2, 3, 5, 6), (0, 2, 1, 3)),
                        ((4, 5, 8), (2, 0, 1)), ((3, 2, 7, 4), (1, 0, 2, 3)),
                        ((3, 5, 7), (0, 2, 1))):
        x = rng.standard_normal(shape).astype(np.float32)
        out = engine.tensor(x, device="cuda").permute(*axes)
        np.testing.assert_array_equal(out.numpy(), x.transpose(axes))
    values = rng.standard_normal(1 + 2 * 3 * 5 * 8).astype(np.float32)
    shifted = to_device(values, "cuda")[1:].reshape(2, 3, 5, 8)
    np.testing.assert_array_equal(to_host(permute(shifted, (0, 2, 1, 3))),
                                  values[1:].reshape(2, 3, 5, 8).transpose(0, 2, 1, 3))
