"""Data-parallel training: sharded loading (no MPI needed), a world of one, and 2-rank runs.

The 2-rank tests start ``mpiexec -n 2 python -m tests.support.distributed_ranks SCENARIO OUT``
(what each rank runs) and are skipped when mpi4py or mpiexec is missing
(``pip install -e '.[distributed]'`` brings both). The ``gpu`` tests need a real GPU, NCCL
and nccl4py; the 2-GPU one also needs a second GPU.
"""
import importlib.util
import sys

import numpy as np
import pytest

import data
import engine
from engine import distributed as dist
from engine.losses import cross_entropy
from tests.support.distributed_ranks import (PER_RANK_BATCH, RANKS, RANK_SEED, SAMPLES, SEED,
                                             assert_trains_as_one_process, cnn, image_set,
                                             indexed_set, needs_mpi, run_ranks, small_model,
                                             train_cnn)


# ------------------------------------------------------------------ sharded loading

def _rows(batch):
    return batch[0].numpy()[:, 0].astype(np.int64).tolist()


def _rank_batches(ranks, batch_size, samples=SAMPLES, **options):
    """Per rank, the list of each step's sample indices, over one epoch."""
    x, y = indexed_set(samples)
    return [[_rows(b) for b in data.DataLoader(x, y, batch_size=batch_size, seed=SEED,
                                                 shard=(r, ranks), **options)]
            for r in range(ranks)]


@pytest.mark.parametrize("ranks, batch_size", [(2, 8), (3, 8), (4, 25), (2, 50), (3, 1)])
def test_shards_are_one_process_global_batches_split_by_rank(ranks, batch_size):
    """Step i on all ranks together is step i of one loader with batch ranks * batch_size."""
    x, y = indexed_set()
    whole = [_rows(b) for b in data.DataLoader(x, y, batch_size=ranks * batch_size,
                                                shuffle=True, seed=SEED)]
    per_rank = _rank_batches(ranks, batch_size, shuffle=True)
    full_steps = SAMPLES // (ranks * batch_size)
    for step in range(full_steps):
        assert sum((per_rank[r][step] for r in range(ranks)), []) == whole[step]
        assert all(len(per_rank[r][step]) == batch_size for r in range(ranks))


