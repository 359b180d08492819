"""Scaled dot-product attention: ``check_op`` (NumPy float64, gradcheck, CPU == CUDA, poison)
on tiny odd shapes with and without masks, torch's results in float64, dropout from the
device seed, and bad input."""
import numpy as np
import pytest

import engine
from engine.autograd import apply
from ops import cpu_threads
from engine.sequence import packed_attention
from ops.attention import AttentionOp
from ops.dropout import dropout, seed_array
from tests.support.op_check import Case, check_op
from tests.support.references import np_attention


def _sdpa(*args, **kwargs):
    return engine.scaled_dot_product_attention(*args, **kwargs)


def _bool_mask(shape):
    def make(rng):
        mask = rng.uniform(size=shape) > 0.4
        mask[..., 0] = True   # every query keeps a key: no NaN row
        return mask
    return make


def _with_mask(shapes, mask):
    def make(rng):
        return [rng.uniform(-2, 2, s) for s in shapes] + [mask(rng)]
    return make


QKV = ((2, 2, 5, 3), (2, 2, 5, 3), (2, 2, 5, 3))
CASES = [
    Case("attention", QKV, _sdpa, np_attention),
    Case("attention", QKV, lambda q, k, v: _sdpa(q, k, v, is_causal=True),
         lambda q, k, v: np_attention(q, k, v, causal=True)),
    Case("attention", ((3, 4, 3), (3, 6, 3), (3, 6, 2)),
         lambda q, k, v: _sdpa(q, k, v, scale=0.3),
         lambda q, k, v: np_attention(q, k, v, scale=0.3)),
    Case("attention", ((1, 5, 3), (1, 5, 3), (1, 5, 3), (5, 5)),
         lambda q, k, v, m: _sdpa(q, k, v, attn_mask=m),
         lambda q, k, v, m: np_attention(q, k, v, mask=m),
         make_inputs=_with_mask(((1, 5, 3),) * 3, _bool_mask((5, 5)))),
    Case("attention", ((2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 3), (2, 1, 1, 4)),
         lambda q, k, v, m: _sdpa(q, k, v, attn_mask=m),
         lambda q, k, v, m: np_attention(q, k, v, mask=m), grad=(True, True, True, False)),
    # more queries and keys than a CUDA tile holds (8 in the simulator): several query
    # blocks, key tiles, and a partial last tile of each
    Case("attention", ((1, 11, 3), (1, 13, 3), (1, 13, 2)), _sdpa, np_attention),
    Case("attention", ((1, 13, 2),) * 3, lambda q, k, v: _sdpa(q, k, v, is_causal=True),
         lambda q, k, v: np_attention(q, k, v, causal=True)),
    # q, k and v in one array (multi-head attention's): one gradient for the three
    Case("packed_attention", ((3, 2, 5, 3),),
         lambda qkv: packed_attention(qkv, is_causal=True),
         lambda qkv: np_attention(qkv[0], qkv[1], qkv[2], causal=True)),
    Case("packed_attention", ((3, 1, 2, 11, 2),), packed_attention,
         lambda qkv: np_attention(qkv[0], qkv[1], qkv[2])),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_op(case, device):
    check_op(case, device)


def _grads(fn, arrays, library):
    """The output and the gradients of q, k and v (a mask gets none here)."""
    if library == "torch":
        import torch
        tensors = [torch.tensor(a, requires_grad=n < 3) for n, a in enumerate(arrays)]
    else:
        tensors = [engine.tensor(a, requires_grad=n < 3) for n, a in enumerate(arrays)]
    out = fn(*tensors)
    g = np.random.default_rng(7).standard_normal(tuple(out.shape))
    (out * type(out)(g) if library == "engine" else out * __import__("torch").tensor(g)) \
        .sum().backward()
    values = out.detach().numpy()
    return values, [t.grad.numpy() for t in tensors if t.requires_grad]


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["plain", "causal", "bool", "float", "rectangular", "3d"])
def test_matches_torch(kind):
    import torch
    F = torch.nn.functional.scaled_dot_product_attention
    rng = np.random.default_rng(1)
    shapes = {"rectangular": ((2, 3, 70, 8), (2, 3, 9, 8), (2, 3, 9, 5)),
              "3d": ((4, 66, 8), (4, 66, 8), (4, 66, 8))}.get(kind, ((2, 3, 67, 8),) * 3)
    arrays = [rng.standard_normal(s) for s in shapes]
    kwargs = {}
    if kind == "causal":
        kwargs["is_causal"] = True
    extra = {"bool": rng.uniform(size=(67, 67)) > 0.5,
             "float": rng.standard_normal((2, 1, 67, 67))}.get(kind)
    if extra is not None:
        if extra.dtype == bool:
            extra[:, 0] = True
        arrays.append(extra)

    def run(library):
        fn = F if library == "torch" else engine.scaled_dot_product_attention
        return _grads(lambda q, k, v, *m: fn(q, k, v, *m, **kwargs), arrays, library)

    (ours, our_grads), (theirs, their_grads) = run("engine"), run("torch")
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)
    for mine, reference in zip(our_grads, their_grads):
        np.testing.assert_allclose(mine, reference, rtol=1e-9, atol=1e-11)


