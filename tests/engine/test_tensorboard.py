"""callbacks.TensorBoard and ``--tensorboard DIR``: event files that TensorBoard's own reader
(``EventAccumulator``) reads back with the records of ``fit``, the learning rate of each
epoch and the training loss every ``update_freq`` steps.

Needs tensorboardX (the writer: formats and test extras) and tensorboard (the reader: the
test extra); skipped without them."""
import copy
import sys

import numpy as np
import pytest

import data
import optim
from engine import callbacks, nn
from engine.fit import fit
from engine.losses import cross_entropy
from engine.train import main

pytest.importorskip("tensorboardX", reason="needs tensorboardX: pip install -e '.[formats]'")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="needs tensorboard (the reader): pip install -e '.[test]'")


def _scalars(log_dir):
    """``{tag: [(step, value), ...]}`` of every scalar in the event files of ``log_dir``."""
    reader = event_accumulator.EventAccumulator(str(log_dir))
    reader.Reload()
    return {tag: [(event.step, event.value) for event in reader.Scalars(tag)]
            for tag in reader.Tags()["scalars"]}


def _blobs():
    x, y = data.blobs(40, centers=3, seed=0)   # 5 batches of 8
    train = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=0)
    test = data.DataLoader(x, y, batch_size=20)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    return model, train, test


def test_epoch_records_learning_rates_and_step_losses_read_back(tmp_path):
    model, train, test = _blobs()
    opt = optim.SGD(model.parameters(), lr=0.2)
    scheduler = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    board = callbacks.TensorBoard(tmp_path / "logs", update_freq=2)
    step_losses = []
    history = fit(model, train, opt, cross_entropy, 3, test_loader=test, scheduler=scheduler,
                  callbacks=[board], progress=False, verbose=False, step_losses=step_losses)
    scalars = _scalars(tmp_path / "logs")
    assert set(scalars) == {f"epoch/{key}" for key in history[0] if key != "epoch"} | {
        "epoch/learning_rate", "batch/loss"}
    for key in ("loss", "train_acc", "test_loss", "test_acc", "samples_per_s"):
        assert [step for step, _ in scalars[f"epoch/{key}"]] == [1, 2, 3]
        np.testing.assert_allclose([value for _, value in scalars[f"epoch/{key}"]],
                                   [record[key] for record in history], rtol=1e-6)
    assert [step for step, _ in scalars["epoch/learning_rate"]] == [1, 2, 3]
    np.testing.assert_allclose([value for _, value in scalars["epoch/learning_rate"]],
                               [0.2, 0.1, 0.05], rtol=1e-7)   # stored as float32
    # 15 steps over the run, one loss every 2: steps 2, 4, ..., 14
    losses = np.concatenate(step_losses)
    assert [step for step, _ in scalars["batch/loss"]] == list(range(2, 15, 2))
    np.testing.assert_allclose([value for _, value in scalars["batch/loss"]],
                               losses[1:14:2], rtol=1e-6)
    assert board.writer is None   # closed when training ended


def test_replays_of_several_steps_log_the_loss_once_per_interval(tmp_path):
    """The captured step replays up to update_freq steps at once, within an epoch: each
    multiple of update_freq passed gets one point, the loss of the replay's last step."""
    model, train, _ = _blobs()
    fit(model, train, optim.SGD(model.parameters(), lr=0.1), cross_entropy, 2,
        callbacks=[callbacks.TensorBoard(tmp_path, update_freq=3)], progress=False,
        verbose=False)
    steps = [step for step, _ in _scalars(tmp_path)["batch/loss"]]
    # 5 steps an epoch: replays end at steps 3, 5 | 8, 10, passing 3, -, 6, 9
    assert steps == [3, 8, 10]


def test_epoch_only_logging_leaves_the_steps_unwatched(tmp_path):
    board = callbacks.TensorBoard(tmp_path)
    assert type(board) is callbacks.TensorBoard   # no on_step_end: fit replays unwatched
    assert "on_step_end" not in vars(callbacks.TensorBoard)
    steps = callbacks.TensorBoard(tmp_path, "batch")
    assert isinstance(steps, callbacks.TensorBoard) and steps.step_interval == 1
    assert type(copy.copy(steps)) is type(steps) and type(copy.copy(board)) is type(board)
    model, train, _ = _blobs()
    fit(model, train, optim.Adam(model.parameters()), cross_entropy, 2, callbacks=[board],
        progress=False, verbose=False)
    scalars = _scalars(tmp_path)
    assert "batch/loss" not in scalars and "epoch/test_loss" not in scalars   # None: left out
    assert [step for step, _ in scalars["epoch/loss"]] == [1, 2]


@pytest.mark.parametrize("update_freq", [0, -3, 1.5, "step", True])
def test_bad_update_freq_is_named(tmp_path, update_freq):
    with pytest.raises(ValueError, match=r"update_freq must be 'epoch', 'batch' or a positive"):
        callbacks.TensorBoard(tmp_path, update_freq=update_freq)


def test_a_log_dir_that_is_a_file_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    model, train, _ = _blobs()
    with pytest.raises(OSError, match=r"TensorBoard: .*file.* cannot be made"):
        fit(model, train, optim.SGD(model.parameters(), lr=0.1), cross_entropy, 1,
            callbacks=[callbacks.TensorBoard(tmp_path / "file" / "logs")], progress=False,
            verbose=False)


def test_without_the_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"tensorboardX.*numba-engine\[formats\]"):
        callbacks.TensorBoard(tmp_path)


# 640 samples in batches of 32: 20 steps per epoch
TINY = ["--limit", "640", "--epochs", "2", "--batch-size", "32", "--hidden", "16",
        "--no-progress", "--device", "cpu"]


def test_the_command_writes_event_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # whatever else the command writes by default lands here
    main(TINY + ["--tensorboard", str(tmp_path / "runs")])
    scalars = _scalars(tmp_path / "runs")
    assert [step for step, _ in scalars["epoch/test_acc"]] == [1, 2]
    assert [step for step, _ in scalars["batch/loss"]] == [20, 40]   # every 20 steps
    lr = [value for _, value in scalars["epoch/learning_rate"]]
    assert lr[0] == pytest.approx(2e-3) and lr[1] < lr[0]   # the cosine schedule


def test_the_command_names_a_bad_log_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--tensorboard", str(tmp_path / "file" / "runs")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--tensorboard" in error and "is a file, not a directory" in error
    assert len(error.strip().splitlines()) == 1
