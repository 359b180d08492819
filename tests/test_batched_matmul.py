"""matmul with torch.matmul's rules on every backend: 1-D operands, (..., K) @ (K, N), and
batched products whose batch dims broadcast, through one batched GEMM launch
(``ops.gemm.plans.batched_gemm_plan``) and its transposed products in the backward.

torch.matmul is the oracle; the simulator's shapes are tiny and odd (they straddle its 4x4
tiles), with batch dims that broadcast on either side, in the middle and at the front."""
import numpy as np
import pytest
import torch

import engine
from ops import cpu_threads
from ops.cpu_threads import row_blocks
from ops.gemm.plans import batch_meta
from ops.launch import LaunchRecorder
from tests.op_check import Case, check_op


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