@pytest.mark.parametrize("samples, ranks, batch_size", [(100, 2, 8), (100, 3, 8), (10, 3, 4),
                                                        (7, 4, 2), (2, 3, 5), (96, 2, 8)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_disjoint_cover_the_epoch_and_give_every_rank_as_many_batches(
        samples, ranks, batch_size, drop_last):
    per_rank = _rank_batches(ranks, batch_size, samples, shuffle=True, drop_last=drop_last)
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"batch counts per rank differ: {counts}"
    x, y = indexed_set(samples)
    loaders = [data.DataLoader(x, y, batch_size=batch_size, shard=(r, ranks),
                               drop_last=drop_last) for r in range(ranks)]
    assert {len(loader) for loader in loaders} == counts
    taken = [i for batches in per_rank for batch in batches for i in batch]
    step = ranks * batch_size
    full = samples // step * step
    if drop_last:   # every full global batch, once; the rest dropped
        assert len(taken) == len(set(taken)) == full
        return
    rest = samples - full
    padding = -rest % ranks
    assert sorted(set(taken)) == list(range(samples))   # covers the epoch
    assert len(taken) == samples + padding               # each once, but the padding
    for batches in per_rank:   # a last partial step: every rank takes ceil(rest / ranks)
        assert all(len(b) == batch_size for b in batches[:full // step])
        assert all(len(b) == -(-rest // ranks) for b in batches[full // step:])


def test_padding_repeats_the_first_samples_of_the_epoch():
    """10 samples, 3 ranks of 4: the one global batch has 12 places; the last 2 repeat the
    epoch's first two samples, on the last rank."""
    x, y = indexed_set(10)
    order = data.DataLoader(x, y, batch_size=4, shuffle=True, seed=SEED).order(0).tolist()
    per_rank = _rank_batches(3, 4, 10, shuffle=True)
    assert per_rank == [[order[0:4]], [order[4:8]], [order[8:10] + order[0:2]]]


def test_shards_reshuffle_per_epoch_alike_on_every_rank_and_resume(device):
    x, y = indexed_set()

    def epochs(rank, count, start=0):
        loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=SEED,
                                 shard=(rank, 2), device=device)
        loader.epoch = start
        return [[_rows(b) for b in loader] for _ in range(count)]

    rank0, rank1 = epochs(0, 2), epochs(1, 2)
    assert rank0[0] != rank0[1]   # a new permutation each epoch
    for epoch in range(2):   # same permutation on both ranks: their shards stay disjoint
        assert not set(sum(rank0[epoch], [])) & set(sum(rank1[epoch], []))
    assert epochs(0, 1, start=1) == rank0[1:]


def test_unsharded_loader_is_shard_zero_of_one():
    x, y = indexed_set()
    plain = [_rows(b) for b in data.DataLoader(x, y, batch_size=8, shuffle=True, seed=SEED)]
    assert _rank_batches(1, 8, shuffle=True) == [plain]


@pytest.mark.parametrize("shard, error, words", [
    ((2, 2), ValueError, "0 <= rank < world_size"), ((-1, 2), ValueError, "0 <= rank"),
    ((0, 0), ValueError, "world_size >= 1"), ((0,), ValueError, "pair (rank, world_size)"),
    (3, ValueError, "pair (rank, world_size)"), ((0.0, 2), TypeError, "integers"),
    ((True, 2), TypeError, "integers")])
def test_bad_shard_is_refused_by_name(shard, error, words):
    x, y = indexed_set()
    with pytest.raises(error, match="shard") as raised:
        data.DataLoader(x, y, batch_size=8, shard=shard)
    assert words in str(raised.value)


def test_a_sharded_shuffled_loader_needs_a_seed():
    x, y = indexed_set()
    with pytest.raises(ValueError, match="needs seed=.*same on every rank"):
        data.DataLoader(x, y, batch_size=8, shuffle=True, shard=(0, 2))


# ------------------------------------------------------------------ a world of one

@pytest.fixture
def world_of_one(monkeypatch):
    """A fresh, uninitialised world in a process that mpiexec did not start."""
    for name in dist.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(dist.CHECK_REPLICAS_VARIABLE, raising=False)
    monkeypatch.setattr(dist, "_world", None)


def _gradients(model):
    return [np.array(buffer.grad) for buffer in model.flat_buffers()]


def _one_backward(model, device="cpu"):
    x, y = indexed_set()
    model.to(device)
    cross_entropy(model(engine.tensor(x[:16], dtype=np.float64, device=device)),
                  y[:16]).backward()


def test_a_world_of_one_needs_no_mpiexec_and_changes_nothing(world_of_one, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)   # not even imported
    dist.init()
    assert (dist.rank(), dist.world_size()) == (0, 1)
    model = small_model()
    weights = model.state_dict()
    assert dist.broadcast_model(model) is model
    _one_backward(model)
    before = _gradients(model)
    dist.all_reduce_gradients(model)
    for old, new in zip(before, _gradients(model)):
        np.testing.assert_array_equal(old, new)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, weights[name])
    dist.check_replicas(model)
    dist.check_agreement("a number", 3)
    assert dist.mean_over_ranks([0.25, 3]) == [0.25, 3.0]


def test_nothing_runs_before_init(world_of_one):
    for call in (dist.rank, dist.world_size, lambda: dist.all_reduce_gradients(small_model())):
        with pytest.raises(RuntimeError, match=r"init\(\) first"):
            call()


def test_a_distributed_run_without_mpi4py_fails_at_init(world_of_one, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None)
    with pytest.raises(RuntimeError, match=r"needs mpi4py.*\[distributed\]"):
        dist.init(require_mpi=True)


def test_mpiexec_without_mpi4py_fails_at_init(world_of_one, monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match="started by mpiexec.*mpi4py"):
        dist.init()


@pytest.mark.parametrize("value", ["yes", "-1", "1.5"])
def test_a_bad_replica_interval_is_named(world_of_one, monkeypatch, value):
    monkeypatch.setenv(dist.CHECK_REPLICAS_VARIABLE, value)
    with pytest.raises(ValueError, match=f"{dist.CHECK_REPLICAS_VARIABLE}='{value}'"):
        dist.init()


def test_init_refuses_an_unknown_device(world_of_one):
    with pytest.raises(ValueError, match="unknown device"):
        dist.init(device="tpu")


# ------------------------------------------------------------------ 2 ranks (mpiexec)

@needs_mpi
def test_two_cpu_ranks_train_exactly_as_one_process_with_the_global_batch(tmp_path):
    status, output = run_ranks("train-cpu", tmp_path, replica_interval=1)
    assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cpu")


@needs_mpi
def test_two_cpu_ranks_train_a_cnn_with_batch_norm_as_one_process(tmp_path):
    """SyncBatchNorm: the ranks' BatchNorm statistics are the global batch's, so weights and
    running statistics are the one-process run's on the doubled batch; with each rank's own
    statistics (sync=False, what every rank computed before) they are not."""
    status, output = run_ranks("train-cnn-cpu", tmp_path, replica_interval=1)
    assert status == 0, output
    x, y = image_set()
    engine.manual_seed(RANK_SEED)
    model = cnn()
    initial = model.state_dict()
    expected = train_cnn(model, data.DataLoader(x, y, batch_size=RANKS * PER_RANK_BATCH,
                                                 shuffle=True, seed=SEED))
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(RANKS)]
    unsynced = dict(np.load(tmp_path / "rank0-unsynced.npz"))
    assert any(name.endswith("running_var") for name in expected)
    for name, value in expected.items():
        assert np.abs(value - initial[name]).max() > 1e-3, f"{name} did not move"
        for weights in ranks:
            np.testing.assert_allclose(weights[name], value, rtol=1e-9, atol=1e-12,
                                       err_msg=name)
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name])   # replicas: bit equal
    worst = max(np.abs(unsynced[name] - value).max() for name, value in expected.items())
    assert worst > 1e-4, worst


@needs_mpi
def test_terminate_on_nan_stops_every_rank_at_the_same_step(tmp_path):
    """Rank 1 alone sees the first NaN loss (its weights poisoned as epoch 2 begins): the
    ranks agree at the check, so rank 0 stops at that step too instead of waiting in the
    next all-reduce."""
    status, output = run_ranks("terminate-on-nan", tmp_path)
    assert status == 0, output
    stops = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(RANKS)]
    assert stops[0][0] == stops[1][0] == "2 0 1", stops   # epoch 2, step 0; 1 epoch recorded
    assert stops[0][1] == ("terminate on NaN: another rank's training loss is non-finite at "
                           "epoch 2, step 0; training stopped, that epoch is not recorded and "
                           "no checkpoint of it is written")
    assert stops[1][1].startswith("terminate on NaN: the training loss is nan on rank 1 at "
                                  "epoch 2, step 0;")


