"""callbacks.TerminateOnNaN in fit and in the command: training stops at the first
non-finite loss, the unfinished epoch is never recorded or saved."""
import numpy as np
import pytest

import data
import optim
from engine import callbacks, nn
from engine.fit import fit, read_checkpoint
from engine.losses import cross_entropy
from tests.support.training_command import TINY, run_main


def _blobs(device="cpu"):
    x, y = data.blobs(48, centers=3, seed=0)   # 6 steps of 8 per epoch
    loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=0, device=device)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    return model.to(device), loader


class PoisonAtEpochStart(callbacks.Callback):
    """Writes NaN into the first weight as epoch ``epoch`` begins: its step 0 is the first
    non-finite loss."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_begin(self, logs):
        if logs["epoch"] == self.epoch:
            self.run.model.parameters()[0].detach()[0, 0] = np.nan


class PoisonAfterStep(PoisonAtEpochStart):
    """Writes NaN into the first weight after step ``step`` of epoch ``epoch`` (between
    steps: the next step's loss is the first non-finite one)."""

    def __init__(self, epoch, step):
        self.epoch, self.step, self.current = epoch, step, None

    def on_epoch_begin(self, logs):
        self.current = logs["epoch"]

    def on_step_end(self, logs):
        if (self.current, logs["step"]) == (self.epoch, self.step):
            self.run.model.parameters()[0].detach()[0, 0] = np.nan


class Epochs(callbacks.Callback):
    def __init__(self):
        self.ended = []

    def on_epoch_end(self, logs):
        self.ended.append(logs["epoch"])


def _fit(model, loader, epochs, extra, **options):
    return fit(model, loader, optim.Adam(model.parameters(), lr=0.05), cross_entropy, epochs,
               callbacks=extra, progress=False, verbose=False, **options)


def test_fit_stops_at_the_first_non_finite_loss_and_records_nothing_of_its_epoch(
        device, capsys):
    model, loader = _blobs(device)
    terminate, ended = callbacks.TerminateOnNaN(), Epochs()
    history = _fit(model, loader, 3, [PoisonAfterStep(epoch=2, step=3), terminate, ended])
    assert (terminate.stopped_epoch, terminate.stopped_step) == (2, 4)
    assert np.isnan(terminate.loss)
    assert [record["epoch"] for record in history] == [1] and ended.ended == [1]
    assert capsys.readouterr().out.strip().splitlines() == [
        "terminate on NaN: the training loss is nan at epoch 2, step 4; training stopped, "
        "that epoch is not recorded and no checkpoint of it is written"]


def test_without_it_fit_trains_on_through_nan():
    model, loader = _blobs()
    history = _fit(model, loader, 3, [PoisonAfterStep(epoch=2, step=3)])
    assert len(history) == 3 and np.isnan(history[-1]["loss"])


def test_the_checkpoint_of_the_last_finite_epoch_stays_untouched(tmp_path, capsys):
    model, loader = _blobs()
    path = tmp_path / "run.npz"
    checkpoint = callbacks.ModelCheckpoint(path)
    terminate = callbacks.TerminateOnNaN(verbose=False)
    saved = []
    _fit(model, loader, 3, [PoisonAtEpochStart(epoch=2), terminate, checkpoint],
         on_epoch_end=lambda record: saved.append(path.read_bytes()))
    assert (terminate.stopped_epoch, terminate.stopped_step) == (2, 0)
    assert len(saved) == 1 and path.read_bytes() == saved[0]
    state = read_checkpoint(str(path))
    assert state["epoch"] == 1 and all(np.isfinite(v).all() for v in state["model"].values())


def test_a_step_interval_checks_every_nth_step_and_says_so(capsys):
    model, loader = _blobs()
    terminate = callbacks.TerminateOnNaN(step_interval=4)
    _fit(model, loader, 2, [PoisonAtEpochStart(epoch=1), terminate])
    # steps 0-3 replay as one, the check sees step 3's loss: the first non-finite was step 0
    assert (terminate.stopped_epoch, terminate.stopped_step) == (1, 3)
    assert "step 3 (the last of 4 steps run since the previous check)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("interval", [0, 1.5, True])
def test_a_bad_step_interval_is_refused(interval):
    with pytest.raises(ValueError, match="TerminateOnNaN: step_interval must be an integer"):
        callbacks.TerminateOnNaN(step_interval=interval)


def test_the_command_stops_with_one_line_and_keeps_the_last_finite_checkpoint(
        tmp_path, monkeypatch, capsys):
    import engine.cli.train
    path = tmp_path / "run.npz"

    def fit_poisoned_in_epoch_2(*args, callbacks=(), **options):
        return fit(*args, callbacks=list(callbacks) + [PoisonAtEpochStart(epoch=2)], **options)

    monkeypatch.setattr(engine.cli.train, "fit", fit_poisoned_in_epoch_2)
    code, captured = run_main(TINY + ["--epochs", "3", "--save", str(path)], capsys)
    assert code == 1 and captured.err.strip().splitlines() == [
        "engine-train: error: the training loss is nan at epoch 2, step 0: training stopped "
        "there (a lower --lr or --clip-norm may help); the checkpoint of epoch 1 in "
        f"{path} is intact"]
    assert "epoch 1/3" in captured.out and "epoch 2/3" not in captured.out
    state = read_checkpoint(str(path))
    assert state["epoch"] == 1 and all(np.isfinite(v).all() for v in state["model"].values())
