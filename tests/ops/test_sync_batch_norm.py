"""SyncBatchNorm (``ops.batch_norm``): BatchNorm whose training statistics are the global
batch's over the ranks of a data-parallel run, and nn.BatchNorm's choice of it.

The ranks here are threads of one process that exchange through a barrier (what
``engine.distributed`` does with MPI or NCCL), so the two-rank algorithm runs on the CPU and
in the CUDA simulator without mpiexec; tests/engine/test_distributed.py trains a CNN on two MPI
ranks against one process."""
import threading

import numpy as np
import pytest

import engine
from engine import distributed as dist
from engine import nn
from engine.autograd import apply
from ops.batch_norm import BatchNormOp, SyncBatchNormOp
from ops.cuda import SIMULATOR
from ops.device import copy_into, to_host
from tests.support.op_check import check_op
from tests.support.references import batch_norm_case


def _alone(array):
    """The in-place mean over the ranks of a world of one: the array itself."""


def _case(x_shape, training, parameters=2):
    return batch_norm_case(x_shape, training, parameters, op=SyncBatchNormOp,
                           name="sync_batch_norm", average=_alone, ranks=1)


# in a world of one it is BatchNorm: check_op's gradcheck, poison mode and CPU≡CUDA
CASES = [_case((3, 2, 5, 7), training=True), _case((5, 3), training=True, parameters=0),
         _case((2, 3, 3, 5), training=True, parameters=1),
         _case((5, 3), training=False, parameters=1)]


# the simulator takes 15-25 s a case: these two reach every branch of the sync kernels
SIMULATED_CASES = (CASES[0], CASES[1])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sync_batch_norm_alone_is_batch_norm(case, device):
    if device == "cuda" and SIMULATOR and case not in SIMULATED_CASES:
        pytest.skip("a case the CUDA simulator leaves to the CPU and a GPU")
    check_op(case, device)


class ThreadRanks:
    """``ranks`` ranks as threads: ``average_for(rank)`` is that rank's in-place mean over
    the ranks (MPI's sum, then times 1/ranks). One rank runs at a time (the lock ``turn``,
    released while a rank waits for the others): Numba's parallel CPU kernels and the CUDA
    simulator are not meant to be entered from two threads at once."""

    def __init__(self, ranks):
        self.ranks, self.turn = ranks, threading.Lock()
        self.barrier, self.deposits = threading.Barrier(ranks), [None] * ranks

    def average_for(self, rank):
        def average(array):
            self.deposits[rank] = to_host(array).copy()
            self.turn.release()
            self.barrier.wait()
            mean = np.sum(self.deposits, axis=0) * (1.0 / self.ranks)
            self.barrier.wait()   # every rank has read the deposits before the next ones
            self.turn.acquire()
            copy_into(array, mean.astype(array.dtype))
        return average

    def run(self, work):
        """``[work(rank) for each rank]``, the ranks running as threads."""
        results, errors = [None] * self.ranks, []

        def body(rank):
            with self.turn:
                try:
                    results[rank] = work(rank)
                except BaseException as error:   # re-raised below, in the test's thread
                    errors.append(error)
                    self.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def _step(op, x, g, running, weight, bias, device, **params):
    """One training forward and backward of ``op``; every value it gives, as host arrays."""
    tensors = [engine.tensor(a, device=device, requires_grad=True) for a in (x, weight, bias)]
    mean, var = (engine.tensor(a, device=device) for a in running)
    y = apply(op, tensors[0], mean, var, tensors[1], tensors[2], training=True, momentum=0.3,
              **params)
    y.backward(engine.tensor(g, device=device))
    return [y.numpy()] + [t.grad.numpy() for t in tensors] + [mean.numpy(), var.numpy()]


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 5)])
def test_two_ranks_compute_the_global_batch_s_batch_norm(device, shape):
    rng = np.random.default_rng(4)
    channels, half = shape[1], shape[0] // 2
    x, g = rng.normal(2, 3, size=shape), rng.normal(size=shape)
    weight, bias = rng.uniform(0.5, 2, channels), rng.normal(size=channels)
    running = (rng.normal(size=channels), rng.uniform(0.5, 2, channels))
    whole = _step(BatchNormOp, x, g, running, weight, bias, device)
    ranks = ThreadRanks(2)
    parts = ranks.run(lambda r: _step(
        SyncBatchNormOp, x[r * half:(r + 1) * half], g[r * half:(r + 1) * half], running,
        weight, bias, device, average=ranks.average_for(r), ranks=2))
    for r, part in enumerate(parts):
        rows = slice(r * half, (r + 1) * half)
        np.testing.assert_allclose(part[0], whole[0][rows], rtol=1e-12, atol=1e-12)   # y
        np.testing.assert_allclose(part[1], whole[1][rows], rtol=1e-10, atol=1e-12)   # dx
        for value, expected in zip(part[4:], whole[4:]):   # the running statistics
            np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-14)
    for k in (2, 3):   # dw and db: each rank's own sums, which add up to the whole batch's
        np.testing.assert_allclose(parts[0][k] + parts[1][k], whole[k], rtol=1e-12, atol=1e-12)
    alone = _step(BatchNormOp, x[:half], g[:half], running, weight, bias, device)
    assert np.abs(alone[1] - whole[1][:half]).max() > 1e-3   # a rank's own statistics differ


