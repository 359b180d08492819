"""Tensor habits of PyTorch and NumPy users (API.md): indexing, comparisons, where,
argmax/argmin, min, abs, clip, cat/stack, squeeze/unsqueeze/permute/view, dtype casts,
dim=, Python conversions, IEEE division. The ``CASES`` go through ``check_op`` on every
backend; the tests below them pin the semantics that a NumPy reference cannot."""
import warnings

import numpy as np
import pytest

import engine
import ops.cuda
from ops.cuda import SIMULATOR
from tests.support.op_check import Case, check_op


def _ints(*shapes, low=0, high=3):
    """make_inputs: integer arrays (index tensors, labels) of ``shapes`` and one float array
    of the last shape given, which alone requires grad."""
    *int_shapes, float_shape = shapes

    def make(rng):
        return ([rng.integers(low, high, size=s) for s in int_shapes]
                + [rng.uniform(-2, 2, size=float_shape)])
    return make


def _compare_cases(name):
    """A tensor-tensor and a tensor-scalar case of one comparison, each through where (the
    comparison itself has no gradient); ==/!= compare integer tensors, where ties exist."""
    compare = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
               "eq": np.equal, "ne": np.not_equal}[name]
    op = getattr(engine, name)
    if name in ("eq", "ne"):
        return [
            Case(name, ((3, 5), (5,), (3, 5)), lambda i, j, v: engine.where(op(i, j), v, -v),
                 lambda i, j, v: np.where(compare(i, j), v, -v), make_inputs=_ints((3, 5), (5,),
                                                                                   (3, 5))),
            Case(name, ((7,), (7,)), lambda i, v: engine.where(op(i, 1), v, 2 * v),
                 lambda i, v: np.where(compare(i, 1), v, 2 * v), make_inputs=_ints((7,), (7,))),
        ]
    return [
        Case(name, ((3, 5), (5,)), lambda a, b: engine.where(op(a, b), a, b),
             lambda a, b: np.where(compare(a, b), a, b)),
        Case(name, ((2, 1, 3),), lambda a: engine.where(op(a, 0.25), a * 3, a),
             lambda a: np.where(compare(a, 0.25), a * 3, a)),
    ]


def _round_trip(a):
    other = np.float32 if a.dtype == np.float64 else np.float64
    return a.astype(other).astype(a.dtype)


