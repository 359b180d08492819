"""matmul with torch.matmul's rules on every backend: 1-D operands, (..., K) @ (K, N), and
batched products whose batch dims broadcast, through one batched GEMM launch
(``ops.gemm.plans.batched_gemm_plan``) and its transposed products in the backward.

torch.matmul is the oracle; the simulator's shapes are tiny and odd (they straddle its 4x4
tiles), with batch dims that broadcast on either side, in the middle and at the front."""
import numpy as np
import pytest

import engine
from ops import cpu_threads
from ops.cpu_threads import row_blocks
from ops.gemm.batches import batch_meta
from ops.launch import LaunchRecorder
from tests.support.op_check import Case, check_op

torch = pytest.importorskip("torch")


def _torch_matmul(a, b):
    return torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()


SHAPES = [((2, 3, 4), (4, 5)),           # N-D @ 2-D: one GEMM over a's rows
          ((1, 3, 4, 5), (2, 1, 5, 2)),  # both broadcast, along different dims
          ((5,), (2, 5, 3)),             # a row vector against a batch
          ((2, 3, 4), (2, 4, 5)),        # a plain batch
          ((3, 4), (2, 4, 1)),           # a 2-D a broadcast over b's batch
          ((2, 1, 3, 4), (4,)),          # a column vector
          ((4,), (4,)),                  # a dot product
          ((3,), (3, 2)),
          ((2, 3, 2, 5), (3, 5, 3))]     # a broadcast leading dim of b

CASES = [Case("matmul", shapes, lambda a, b: a @ b, _torch_matmul) for shapes in SHAPES]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matmul_broadcasts_as_torch(case, device):
    check_op(case, device)


@pytest.mark.parametrize("shapes", [((1, 3, 4, 5), (2, 1, 5, 2)), ((5,), (2, 5, 3))], ids=str)
def test_a_batched_product_is_one_launch_each_way(device, shapes):
    """The forward one batched GEMM; the backward one for each gradient, then the sum over
    the broadcast batches."""
    rng = np.random.default_rng(0)
    a, b = (engine.tensor(rng.standard_normal(s), device=device, requires_grad=True)
            for s in shapes)
    with LaunchRecorder() as recorder:
        y = a @ b
    assert [run.kernel.name for run in recorder.runs] == ["gemm_batched"]
    with LaunchRecorder() as recorder:
        y.sum().backward()
    names = [run.kernel.name for run in recorder.runs]
    assert names.count("gemm_batched") == 2, names


def test_batch_meta_merges_dims_both_operands_walk_as_one():
    # a (2, 3) batch walked contiguously by both: one dim of 6
    assert batch_meta((2, 3), (3, 1), (3, 1)) == (1, 6, 1, 1)
    # a broadcast along the first dim, b along the second: two dims
    assert batch_meta((2, 3), (0, 1), (1, 0)) == (2, 2, 3, 0, 1, 1, 0)
    # size-1 dims vanish
    assert batch_meta((1, 4), (0, 1), (0, 0)) == (1, 4, 1, 0)


def test_batched_matmul_is_bit_identical_across_thread_counts():
    """At 2 threads the batches really split (``row_blocks``); each product is one BLAS call
    whichever thread runs it."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64, 64)).astype(np.float32)
    results = []
    for threads in (1, 2):
        engine.set_num_threads(threads)
        assert len(row_blocks(64, 64 * 64 * 64 * 64) or [()]) == threads
        try:
            ta, tb = engine.tensor(a, requires_grad=True), engine.tensor(b, requires_grad=True)
            y = ta @ tb
            y.sum().backward()
            results.append((y.numpy(), ta.grad.numpy(), tb.grad.numpy()))
        finally:
            cpu_threads.set_threads(None)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("shapes,message", [
    (((2, 3, 4), (5, 2)), "inner dimensions differ"),
    (((2, 3, 4), (3, 4, 2)), "do not broadcast"),
    (((), (3,)), "at least 1 dim")], ids=str)
def test_matmul_rejects_bad_shapes_naming_them(shapes, message):
    a, b = (engine.tensor(np.ones(s)) for s in shapes)
    with pytest.raises(ValueError, match=message):
        a @ b


# ------------------------------------------------------------------ real GPU, every tiling

FMA_TILINGS = ["LARGE", "MEDIUM", "SMALL", "COMPACT", "WIDE", "TALL"]


def _batched_on_gpu(a, b, trans_a, trans_b):
    from ops.device import to_device
    from ops.batched_matmul import batched_gemm
    stored_a = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if trans_a else a
    stored_b = np.ascontiguousarray(np.swapaxes(b, -1, -2)) if trans_b else b
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    with LaunchRecorder() as recorder:
        out = batched_gemm(to_device(stored_a.reshape((-1,) + stored_a.shape[-2:]), "cuda"),
                           to_device(stored_b.reshape((-1,) + stored_b.shape[-2:]), "cuda"),
                           batch, a.shape[:-2], b.shape[:-2], trans_a, trans_b)
    assert recorder.cuda_kernel_names() == ["gemm_batched_cuda"]
    return out.copy_to_host().reshape(batch + out.shape[-2:])


GPU_SHAPES = [((6, 257, 129), (6, 129, 131)),        # odd edges in every dim
              ((2, 1, 128, 256), (1, 3, 256, 128)),  # both broadcast, whole tiles
              ((300, 64), (48, 64, 64))]              # attention-sized, a shared


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", FMA_TILINGS)
@pytest.mark.parametrize("shapes", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
def test_gpu_batched_fma_tilings_against_float64(monkeypatch, tiling, shapes, trans_a,
                                                  trans_b):
    from ops.gemm import choices, tilings
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    count = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])))
    key = (a.shape[-2] * count, b.shape[-1], a.shape[-1], trans_a, trans_b)
    monkeypatch.setitem(choices.GEMM_CHOICES, key,
                        choices.GemmConfig(getattr(tilings, tiling), 1))
    got = _batched_on_gpu(a, b, trans_a, trans_b)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5 * a.shape[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("shapes", GPU_SHAPES + [((4, 512, 512), (4, 512, 512))], ids=str)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
def test_gpu_batched_tensor_cores_against_the_rounded_operands(precision, shapes, trans_a,
                                                                trans_b):
    """TF32 / bf16 (the pipelined tiling where the operands suit it, 512³ batches): the
    float64 product of the operands rounded as the tensor cores take them."""
    from ops.gemm.choices import mma_format
    from tests.support.rounded_operands import ROUNDING_OF_FORMAT, assert_product_of_rounded
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    before = engine.get_float32_matmul_precision()
    engine.set_float32_matmul_precision(precision)
    try:
        rounding = ROUNDING_OF_FORMAT[mma_format(np.float32)]
        got = _batched_on_gpu(a, b, trans_a, trans_b)
    finally:
        engine.set_float32_matmul_precision(before)
    ra, rb = (rounding(x).astype(np.float64) for x in (a, b))
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert_product_of_rounded(got, ra @ rb, magnitude, a.shape[-1], f"{precision} {shapes}")