def _grads_of(fn, arrays):
    """The engine's output and q, k and v's gradients from a fixed grad_out of the dtype."""
    tensors = [engine.tensor(a, requires_grad=n < 3) for n, a in enumerate(arrays)]
    out = fn(*tensors)
    g = np.random.default_rng(7).standard_normal(tuple(out.shape)).astype(arrays[0].dtype)
    out.backward(engine.tensor(g))
    return out.detach().numpy(), [t.grad.numpy() for t in tensors[:3]]


@pytest.mark.parametrize("kind", ["causal", "float mask"])
def test_float32_on_several_query_tiles_matches_float64(kind):
    """The CPU's float32 path (the vectorised exp, the causal tiles scoring only the keys
    they see) against the float64 one, over three query tiles."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((2, 3, 150, 8)) for _ in range(3)]
    kwargs = {"is_causal": True} if kind == "causal" else {}
    if kind == "float mask":
        arrays.append(rng.standard_normal((2, 1, 150, 150)))

    def run(dtype):
        return _grads_of(lambda q, k, v, *m: engine.scaled_dot_product_attention(
            q, k, v, *m, **kwargs), [a.astype(dtype) for a in arrays])

    (ours, our_grads), (exact, exact_grads) = run(np.float32), run(np.float64)
    np.testing.assert_allclose(ours, exact, rtol=1e-4, atol=1e-5)
    for mine, reference in zip(our_grads, exact_grads):
        np.testing.assert_allclose(mine, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind", ["causal", "float mask"])
def test_the_kept_probabilities_give_the_gradients_of_those_made_again(monkeypatch, kind):
    """The CPU keeps the forward's P for the backward where it is small
    (SAVED_PROBS_BYTES), else makes it again from lse: the same output and gradients, the
    float mask's too, over three query tiles and chunks of one slice."""
    from ops import attention, attention_cpu
    kept = []
    size_of = attention.saved_probs_size
    monkeypatch.setattr(attention, "saved_probs_size",
                        lambda *args: kept.append(size_of(*args)) or kept[-1])
    monkeypatch.setattr(attention_cpu, "GRAD_CHUNK_BYTES", 1)
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal((2, 3, 150, 8)) for _ in range(3)]
    kwargs = {"is_causal": True} if kind == "causal" else {}
    if kind == "float mask":
        arrays.append(rng.standard_normal((2, 1, 150, 150)))
    g = rng.standard_normal((2, 3, 150, 8))
    results = []
    for budget in (attention_cpu.SAVED_PROBS_BYTES, 0):
        monkeypatch.setattr(attention_cpu, "SAVED_PROBS_BYTES", budget)
        tensors = [engine.tensor(a, requires_grad=True) for a in arrays]
        out = engine.scaled_dot_product_attention(*tensors, **kwargs)
        out.backward(engine.tensor(g))
        results.append([out.numpy()] + [t.grad.numpy() for t in tensors])
    assert kept[0] > 0 and kept[1] == 0
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_the_same_bits_on_one_and_two_threads(dropout_p):
    """The slices split across the engine's threads are each computed as in one call."""
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((12, 4, 64, 32)).astype(np.float32) for _ in range(3)]
    results = []
    try:
        for threads in (1, 2):
            engine.set_num_threads(threads)
            engine.manual_seed(0)
            results.append(_grads_of(lambda q, k, v: engine.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True), arrays))
    finally:
        cpu_threads.set_threads(None)   # follow the load again, the default
    (one, one_grads), (two, two_grads) = results
    assert np.array_equal(one, two)
    for a, b in zip(one_grads, two_grads):
        assert np.array_equal(a, b)


def test_every_cuda_tiling_fits_the_static_shared_memory():
    """Each dtype's and head cap's tiles, padded or not, fit a block's 48 KiB (``strides``
    asserts it): a float64 head of 32 had failed that assertion at every launch."""
    from ops.attention_tiles import HEAD_CAPS, backward_layout, strides, tiles
    for dtype in (np.float32, np.float64):
        for cap in HEAD_CAPS:
            tile = tiles(dtype, cap)[2]
            assert len(strides(dtype, cap)) == 3
            tile_, columns, threads = backward_layout(dtype, cap)
            assert tile_ == tile and threads % tile == 0 and tile % columns == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head", [(np.float32, 64), (np.float32, 8), (np.float32, 40),
                                        (np.float32, 128), (np.float64, 32), (np.float64, 64),
                                        (np.float64, 100)])