CASES = (
    [
        Case("abs", ((3, 5),), lambda a: a.abs(), np.abs),
        Case("abs", ((7,),), engine.abs, np.abs),
        Case("div_scalar", ((3, 5),), lambda a: a / 3, lambda a: a / 3),
        Case("div_scalar", ((7,),), lambda a: a / -0.7, lambda a: a / -0.7),
        Case("clip", ((3, 5),), lambda a: a.clip(-1, 0.5), lambda a: np.clip(a, -1, 0.5)),
        Case("clip", ((2, 1, 3),), lambda a: a.clamp(min=0.1), lambda a: np.maximum(a, 0.1)),
        Case("clip", ((7,),), lambda a: engine.clip(a, None, 0), lambda a: np.minimum(a, 0)),
        Case("min", ((3, 5),), lambda a: a.min(axis=1), lambda a: a.min(axis=1)),
        Case("min", ((2, 3, 4),), lambda a: a.min(dim=(0, -1), keepdim=True),
             lambda a: a.min(axis=(0, 2), keepdims=True)),
        Case("min", ((7,),), lambda a: a.min(), np.min),
        Case("min", ((2, 3),), lambda a: a.min(axis=1), lambda a: a.min(axis=1),   # tied minima
             make_inputs=lambda rng: [np.array([[1.0, -3.0, -3.0], [2.0, 2.0, 5.0]])]),
        # argmax/argmin through indexing: x at its own arg-extremum is the extremum
        Case("argmax", ((3, 5),), lambda a: a[np.arange(3), a.argmax(axis=1)],
             lambda a: a.max(axis=1)),
        Case("argmax", ((2, 3, 4),), lambda a: a.reshape(-1)[a.argmax()], np.max),
        Case("argmax", ((3, 4),), lambda a: a[a.argmax(dim=0, keepdim=True)[0], np.arange(4)],
             lambda a: a.max(axis=0)),
        Case("argmin", ((3, 5),), lambda a: a[np.arange(3), a.argmin(axis=-1)],
             lambda a: a.min(axis=1)),
        Case("argmin", ((7,),), lambda a: a[a.argmin()], np.min),
        Case("where", ((3, 1), (5,), (3, 5)), lambda c, a, b: engine.where(c > 0, a, b),
             lambda c, a, b: np.where(c > 0, a, b), grad=(False, True, True)),
        Case("where", ((3, 5), (3, 5)), lambda c, a: engine.where(c < 0.5, a, 0.0),
             lambda c, a: np.where(c < 0.5, a, 0.0), grad=(False, True)),
        Case("where", ((7,), (7,)), lambda c, b: engine.where(c > 0, 2.0, b),
             lambda c, b: np.where(c > 0, 2.0, b), grad=(False, True)),
        Case("cast", ((3, 5),), lambda a: a.astype(np.float32 if a.dtype == np.float64
                                                   else np.float64).astype(a.dtype),
             _round_trip, gradcheck_kwargs=dict(eps=1e-3, atol=1e-3)),
        Case("cast", ((7,),), lambda a: a.to(np.float32 if a.dtype == np.float64
                                             else np.float64).to(a.dtype),
             _round_trip, gradcheck_kwargs=dict(eps=1e-3, atol=1e-3)),
        Case("cast", ((7,), (7,)), lambda c, v: engine.where(c.astype(bool), v, -v),
             lambda c, v: np.where(c != 0, v, -v), grad=(False, True),
             make_inputs=lambda rng: [np.array([0.0, 1.5, -0.0, -2.0, 0.0, 0.25, 3.0]),
                                      rng.uniform(-2, 2, 7)]),
        Case("cat", ((3, 2), (3, 5)), lambda a, b: engine.cat([a, b], axis=1),
             lambda a, b: np.concatenate([a, b], axis=1)),
        Case("cat", ((1, 3), (2, 3), (3,)), lambda a, b, c: engine.cat([a, b, c[None]], dim=0),
             lambda a, b, c: np.concatenate([a, b, c[None]], axis=0)),
        Case("cat", ((2, 3), (2, 3)), lambda a, b: engine.stack([a, b], axis=-1),
             lambda a, b: np.stack([a, b], axis=-1)),
        Case("cat", ((3,), (3,), (3,)), lambda a, b, c: engine.stack([a, b, c]),
             lambda a, b, c: np.stack([a, b, c])),
        Case("permute", ((2, 3, 4),), lambda a: a.permute(2, 0, 1),
             lambda a: a.transpose(2, 0, 1)),
        Case("permute", ((2, 3, 4),), lambda a: a.transpose(0, 2), lambda a: a.swapaxes(0, 2)),
        Case("permute", ((2, 1, 3),), lambda a: a.T, lambda a: a.T),
        # contiguous rows of 8 (a CUDA thread's run of 4 inside one row), and of 6 (runs
        # that cross into the next row, whose offset is computed afresh)
        Case("permute", ((2, 5, 3, 8),), lambda a: a.permute(2, 0, 1, 3),
             lambda a: a.transpose(2, 0, 1, 3)),
        Case("permute", ((3, 2, 6),), lambda a: a.permute(1, 0, 2),
             lambda a: a.transpose(1, 0, 2)),
        Case("reshape", ((3, 5),), lambda a: a.view(5, 3) * 1.0, lambda a: a.reshape(5, 3)),
        Case("reshape", ((3, 1, 5),), lambda a: a.squeeze().unsqueeze(-1) * 1.0,
             lambda a: a.reshape(3, 5, 1)),
        # basic indexing: views (a leading block) and copies
        Case("index", ((3, 5),), lambda a: a[1], lambda a: a[1]),
        Case("index", ((5, 3),), lambda a: a[1:4], lambda a: a[1:4]),
        Case("index", ((3, 5),), lambda a: a[:, ::2], lambda a: a[:, ::2]),
        Case("index", ((7,),), lambda a: a[::-2], lambda a: a[::-2]),
        Case("index", ((2, 3, 4),), lambda a: a[..., -1], lambda a: a[..., -1]),
        Case("index", ((2, 3, 4),), lambda a: a[None, 1, 1:, None], lambda a: a[None, 1, 1:, None]),
        Case("index", ((3, 5),), lambda a: a[-1, -2], lambda a: a[-1, -2]),
        # advanced: repeated indices accumulate their gradients
        Case("index", ((5, 3),), lambda a: a[[0, 2, 0, -1]], lambda a: a[[0, 2, 0, -1]]),
        Case("index", ((5, 3),), lambda i, a: a[i], lambda i, a: a[i],
             make_inputs=lambda rng: [np.array([[4, 0], [0, -5]]), rng.uniform(-2, 2, (5, 3))]),
        Case("index", ((3, 5),), lambda i, a: a[1:, i], lambda i, a: a[1:, i],
             make_inputs=_ints((4,), (3, 5), high=5)),
        Case("index", ((3, 4), (3, 4)), lambda i, a: a[np.arange(3)[:, None], i],
             lambda i, a: a[np.arange(3)[:, None], i], make_inputs=_ints((3, 4), (3, 4), high=4)),
        Case("index", ((2, 3, 4),), lambda a: a[[1, 0], :, [3, 3]],     # apart: B goes first
             lambda a: a[[1, 0], :, [3, 3]]),
        Case("index", ((2, 3, 4),), lambda a: a[0, :, [1, 3, 1]],       # ints drop first: torch
             lambda a: a[0][:, [1, 3, 1]]),
        Case("index", ((3, 5), (3, 5)), lambda c, a: a[c > 0], lambda c, a: a[c > 0],
             grad=(False, True)),
        Case("index", ((3, 5),), lambda a: a[:, np.array([True, False, True, True, False])],
             lambda a: a[:, np.array([True, False, True, True, False])]),
        Case("index", ((2, 3, 4),), lambda a: a[..., np.array([True, False, True, True])],
             lambda a: a[..., np.array([True, False, True, True])]),
    ]
    + [case for name in ("lt", "le", "gt", "ge", "eq", "ne") for case in _compare_cases(name)]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


@pytest.fixture(autouse=True)
def _no_numpy_warnings_from_kernels():
    """The CPU kernels raise no floating-point warnings (error_model="numpy"); the CUDA
    simulator computes in NumPy, so there they are expected and ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if SIMULATOR else "error", RuntimeWarning)
        yield


# ------------------------------------------------------------------ indexing

def test_index_results_share_memory_only_when_they_are_one_block(device):
    x = engine.tensor(np.arange(12.0).reshape(3, 4), device=device)
    block, row_part, strided = x[1:3], x[2, 1:3], x[:, 1]
    x[2] = -1.0
    np.testing.assert_array_equal(block.numpy(), [[4, 5, 6, 7], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(row_part.numpy(), [-1, -1])
    np.testing.assert_array_equal(strided.numpy(), [1, 5, 9])   # a copy: unchanged
    if device == "cpu":
        assert np.shares_memory(block.numpy(), x.numpy())
        assert not np.shares_memory(x[::2].numpy(), x.numpy())
        assert not np.shares_memory(x[[0, 1]].numpy(), x.numpy())


TORCH_KEYS = [
    (1,), (slice(1, None),), (slice(None, None, 2), -1), (Ellipsis, 0), (None, 0, slice(1, 3)),
    ([0, 1, 1],), (0, slice(None), [1, 3, 1]), ([1, 0], slice(None), [3, 3]),
    (slice(None), [[0, 1], [2, 2]]), ([0, 1], [2, 0], [3, 1]), (1, [0, 2], slice(1, None)),
    ([[1], [0]], slice(None), [0, 2, 3]), (Ellipsis, [1, 1], None), ([],),
    (np.array([True, False]),), (np.array([[True, False, True], [False, True, True]]),),
    (slice(None), np.array([False, True, True]), 2),
]


@pytest.mark.torch
@pytest.mark.parametrize("key", TORCH_KEYS, ids=str)
def test_indexing_matches_torch_values_and_gradients(key, device):
    import torch
    values = np.random.default_rng(0).standard_normal((2, 3, 4))
    x = engine.tensor(values, device=device, requires_grad=True)
    reference = torch.tensor(values, requires_grad=True)
    torch_key = tuple(torch.tensor(k, dtype=None if len(k) else torch.long)
                      if isinstance(k, (list, np.ndarray)) else k for k in key)
    out, expected = x[key], reference[torch_key]
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy())
    weights = np.random.default_rng(1).standard_normal(tuple(expected.shape))
    (out * engine.tensor(weights, device=device)).sum().backward()
    (expected * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), reference.grad.numpy(), rtol=1e-12)


def test_out_of_range_indices_name_the_index_axis_and_size(device):
    x = engine.zeros(3, 4, device=device)
    with pytest.raises(IndexError, match="index 3 is out of bounds for axis 0 with size 3"):
        x[3]
    with pytest.raises(IndexError, match="index -5 is out of bounds for axis 1 with size 4"):
        x[0, -5]
    with pytest.raises(IndexError, match="index 7 is out of bounds for axis 1 with size 4"):
        x[:, [0, 7]]
    # a device index tensor on a real GPU is checked on the device: the next call raises
    deferred = device == "cuda" and not ops.cuda.SIMULATOR
    with pytest.raises(IndexError, match="index -4 is out of bounds for axis 0 with size 3"):
        x[engine.tensor([1, -4], device=device)]
        if deferred:
            ops.cuda.cuda.synchronize()
            x[engine.tensor([0], device=device)]
    with pytest.raises(IndexError, match="index 4 is out of bounds for axis 1 with size 4"):
        x[engine.tensor([0], device=device), engine.tensor([[4]], device=device)] = 1.0
        if deferred:
            ops.cuda.cuda.synchronize()
            x[engine.tensor([0], device=device)]
    np.testing.assert_array_equal(x[engine.tensor([2], device=device)].numpy(), [[0] * 4])


@pytest.mark.gpu
def test_a_bad_cuda_index_tensor_raises_at_the_next_indexing_call():
    import ops.cuda
    x = engine.zeros(3, 4, device="cuda")
    bad = engine.tensor([0, 9], device="cuda")
    x[bad]                                   # checked on the device: nothing raised yet
    ops.cuda.cuda.synchronize()
    with pytest.raises(IndexError, match="index 9 is out of bounds for axis 0 with size 3"):
        x[engine.tensor([1], device="cuda")]
    np.testing.assert_array_equal(x[engine.tensor([1], device="cuda")].numpy(), [[0] * 4])


def test_bad_keys_are_clear_errors(device):
    x = engine.zeros(3, 4, device=device)
    with pytest.raises(IndexError, match="too many indices for a tensor of dimension 2"):
        x[0, 1, 2]
    with pytest.raises(IndexError, match="single ellipsis"):
        x[..., ...]
    with pytest.raises(IndexError, match="must be integers or bools, got float32"):
        x[engine.tensor([0.0], device=device)]
    with pytest.raises(IndexError, match=r"mask of shape \(4,\) does not match the indexed "
                                         r"axes \(3,\)"):
        x[np.ones(4, bool)]
    with pytest.raises(IndexError, match="cannot be broadcast together"):
        x[[0, 1], [0, 1, 2]]
    with pytest.raises(TypeError, match="str is not an index"):
        x["0"]
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        x[::0]


def test_cpu_tensors_refuse_cuda_indices():
    if not engine.cuda_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match="lives on cuda and the tensor on the cpu"):
        engine.zeros(3)[engine.tensor([0], device="cuda")]


def test_integer_and_bool_tensors_index_and_are_indexed(device):
    labels = engine.tensor(np.array([3, 1, 2, 1], np.uint8), device=device)
    mask = labels == 1
    assert mask.dtype == np.bool_ and labels[mask].dtype == np.uint8
    np.testing.assert_array_equal(labels[mask].numpy(), [1, 1])
    np.testing.assert_array_equal(mask[1:].numpy(), [True, False, True])
    np.testing.assert_array_equal(labels[engine.tensor([3, 0], device=device)].numpy(), [1, 3])
    np.testing.assert_array_equal(engine.cat([mask, mask]).numpy(),
                                  [False, True, False, True] * 2)


# ------------------------------------------------------------------ setitem

def test_setitem_writes_in_place_with_broadcasting_and_casting(device):
    x = engine.zeros(3, 4, device=device)
    x[0] = 1                                       # a number, cast to float32
    x[1, ::2] = engine.tensor([2.0, 3.0], dtype=np.float64, device=device)   # cast
    x[:, -1] = np.array([[7], [8], [9]])[:, 0]     # a host array
    x[x == 0] = -1.0                               # a mask
    x[[2, 2], [0, 0]] = engine.tensor([5.0, 6.0], device=device)   # repeated: the last wins
    np.testing.assert_array_equal(x.numpy(), [[1, 1, 1, 7], [2, -1, 3, 8], [6, -1, -1, 9]])
    labels = engine.tensor([0, 1, 2], device=device)
    labels[labels == 1] = 9
    np.testing.assert_array_equal(labels.numpy(), [0, 9, 2])
    flags = engine.zeros(3, dtype=bool, device=device)
    flags[1] = True
    np.testing.assert_array_equal(flags.numpy(), [False, True, False])


def test_setitem_reads_an_overlapping_value_before_writing(device):
    x = engine.tensor(np.arange(6.0), device=device)
    x[1:6] = x[0:5]                                # a view of x itself
    np.testing.assert_array_equal(x.numpy(), [0, 0, 1, 2, 3, 4])


def test_setitem_refuses_what_would_corrupt_gradients(device):
    w = engine.zeros(3, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad.*engine.where.*x.detach"):
        w[0] = 1.0
    x = engine.zeros(3, device=device)
    with pytest.raises(RuntimeError, match="the value requires grad"):
        x[0] = w[1]
    with pytest.raises(ValueError, match=r"value of shape \(2,\) cannot be broadcast to the "
                                         r"selection's shape \(3,\)"):
        x[:] = engine.tensor([1.0, 2.0], device=device)
    w.detach()[0] = 5.0                            # outside autograd, the same memory
    assert w.numpy()[0] == 5


# ------------------------------------------------------------------ comparisons, hash

def test_comparisons_are_bool_tensors_that_never_require_grad(device):
    x = engine.tensor([1.0, 2.0, np.nan], device=device, requires_grad=True)
    for result in (x < 2, x <= 2, x > 1, x >= 1, x == 2, x != 2, 2 > x, x == x.detach()):
        assert result.dtype == np.bool_ and not result.requires_grad
    np.testing.assert_array_equal((x == x.detach()).numpy(), [True, True, False])   # NaN
    np.testing.assert_array_equal((x != x).numpy(), [False, False, True])
    np.testing.assert_array_equal((2 > x).numpy(), [True, False, False])
    np.testing.assert_array_equal((np.array([2.0, 2.0, 2.0]) <= x).numpy(), [False, True, False])
    assert (x == None) is False and (x != "x") is True   # noqa: E711 (not elementwise)


def test_comparisons_promote_like_numpy(device):
    f32 = engine.tensor([0.1, 1.0], device=device)
    assert (f32 == 0.1).numpy().tolist() == [True, False]      # 0.1 as float32, as NumPy
    labels = engine.tensor(np.array([1, 2], np.uint8), device=device)
    predictions = engine.tensor([1, 3], device=device)         # int64
    assert (labels == predictions).numpy().tolist() == [True, False]
    assert (labels == 2.5).numpy().tolist() == [False, False]  # no cast of 2.5 to an int
    assert (labels > -1).numpy().tolist() == [True, True]
    f64 = engine.tensor([0.1, 3.0], dtype=np.float64, device=device)
    assert (f32 < f64).numpy().tolist() == [False, True]
    assert ((labels == 1) == engine.tensor([True, True], device=device)).numpy().tolist() == \
        [True, False]


def test_hash_is_identity_so_tensors_stay_set_members_and_keys(device):
    a, b = engine.zeros(2, device=device), engine.zeros(2, device=device)
    assert hash(a) == object.__hash__(a)
    assert len({a, b, a}) == 2 and {a: 1, b: 2}[b] == 2


def test_bool_tensors_refuse_arithmetic_until_cast(device):
    mask = engine.tensor([1.0, -1.0], device=device) > 0
    with pytest.raises(TypeError, match=r"dtype bool.*once cast, e\.g\. x\.astype"):
        mask + 1
    with pytest.raises(TypeError, match="sum: input 0 has dtype bool"):
        mask.sum()
    with pytest.raises(TypeError, match="bool"):
        engine.tensor([True], requires_grad=True)
    assert mask.astype(np.float32).sum().item() == 1.0


def test_where_takes_bool_conditions_only(device):
    x = engine.tensor([1.0, -2.0], device=device)
    with pytest.raises(TypeError, match="cond must be a bool tensor"):
        engine.where(x, x, 0.0)
    np.testing.assert_array_equal(engine.where(np.array([True, False]), x, -x).numpy(), [1, 2])
    both = engine.where(x > 0, 1.0, 0.0)
    assert both.dtype == np.float32 and both.numpy().tolist() == [1, 0]


# ------------------------------------------------------------------ reductions, argmax

def test_argmax_and_argmin_take_the_first_extremum_and_nan_wins(device):
    x = engine.tensor([[1.0, 3.0, 3.0], [np.nan, 0.0, np.nan], [-np.inf, -np.inf, 2.0]],
                      device=device)
    assert x.argmax(axis=1).numpy().tolist() == [1, 0, 2]
    assert x.argmin(dim=1).numpy().tolist() == [0, 0, 0]
    assert x.argmax().item() == 3 and x.argmax().dtype == np.int64
    assert x.argmax(axis=0, keepdims=True).shape == (1, 3)
    assert x.argmax(keepdims=True).shape == (1, 1)
    with pytest.raises(TypeError, match="argmax: axis must be an int or None"):
        x.argmax(axis=(0, 1))
    with pytest.raises(ValueError, match="empty axis"):
        engine.zeros(0, 3, device=device).argmax(axis=0)


def test_dim_and_keepdim_are_torch_names_for_axis_and_keepdims(device):
    x = engine.tensor(np.arange(6.0).reshape(2, 3), device=device)
    assert x.sum(dim=1).numpy().tolist() == [3, 12]
    assert x.mean(dim=-1, keepdim=True).shape == (2, 1)
    assert x.max(dim=0).values.numpy().tolist() == [3, 4, 5]   # torch: (values, indices)
    np.testing.assert_allclose(x.softmax(dim=0).numpy().sum(axis=0), [1, 1, 1], rtol=1e-6)
    assert engine.cat([x, x], dim=1).shape == (2, 6) and x.squeeze(dim=0).shape == (2, 3)
    for call in (lambda: x.sum(axis=0, dim=0), lambda: x.softmax(axis=0, dim=0),
                 lambda: engine.stack([x], axis=0, dim=0), lambda: x.unsqueeze(0, dim=0),
                 lambda: x.argmax(axis=1, dim=1)):
        with pytest.raises(TypeError, match="both axis=0 and dim=0|both axis=1 and dim=1"):
            call()
    with pytest.raises(TypeError, match="both keepdims and keepdim"):
        x.sum(keepdims=True, keepdim=True)


def test_clip_bounds_are_checked():
    x = engine.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="give low, high or both"):
        x.clip()
    with pytest.raises(ValueError, match="low is nan"):
        x.clip(float("nan"), 1)
    with pytest.raises(TypeError, match="low bound twice"):
        x.clip(0, min=0)
    with pytest.raises(TypeError, match="Python number or None, got Tensor"):
        x.clip(x, 1)


def test_abs_and_clip_gradients_follow_torch_at_the_kinks(device):
    x = engine.tensor([0.0, -1.0, 2.0, 1.0], device=device, requires_grad=True)
    (x.abs() + x.clip(1.0, 2.0)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0, -1, 2, 2])   # clip's ends included


# ------------------------------------------------------------------ shapes and joins

def test_squeeze_unsqueeze_transpose_and_permute_shapes(device):
    x = engine.zeros(2, 1, 3, 1, device=device)
    assert x.squeeze().shape == (2, 3) and x.squeeze(1).shape == (2, 3, 1)
    assert x.squeeze(0).shape == (2, 1, 3, 1)              # not size 1: kept, as torch
    assert x.squeeze((1, -1)).shape == (2, 3)
    y = engine.zeros(2, 3, device=device)
    assert y.unsqueeze(0).shape == (1, 2, 3) and y.unsqueeze(-1).shape == (2, 3, 1)
    assert y.unsqueeze((0, 3)).shape == (1, 2, 3, 1)
    assert y.transpose(0, 1).shape == (3, 2) and y.transpose(1, 0).shape == (3, 2)
    z = engine.zeros(2, 3, 4, device=device)
    assert z.transpose().shape == (4, 3, 2) and z.transpose(1, 2).shape == (2, 4, 3)
    assert z.transpose(1, 0, 2).shape == (3, 2, 4) and z.permute((2, 1, 0)).shape == (4, 3, 2)
    with pytest.raises(ValueError, match="not a permutation"):
        z.permute(0, 0, 1)
    with pytest.raises(ValueError, match="view: cannot reshape 24 elements"):
        z.view(5, -1)


def test_cat_and_stack_refuse_mismatches(device):
    a, b = engine.zeros(2, 3, device=device), engine.zeros(2, 4, device=device)
    assert engine.cat([a, b], axis=1).shape == (2, 7)
    with pytest.raises(ValueError, match=r"cat: tensor 1 does not fit along axis 0"):
        engine.cat([a, b])
    with pytest.raises(ValueError, match="stack: every tensor needs the same shape"):
        engine.stack([a, b])
    with pytest.raises(TypeError, match=r"cat: inputs have different dtypes \(float32, float64\)"):
        engine.cat([a, a.astype(np.float64)])
    with pytest.raises(TypeError, match="expects a list or tuple of Tensors"):
        engine.cat(a)
    with pytest.raises(ValueError, match="0-d tensors"):
        engine.cat([engine.zeros((), device=device)])


# ------------------------------------------------------------------ dtypes and Python numbers

def test_astype_and_to_dtype_run_on_the_device(device):
    x = engine.tensor([-1.7, 0.0, 2.5], device=device, requires_grad=True)
    y = x.to(np.float64)
    assert y.dtype == np.float64 and y.device == device and y.requires_grad
    (y * y).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy())
    assert x.astype(np.int64).numpy().tolist() == [-1, 0, 2]        # toward zero
    assert not x.astype(np.int64).requires_grad
    assert x.astype(bool).numpy().tolist() == [True, False, True]
    assert (x > 0).astype(np.float64).numpy().tolist() == [0, 0, 1]
    assert x.to(np.float32) is x
    with pytest.raises(TypeError, match="astype: dtype float16 is not supported"):
        x.astype(np.float16)


def test_python_number_conversions(device):
    x = engine.tensor([[2.75]], device=device)
    assert float(x) == 2.75 and int(x) == 2 and bool(x) is True
    assert bool(engine.tensor([0.0], device=device)[0]) is False
    assert bool(engine.tensor([0.0], device=device)) is False
    for convert in (float, int):
        with pytest.raises(ValueError, match="only one-element tensors"):
            convert(engine.zeros(2, device=device))
    with pytest.raises(RuntimeError, match="truth value of a tensor of shape"):
        bool(engine.zeros(2, device=device))
    with pytest.raises(RuntimeError, match="truth value"):
        bool(engine.zeros(0, device=device))


def test_len_and_iter_go_over_the_first_axis(device):
    x = engine.tensor(np.arange(6.0).reshape(3, 2), device=device, requires_grad=True)
    rows = list(x)
    assert len(x) == 3 and [r.numpy().tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    sum(r.sum() for r in rows).backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.ones((3, 2)))
    scalar = x[0, 0]   # 0-d (the CUDA simulator copies a 0-d host array in as shape (1,))
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        iter(scalar)
    with pytest.raises(TypeError, match="len"):
        len(scalar)


def test_division_by_zero_and_ieee_cases_follow_numpy(device):
    values = np.array([1.0, -1.0, 0.0, np.inf, np.nan], np.float32)
    x = engine.tensor(values, device=device)
    with np.errstate(all="ignore"):
        for got, expected in (((x / 0), values / np.float32(0)),
                              ((x / -0.0), values / np.float32(-0.0)),
                              ((x / np.inf), values / np.float32(np.inf)),
                              ((1 / x), np.float32(1) / values),
                              ((x / engine.zeros(5, device=device)), values / np.float32(0)),
                              ((x ** -1), values ** np.float32(-1)),
                              (x.log(), np.log(values)), (x.sqrt(), np.sqrt(values))):
            np.testing.assert_array_equal(got.numpy(), expected)
    assert (x / 3).numpy()[0] == np.float32(1) / np.float32(3)    # a division, not * (1/3)


def test_float64_models_take_float64_tensors(device):
    from engine import nn
    model = nn.Sequential([nn.Dense(4, dtype=np.float64, input_shape=(3,)),
                           nn.Dense(2, dtype=np.float64)]).to(device)
    assert model(engine.tensor(np.ones((2, 3)), device=device)).dtype == np.float64
    float32_model = nn.Sequential([nn.Dense(2, input_shape=(3,))]).to(device)
    with pytest.raises(TypeError, match="input dtype float64 does not match the layer's float32"):
        float32_model(engine.tensor(np.ones((2, 3)), device=device))


def test_accuracy_in_the_engine_matches_the_fused_metrics_kernel(device):
    from ops.metrics import RunningMetrics
    rng = np.random.default_rng(0)
    logits = engine.tensor(rng.standard_normal((37, 10)), device=device)
    labels = engine.tensor(rng.integers(0, 10, 37), device=device)
    accuracy = (logits.argmax(axis=1) == labels).astype(np.float32).mean().item()
    metrics = RunningMetrics(device)
    metrics.add(None, logits.data, labels.data)
    assert accuracy == pytest.approx(metrics.read()[1], abs=1e-7)