@needs_mpi
def test_diverged_replicas_are_caught_naming_the_rank(tmp_path):
    status, output = run_ranks("diverge", tmp_path, replica_interval=3)
    assert status == 0, output
    for r in range(RANKS):   # every rank raised the same error, so none waits for another
        message = (tmp_path / f"rank{r}.txt").read_text()
        assert message.startswith("1: rank 1 disagrees with rank 0 on the parameters after 3 "
                                  "step(s) (the replicas have diverged; CRC-32 of each flat "
                                  "buffer): ["), message


@needs_mpi
def test_ranks_that_build_different_models_fail_at_the_broadcast(tmp_path):
    status, output = run_ranks("mismatch", tmp_path)
    assert status == 0, output
    for r in range(RANKS):
        message = (tmp_path / f"rank{r}.txt").read_text()
        assert message.startswith("1: rank 1 disagrees with rank 0 on the model"), message
        assert "(12, 17)" in message and "(12, 16)" in message


@needs_mpi
def test_a_rank_that_dies_ends_the_run_instead_of_hanging_it(tmp_path):
    status, output = run_ranks("die", tmp_path)
    assert status != 0
    assert "ValueError: rank 1 fails on purpose" in output
    assert not (tmp_path / "rank0.txt").exists()   # rank 0 never got past the all-reduce


# ------------------------------------------------------------------ GPUs (NCCL)

@pytest.mark.gpu
def test_a_one_rank_nccl_world_averages_and_broadcasts_on_the_gpu(world_of_one):
    pytest.importorskip("nccl.core", reason="needs nccl4py: pip install -e '.[distributed]'")
    dist.init(device="cuda")
    assert dist._world.nccl is not None and dist._world.nccl.nranks == 1
    model = small_model()
    _one_backward(model, "cuda")
    weights = model.state_dict()
    before = [buffer.grad.copy_to_host() for buffer in model.flat_buffers()]
    dist.broadcast_model(model)
    dist.all_reduce_gradients(model)
    for old, buffer in zip(before, model.flat_buffers()):
        np.testing.assert_array_equal(buffer.grad.copy_to_host(), old)   # the mean of one
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, weights[name])
    dist.check_replicas(model)


@pytest.mark.gpu
@needs_mpi
def test_two_gpu_ranks_train_exactly_as_one_process_with_the_global_batch(tmp_path):
    from ops.cuda import cuda
    if len(cuda.gpus) < RANKS:
        pytest.skip(f"needs {RANKS} GPUs (NCCL refuses two ranks on one GPU)")
    status, output = run_ranks("train-cuda", tmp_path, replica_interval=1)
    assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cuda")


