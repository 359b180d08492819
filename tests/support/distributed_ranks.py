"""The 2-rank runs of the data-parallel tests: what each rank runs (this module's
``__main__``: ``python -m tests.support.distributed_ranks SCENARIO OUT``, started by mpiexec,
srun or torchrun), what one process with the global batch computes, and how the tests start
ranks and wait for them (never forever). ``tests/engine/test_distributed.py``,
``tests/engine/test_launchers.py`` and ``tests/engine/cli/test_distributed.py`` use it."""
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import data
import engine
import optim
from engine import distributed as dist
from engine import nn
from engine.losses import cross_entropy
from tests.support.paths import REPO_ROOT

SAMPLES, FEATURES, CLASSES = 100, 12, 3
PER_RANK_BATCH, RANKS, EPOCHS, SEED = 8, 2, 2, 5
RANK_SEED = 100   # rank r builds its model from seed RANK_SEED + r: broadcast_model must fix it
MPI_TIMEOUT_S = 240   # a run that takes longer hangs: the test fails, never waits forever


def mpiexec():
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH, or None."""
    beside = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or mpiexec() is None,
    reason="needs mpi4py and mpiexec: pip install -e '.[distributed]'")


def indexed_set(samples=SAMPLES):
    """Features whose first column is the sample's index, so a batch says which rows it has."""
    x = np.random.default_rng(0).normal(size=(samples, FEATURES))
    x[:, 0] = np.arange(samples)
    y = np.random.default_rng(1).integers(0, CLASSES, samples)
    return x, y


def small_model(dtype=np.float64, hidden=16):
    return nn.Sequential([nn.Dense(hidden, activation="relu", dtype=dtype,
                                   input_shape=(FEATURES,)),
                          nn.Dense(CLASSES, dtype=dtype)])


def finish(processes, command):
    """Each process's ``(exit status, output)``; past MPI_TIMEOUT_S all are killed and the
    test fails: ranks must end, never hang."""
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=MPI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in processes:
                os.killpg(other.pid, signal.SIGKILL)
            outputs = "".join(other.communicate()[0] or "" for other in processes)
            pytest.fail(f"{command} still running after {MPI_TIMEOUT_S} s:\n{outputs}")
        results.append((process.returncode, output))
    return results


def run_ranks(scenario, out, ranks=RANKS, replica_interval=None):
    """Run this module's ``__main__`` as ``scenario`` on ``ranks`` MPI ranks; returns
    ``(exit status, stdout + stderr)``."""
    env = dict(os.environ)
    env.pop(dist.CHECK_REPLICAS_VARIABLE, None)
    if replica_interval is not None:
        env[dist.CHECK_REPLICAS_VARIABLE] = str(replica_interval)
    command = [mpiexec(), "-n", str(ranks), sys.executable, "-m",
               "tests.support.distributed_ranks", scenario, str(out)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return finish([process], " ".join(command))[0]


def _train_single_process(device="cpu"):
    """What one process with batch RANKS * PER_RANK_BATCH computes, from rank 0's model."""
    x, y = indexed_set()
    engine.manual_seed(RANK_SEED)
    model = small_model().to(device)
    initial = model.state_dict()
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    loader = data.DataLoader(x, y, batch_size=RANKS * PER_RANK_BATCH, shuffle=True,
                             seed=SEED, device=device)
    for _ in range(EPOCHS):
        for xb, yb in loader:
            optimizer.zero_grad()
            cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return initial, model.state_dict()


def assert_trains_as_one_process(out, device):
    initial, expected = _train_single_process(device)
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(RANKS)]
    for weights in ranks:   # ranks 0 and 1 passed [0, 1] and [1, 11]
        np.testing.assert_array_equal(weights.pop("rank_means"), [0.5, 6.0])
    for name, value in expected.items():
        assert np.abs(value - initial[name]).max() > 1e-3, "training did not move the weights"
        for weights in ranks:
            np.testing.assert_allclose(weights[name], value, rtol=1e-9, atol=1e-12,
                                       err_msg=name)
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name])   # replicas: bit equal


IMAGE = (1, 6, 6)


def image_set(samples=SAMPLES):
    x = np.random.default_rng(2).normal(size=(samples,) + IMAGE)
    y = np.random.default_rng(3).integers(0, CLASSES, samples)
    return x, y


def cnn(sync=True):
    """Both BatchNorm forms: over the channels of (N, C, H, W) and the features of (N, F)."""
    return nn.Sequential([
        nn.Conv2D(3, 3, padding="same", activation="relu", dtype=np.float64, input_shape=IMAGE),
        nn.BatchNorm(dtype=np.float64, sync=sync), nn.MaxPool2D(2), nn.Flatten(),
        nn.Dense(8, activation="relu", dtype=np.float64), nn.BatchNorm(dtype=np.float64, sync=sync),
        nn.Dense(CLASSES, dtype=np.float64)])


def train_cnn(model, loader):
    # SGD, not Adam: the bias of a Dense unit that the ReLU always passes gets no gradient
    # (the BatchNorm after it removes any shift), and Adam scales the rounding noise that
    # stands for that zero up to steps of 1e-10 (measured: 5.4e-10 apart after 14 steps)
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        for xb, yb in loader:
            optimizer.zero_grad()
            cross_entropy(model(xb), yb).backward()
            if dist.is_initialized():
                dist.all_reduce_gradients(model)
            optimizer.step()
    return model.state_dict()