@pytest.mark.parametrize("kind", ["causal", "float mask", "bool mask", "dropout"])
def test_cuda_at_model_shapes_matches_the_cpu(dtype, head, kind):
    """Many query blocks and key tiles of every CUDA tiling (float32 and float64, head dims
    up to 128, odd lengths) against the CPU's results, masks and dropout included."""
    rng = np.random.default_rng(6)
    shapes = [(2, 3, 150, head), (2, 3, 133, head), (2, 3, 133, head + 3 if head < 128
                                                      else head)]
    if kind == "causal":
        shapes[1] = shapes[2] = (2, 3, 150, head)
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    g = rng.standard_normal(shapes[0][:-1] + (shapes[2][-1],)).astype(dtype)
    mask = {"float mask": rng.standard_normal((2, 1, 150, 133)).astype(dtype),
            "bool mask": rng.uniform(size=(150, 133)) > 0.3}.get(kind)
    kwargs = {"is_causal": kind == "causal", "dropout_p": 0.2 if kind == "dropout" else 0.0}

    def run(device):
        engine.manual_seed(3)
        tensors = [engine.tensor(a, device=device, requires_grad=True) for a in arrays]
        out = engine.scaled_dot_product_attention(
            *tensors, attn_mask=None if mask is None else engine.tensor(mask, device=device),
            **kwargs)
        out.backward(engine.tensor(g, device=device))
        return [out.numpy()] + [t.grad.numpy() for t in tensors]

    tolerance = {"rtol": 2e-4, "atol": 2e-5} if dtype == np.float32 else {"rtol": 1e-10,
                                                                          "atol": 1e-12}
    for ours, cpu in zip(run("cuda"), run("cpu")):
        np.testing.assert_allclose(ours, cpu, **tolerance)


@pytest.mark.gpu
def test_cuda_inputs_off_a_16_byte_boundary_take_the_scalar_loads_and_match_the_cpu(
        monkeypatch):
    """q, k and v as views one float into their buffers (rows of 64 floats, but no row on a
    16-byte boundary): the launch picks the kernels without 16-byte loads
    (ops.attention_tiles.vectors_fit), and their results are the CPU's."""
    from ops import attention_cuda
    variants = []
    kernels = attention_cuda._kernels
    monkeypatch.setattr(attention_cuda, "_kernels", lambda dtype, cap, vector: (
        variants.append(vector), kernels(dtype, cap, vector))[1])
    rng = np.random.default_rng(9)
    shape = (2, 3, 70, 64)
    buffers = [rng.standard_normal(int(np.prod(shape)) + 1).astype(np.float32)
               for _ in range(3)]
    g = rng.standard_normal(shape).astype(np.float32)

    def run(device):
        leaves = [engine.tensor(b, device=device, requires_grad=True) for b in buffers]
        out = engine.scaled_dot_product_attention(
            *[leaf[1:].reshape(shape) for leaf in leaves], is_causal=True)
        out.backward(engine.tensor(g, device=device))
        return [out.numpy()] + [leaf.grad.numpy() for leaf in leaves]

    on_gpu = run("cuda")
    assert variants == [False, False]   # the forward's launch, the backward's
    for ours, cpu in zip(on_gpu, run("cpu")):
        np.testing.assert_allclose(ours, cpu, rtol=2e-4, atol=2e-5)


def _dropout_keep(bh, tq, tk, p, seed):
    """The keep-and-scale factor of each (slice, query, key): ops.dropout's mask of the
    flat score index, which the attention kernels draw."""
    return dropout(np.ones(bh * tq * tk), p, seed_array(seed, "cpu")).reshape(bh, tq, tk)


def test_dropout_follows_the_seed_and_its_gradient_checks(device):
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((2, 5, 3)) for _ in range(3)]
    seed = seed_array(11, device)

    def attend(q, k, v):
        mask = engine.tensor(np.zeros(0), device=device).data
        return apply(AttentionOp, q, k, v, mask, seed, scale=0.5, causal=True,
                     mask_strides=(0, 0, 0), dropout_p=0.4)

    tensors = [engine.tensor(a, device=device, requires_grad=True) for a in arrays]
    keep = _dropout_keep(2, 5, 5, 0.4, 11)
    assert 0 < (keep == 0).sum() < keep.size
    np.testing.assert_allclose(attend(*tensors).numpy(),
                               np_attention(*arrays, causal=True, scale=0.5, keep=keep),
                               rtol=1e-10, atol=1e-12)
    engine.gradcheck(attend, tensors, fast=device == "cuda")


