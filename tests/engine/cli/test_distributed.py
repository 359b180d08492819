"""``mpiexec -n 2 python -m engine.train --distributed``: two CPU ranks train as one process
with the same (global) --batch-size, rank 0 alone prints and writes, --resume works on every
rank, and every failure at the start is one line on stderr, on every rank's exit, with no
rank left waiting.

Skipped without mpi4py or mpiexec (``pip install -e '.[distributed]'``)."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import data
from engine import distributed as dist
from engine.checkpoint import read_checkpoint
from engine.train import main
from tests.support.distributed_ranks import MPI_TIMEOUT_S, mpiexec, needs_mpi
from tests.support.paths import REPO_ROOT

RUN = ["--limit", "512", "--batch-size", "64", "--hidden", "16", "--no-progress",
       "--device", "cpu"]


def _command(*rank_arguments):
    """An mpiexec command line: one rank per entry of ``rank_arguments`` (MPMD), or with a
    single entry two ranks of the same arguments."""
    train = [sys.executable, "-m", "engine.train", "--distributed"]
    if len(rank_arguments) == 1:
        return [mpiexec(), "-n", "2", *train, *rank_arguments[0]]
    command = [mpiexec()]
    for arguments in rank_arguments:
        command += ["-n", "1", *train, *arguments, ":"]
    return command[:-1]


def _run_ranks(*rank_arguments):
    return _run(_command(*rank_arguments))


def _run(command):
    """``(exit status, stdout, stderr)`` of ``command``'s ranks; past MPI_TIMEOUT_S every
    rank is killed and the test fails: a distributed run must end, never hang."""
    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    env.pop(dist.CHECK_REPLICAS_VARIABLE, None)
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=MPI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{' '.join(command)} still running after {MPI_TIMEOUT_S} s:\n{out}{err}")
    return process.returncode, out, err


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_training(distributed, single):
    """Records and weights of two runs that trained on the same global batches."""
    records, reference = _records(distributed[0]), _records(single[0])
    assert [r["epoch"] for r in records] == [r["epoch"] for r in reference]
    for record, expected in zip(records, reference):
        for key in ("loss", "train_acc", "test_loss", "test_acc"):
            assert record[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    trained, expected = read_checkpoint(distributed[1]), read_checkpoint(single[1])
    for name, value in expected["model"].items():
        np.testing.assert_allclose(trained["model"][name], value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)


@needs_mpi
def test_two_ranks_train_as_one_process_and_only_rank_0_speaks_and_writes(tmp_path, capsys):
    outputs = [tmp_path / name for name in ("run.jsonl", "run.npz", "run.onnx")]
    status, out, err = _run_ranks(RUN + ["--epochs", "2", "--log-json", str(outputs[0]),
                                         "--save", str(outputs[1]),
                                         "--export-onnx", str(outputs[2])])
    assert status == 0, out + err
    # the first run of a fresh checkout also says it compiles the kernels
    lines = [line for line in out.splitlines() if not line.startswith("compiling the engine's")]
    assert len(lines) == 5 and "(32 per rank on 2 ranks)" in lines[0], out
    assert lines[1].startswith("epoch 1/2") and lines[2].startswith("epoch 2/2")
    assert lines[3].startswith(f"model saved to {outputs[1]} (epoch 2)")
    assert lines[4].startswith(f"ONNX model written to {outputs[2]}")
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl", "run.npz", "run.onnx"]
    single = [tmp_path / "single.jsonl", tmp_path / "single.npz"]
    main(RUN + ["--epochs", "2", "--log-json", str(single[0]), "--save", str(single[1])])
    _assert_same_training(outputs[:2], single)


@needs_mpi
def test_two_ranks_train_the_cnn_as_one_process(tmp_path, capsys):
    """--distributed synchronises BatchNorm (on by default): the CNN's records and weights,
    running statistics included, are the one-process run's with the same global batch. (SGD:
    Adam scales the float32 rounding of a near-zero gradient up, 3 of the Dense layer's
    401408 weights 2.6e-3 apart after 4 steps.)"""
    cnn = RUN + ["--model", "cnn", "--limit", "256", "--epochs", "1", "--optimizer", "sgd"]
    outputs = [tmp_path / "run.jsonl", tmp_path / "run.npz"]
    status, out, err = _run_ranks(cnn + ["--log-json", str(outputs[0]), "--save",
                                         str(outputs[1])])
    assert status == 0, out + err
    single = [tmp_path / "single.jsonl", tmp_path / "single.npz"]
    main(cnn + ["--log-json", str(single[0]), "--save", str(single[1])])
    assert "batchnorm.running_var" in read_checkpoint(single[1])["model"]
    _assert_same_training(outputs, single)


@needs_mpi
def test_every_rank_resumes_the_checkpoint(tmp_path, capsys):
    log, checkpoint = tmp_path / "run.jsonl", tmp_path / "run.npz"
    for epochs in ("1", "2"):
        resume = ["--resume", str(checkpoint)] if epochs == "2" else ["--save", str(checkpoint)]
        status, out, err = _run_ranks(RUN + ["--epochs", epochs, "--log-json", str(log)]
                                      + resume)
        assert status == 0, out + err
    assert "resuming after epoch 1" in out and read_checkpoint(checkpoint)["epoch"] == 2
    single = [tmp_path / "single.jsonl", tmp_path / "single.npz"]
    main(RUN + ["--epochs", "2", "--log-json", str(single[0]), "--save", str(single[1])])
    _assert_same_training((log, checkpoint), single)


def _other_mnist(tmp_path):
    """A data folder holding MNIST's first samples with inverted images: the same shapes as
    --limit takes from the shipped set, other pixels."""
    (x_train, y_train), (x_test, y_test) = data.mnist.load()
    folder = tmp_path / "inverted-mnist"
    folder.mkdir()
    for prefix, images, labels in (("train", x_train[:600], y_train[:600]),
                                   ("t10k", x_test[:600], y_test[:600])):
        data.write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", 255 - images)
        data.write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return str(folder)


START_FAILURES = [
    ("ranks that disagree on an argument", lambda tmp_path: (RUN, RUN + ["--hidden", "8"]),
     "engine-train: error: rank 1 disagrees with rank 0 on --hidden: '8' on rank 1, '16' on "
     "rank 0"),
    ("a rank whose arguments do not parse", lambda tmp_path: (RUN, RUN + ["--epochs", "x"]),
     "rank 1: engine-train: error: argument --epochs: invalid int value: 'x' (see --help)"),
    ("ranks that load different data", lambda tmp_path: (RUN, RUN + ["--data-dir",
                                                                      _other_mnist(tmp_path)]),
     "engine-train: error: rank 1 disagrees with rank 0 on the data"),
    ("a rank that cannot load its data", lambda tmp_path: (RUN, RUN + ["--data-dir",
                                                                        "/nonexistent"]),
     "rank 1: engine-train: error: cannot load mnist from /nonexistent"),
    ("a bad input on every rank", lambda tmp_path: (RUN + ["--epochs", "0"],),
     "engine-train: error: --epochs must be a positive integer, got 0"),
    ("a global batch that does not split", lambda tmp_path: (RUN + ["--batch-size", "63"],),
     "engine-train: error: --batch-size 63: with --distributed it is the global batch, split "
     "evenly over the ranks; give a multiple of 2"),
]


@needs_mpi
@pytest.mark.parametrize("rank_arguments, message", [case[1:] for case in START_FAILURES],
                         ids=[case[0] for case in START_FAILURES])
def test_a_failed_start_is_one_line_from_one_rank(tmp_path, rank_arguments, message):
    status, out, err = _run_ranks(*rank_arguments(tmp_path))
    assert status == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert "epoch 1/" not in out


@needs_mpi
def test_mpiexec_without_distributed_is_one_line_not_two_lone_runs(tmp_path):
    status, out, err = _run([mpiexec(), "-n", "2", sys.executable, "-m", "engine.train", *RUN,
                             "--save", str(tmp_path / "run.npz")])
    assert status == 2 and err.strip().splitlines() == [
        "engine-train: error: this is one of 2 processes started by mpiexec: add --distributed "
        "to train data-parallel (without it every process trains alone)"], out + err
    assert not os.listdir(tmp_path)


@needs_mpi
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_rank_0_cannot_write_ends_every_rank_before_training(tmp_path):
    """rank 0 alone checks the outputs; /dev/full (a device, which the engine never writes
    over) is refused there, and the ranks' failure count ends rank 1 at the same point, before
    any training."""
    status, out, err = _run_ranks(RUN + ["--epochs", "3", "--log-json", "/dev/full",
                                         "--no-save"])
    assert status == 2, out + err
    lines = err.strip().splitlines()
    assert lines[0].startswith("rank 0: engine-train: error: --log-json /dev/full: cannot be "
                               "written (/dev/full is a character device"), err
    assert "Traceback" not in err and "epoch 1/3" not in out


def test_an_abort_waits_until_its_last_lines_were_read():
    """The flaky run above: rank 0's line was lost when mpiexec handled the abort before it
    had read rank 0's stderr. abort now returns to MPI_Abort only once its pipes are read."""
    read_end, write_end = os.pipe()
    line = b"engine-train: error: the line that must arrive\n"
    os.write(write_end, line)
    received = []
    reader = threading.Thread(target=lambda: received.append(os.read(read_end, 4096)))
    with os.fdopen(write_end, "wb", closefd=False) as stream:
        assert dist._unread_bytes(write_end) == len(line)
        reader.start()
        dist.wait_until_read(stream, limit_s=60)
        assert dist._unread_bytes(write_end) == 0   # returned because the line was read
        reader.join()
        assert received == [line]
        os.write(write_end, b"nobody reads this")
        dist.wait_until_read(stream, limit_s=0.01)   # a reader that stopped: bounded
        assert dist._unread_bytes(write_end) == len(b"nobody reads this")
    os.close(read_end)
    os.close(write_end)


def test_distributed_without_mpi4py_is_one_line(monkeypatch, capsys):
    for name in dist.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "_world", None)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "mpi4py" else find_spec(name, *rest))
    with pytest.raises(SystemExit) as exit_info:
        main(RUN + ["--epochs", "1", "--distributed"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip().splitlines() == [
        "engine-train: error: --distributed: engine.distributed.init: a distributed run needs "
        "mpi4py, which is not installed; pip install -e '.[distributed]'"]


def test_distributed_without_mpiexec_is_a_world_of_one(monkeypatch, tmp_path, capsys):
    pytest.importorskip("mpi4py")
    for name in dist.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "_world", None)
    alone, plain = tmp_path / "alone.jsonl", tmp_path / "plain.jsonl"
    main(RUN + ["--epochs", "1", "--distributed", "--log-json", str(alone), "--no-save"])
    main(RUN + ["--epochs", "1", "--log-json", str(plain), "--no-save"])
    assert [(r["loss"], r["test_loss"]) for r in _records(alone)] == \
        [(r["loss"], r["test_loss"]) for r in _records(plain)]