def test_batch_norm_layers_synchronise_only_in_training_with_several_ranks(monkeypatch):
    layer = nn.BatchNorm(input_shape=(3,), dtype=np.float64)
    layer.build((3,))
    x = engine.tensor(np.random.default_rng(0).normal(size=(4, 3)), requires_grad=True)
    assert layer(x)._node.op.name == "batch_norm"   # a world of one
    averaged = []
    monkeypatch.setattr(dist, "several_ranks", lambda: True)
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "average_across_ranks", averaged.append)
    node = layer(x)._node
    assert node.op.name == "sync_batch_norm" and node.op.ranks == 2 and len(averaged) == 2
    layer.training = False
    assert layer(x)._node.op.name == "batch_norm"   # eval: the running statistics
    layer.training = True
    unsynced = nn.BatchNorm(sync=False, input_shape=(3,), dtype=np.float64)
    unsynced.build((3,))
    assert unsynced(x)._node.op.name == "batch_norm"
    assert unsynced.get_config()["sync"] is False and "sync" not in layer.get_config()
    assert nn.BatchNorm(**{k: v for k, v in unsynced.get_config().items()
                           if k in ("sync", "momentum", "eps")}).sync is False


@pytest.mark.gpu
def test_two_ranks_on_the_gpu_at_the_cnn_s_shapes():
    """The network's BatchNorm shape (the reduction chunking, the grid of the dx kernel) on
    the H200, two ranks against the whole batch in float64."""
    rng = np.random.default_rng(5)
    shape, channels = (128, 64, 14, 14), 64
    x, g = rng.normal(1, 2, size=shape), rng.normal(size=shape)
    weight, bias = rng.uniform(0.5, 2, channels), rng.normal(size=channels)
    running = (np.zeros(channels), np.ones(channels))
    whole = _step(BatchNormOp, x, g, running, weight, bias, "cuda")
    ranks = ThreadRanks(2)
    parts = ranks.run(lambda r: _step(SyncBatchNormOp, x[r * 64:(r + 1) * 64],
                                      g[r * 64:(r + 1) * 64], running, weight, bias, "cuda",
                                      average=ranks.average_for(r), ranks=2))
    for r, part in enumerate(parts):
        rows = slice(r * 64, (r + 1) * 64)
        np.testing.assert_allclose(part[0], whole[0][rows], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(part[1], whole[1][rows], rtol=1e-8, atol=1e-10)
        for value, expected in zip(part[4:], whole[4:]):
            np.testing.assert_allclose(value, expected, rtol=1e-10, atol=1e-12)
    for k in (2, 3):
        np.testing.assert_allclose(parts[0][k] + parts[1][k], whole[k], rtol=1e-9, atol=1e-9)