def test_dropout_draws_a_new_mask_each_call_and_repeats_from_manual_seed():
    q = engine.tensor(np.random.default_rng(3).standard_normal((1, 6, 4)))
    first = _sdpa(q, q, q, dropout_p=0.5).numpy()
    assert not np.array_equal(first, _sdpa(q, q, q, dropout_p=0.5).numpy())
    np.testing.assert_array_equal(_sdpa(q, q, q).numpy(), _sdpa(q, q, q, dropout_p=0.0).numpy())
    engine.manual_seed(5)
    again = _sdpa(q, q, q, dropout_p=0.5).numpy()
    engine.manual_seed(5)
    np.testing.assert_array_equal(_sdpa(q, q, q, dropout_p=0.5).numpy(), again)


def test_bad_input_names_the_op_and_the_shapes():
    q = engine.tensor(np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: attn_mask of shape "
                                         r"\(3, 4\) does not broadcast to the scores' shape "
                                         r"\(2, 4, 4\)"):
        _sdpa(q, q, q, attn_mask=np.ones((3, 4), bool))
    with pytest.raises(ValueError, match="give attn_mask or is_causal=True, not both"):
        _sdpa(q, q, q, attn_mask=np.ones((4, 4), bool), is_causal=True)
    with pytest.raises(ValueError, match=r"expects q \(..., Tq, d\), k \(..., Tk, d\) and v "
                                         r"\(..., Tk, dv\) with the same leading dims, got "
                                         r"\(2, 4, 3\), \(2, 4, 2\)"):
        _sdpa(q, engine.tensor(np.ones((2, 4, 2))), q)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        _sdpa(q, q, q, dropout_p=1.0)


def test_a_fully_masked_row_is_nan_as_in_torch():
    q = engine.tensor(np.ones((1, 2, 3)))
    mask = np.array([[True, True], [False, False]])
    out = _sdpa(q, q, q, attn_mask=mask).numpy()
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1]).all()


def test_packed_attention_gives_the_bits_of_attention_over_the_slices(device):
    """One (3, ...) array against its three slices through scaled_dot_product_attention,
    with dropout from the same seed state: the same output and gradients, bit for bit."""
    from ops.dropout import new_seed_state
    qkv = np.random.default_rng(4).standard_normal((3, 2, 3, 7, 4)).astype(np.float32)
    g = np.random.default_rng(5).standard_normal((2, 3, 7, 4)).astype(np.float32)
    results = []
    for packed in (True, False):
        x = engine.tensor(qkv, device=device, requires_grad=True)
        state = new_seed_state(9, device)
        out = (packed_attention(x, 0.3, True, seed_state=state) if packed else
               _sdpa(x[0], x[1], x[2], dropout_p=0.3, is_causal=True, seed_state=state))
        out.backward(engine.tensor(g, device=device))
        results.append((out.numpy(), x.grad.numpy()))
    assert results[0][0].tobytes() == results[1][0].tobytes()
    assert results[0][1].tobytes() == results[1][1].tobytes()


def test_packed_attention_refuses_other_shapes():
    with pytest.raises(ValueError, match=r"packed_attention: expects qkv of shape \(3, \.\.\., "
                                         r"T, d\), got \(2, 4, 5\)"):
        packed_attention(engine.tensor(np.zeros((2, 4, 5))))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_the_cpu_backward_in_chunks_of_slices_gives_the_same_bits(monkeypatch, dropout_p):
    """ops.attention_cpu takes a block's slices in chunks (GRAD_CHUNK_BYTES): a chunk of one
    slice gives the bits of all at once, with a float mask's gradient, the forward's P kept
    (no dropout) or made again (dropout)."""
    from ops import attention_cpu
    from ops.dropout import new_seed_state
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 3, 9, 4)).astype(np.float32) for _ in range(3))
    mask = rng.standard_normal((3, 9, 9)).astype(np.float32)
    g = rng.standard_normal((2, 3, 9, 4)).astype(np.float32)
    results = []
    for chunk_bytes in (attention_cpu.GRAD_CHUNK_BYTES, 1):
        monkeypatch.setattr(attention_cpu, "GRAD_CHUNK_BYTES", chunk_bytes)
        tensors = [engine.tensor(a, requires_grad=True) for a in (q, k, v, mask)]
        out = _sdpa(*tensors[:3], attn_mask=tensors[3], dropout_p=dropout_p,
                    seed_state=new_seed_state(3, "cpu"))
        out.backward(engine.tensor(g))
        results.append([t.grad.numpy().tobytes() for t in tensors])
    assert results[0] == results[1]