# ------------------------------------------------------------------ what each rank runs

def _rank_trains(device, out):
    """The data-parallel loop of one rank; writes its final weights to ``rank{r}.npz``."""
    dist.init(device=device)
    x, y = indexed_set()
    engine.manual_seed(RANK_SEED + dist.rank())
    model = dist.broadcast_model(small_model().to(device))
    optimizer = optim.Adam(model.parameters(), lr=0.01)
    loader = data.DataLoader(x, y, batch_size=PER_RANK_BATCH, shuffle=True, seed=SEED,
                             device=device, shard=(dist.rank(), dist.world_size()))
    for _ in range(EPOCHS):
        for xb, yb in loader:
            optimizer.zero_grad()
            cross_entropy(model(xb), yb).backward()
            dist.all_reduce_gradients(model)
            optimizer.step()
    np.savez(out / f"rank{dist.rank()}.npz", **model.state_dict(),
             rank_means=dist.mean_over_ranks([dist.rank(), 10 * dist.rank() + 1]))


def _rank_trains_a_cnn(out):
    """The data-parallel CNN loop, with synchronised BatchNorm and (as a control) without."""
    dist.init()
    x, y = image_set()
    for sync, name in ((True, f"rank{dist.rank()}.npz"),
                       (False, f"rank{dist.rank()}-unsynced.npz")):
        engine.manual_seed(RANK_SEED + dist.rank())
        model = dist.broadcast_model(cnn(sync))
        loader = data.DataLoader(x, y, batch_size=PER_RANK_BATCH, shuffle=True, seed=SEED,
                                 shard=(dist.rank(), dist.world_size()))
        np.savez(out / name, **train_cnn(model, loader))


def _rank_meets_a_nan_loss(out):
    import contextlib
    import io
    from engine import callbacks
    from engine.fit import fit

    class PoisonRank1(callbacks.Callback):
        def on_epoch_begin(self, logs):
            if logs["epoch"] == 2 and dist.rank() == 1:
                self.run.model.parameters()[0].detach()[0, 0] = np.nan

    dist.init()
    x, y = indexed_set()
    model = dist.broadcast_model(small_model())
    loader = data.DataLoader(x, y, batch_size=PER_RANK_BATCH, shuffle=True, seed=SEED,
                             shard=(dist.rank(), dist.world_size()))
    terminate = callbacks.TerminateOnNaN()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = fit(model, loader, optim.SGD(model.parameters(), lr=0.1), cross_entropy, 3,
                      callbacks=[PoisonRank1(), terminate], progress=False, verbose=False,
                      distributed=True)
    (out / f"rank{dist.rank()}.txt").write_text(
        f"{terminate.stopped_epoch} {terminate.stopped_step} {len(history)}\n"
        + printed.getvalue())


def _report_mismatch(out, step):
    """Run ``step``; write the RankMismatch it must raise to ``rank{r}.txt``."""
    try:
        step()
    except dist.RankMismatch as mismatch:
        (out / f"rank{dist.rank()}.txt").write_text(f"{mismatch.rank}: {mismatch}")
        return
    raise AssertionError("no RankMismatch")


def _rank_diverges(out):
    """Rank 1 nudges one weight after step 2; the check before step 3 must catch it."""
    dist.init()
    x, y = indexed_set()
    model = dist.broadcast_model(small_model())
    optimizer = optim.SGD(model.parameters(), lr=0.1)

    def train():
        for step in range(5):
            if step == 2 and dist.rank() == 1:
                model.flat_buffers()[0].data[0] += 1e-6
            optimizer.zero_grad()
            cross_entropy(model(engine.tensor(x[:8], dtype=np.float64)), y[:8]).backward()
            dist.all_reduce_gradients(model)
            optimizer.step()

    _report_mismatch(out, train)


def _rank_builds_its_own_model(out):
    dist.init()
    model = nn.Sequential([nn.Dense(16 + dist.rank(), input_shape=(FEATURES,))])
    _report_mismatch(out, lambda: dist.broadcast_model(model))


def _rank_dies(out):
    dist.init()
    model = dist.broadcast_model(small_model())
    x, y = indexed_set()
    if dist.rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    cross_entropy(model(engine.tensor(x[:8], dtype=np.float64)), y[:8]).backward()
    dist.all_reduce_gradients(model)   # waits for rank 1 until its abort ends the run
    (out / "rank0.txt").write_text("past the all-reduce")


SCENARIOS = {"train-cpu": lambda out: _rank_trains("cpu", out),
             "train-cuda": lambda out: _rank_trains("cuda", out),
             "train-cnn-cpu": _rank_trains_a_cnn,
             "terminate-on-nan": _rank_meets_a_nan_loss,
             "diverge": _rank_diverges, "mismatch": _rank_builds_its_own_model,
             "die": _rank_dies}

if __name__ == "__main__":
    scenario, out_dir = sys.argv[1:]
    SCENARIOS[scenario](pathlib.Path(out_dir))
