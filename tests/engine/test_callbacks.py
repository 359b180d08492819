"""engine.callbacks and how fit runs them: the hooks and their logs, early stopping, best-model
checkpoints, learning-rate schedules, the history, replaceable progress bars, and the test
loss that fit now records and evaluate returns."""
import io
import json

import numpy as np
import pytest

import data
import engine
import optim
from engine import callbacks, nn
from engine.fit import RECORD_KEYS, Run, evaluate, fit, read_checkpoint
from engine.losses import cross_entropy

A_RECORD = {"epoch": 1, "loss": 2.5, "train_acc": 0.1, "test_loss": 2.4, "test_acc": 0.2,
            "seconds": 0.1, "samples_per_s": 1900.0}


def _blobs(batch_size=8, device="cpu"):
    x, y = data.blobs(48, centers=3, seed=0)
    loader = data.DataLoader(x, y, batch_size=batch_size, shuffle=True, seed=0, device=device)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    return model.to(device), loader, x, y


def _fit(model, loader, epochs, lr=0.05, **options):
    options = {"progress": False, "verbose": False, **options}
    return fit(model, loader, optim.Adam(model.parameters(), lr=lr), cross_entropy, epochs,
               **options)


class Recorder(callbacks.Callback):
    """Every hook call, with a copy of its logs."""

    def __init__(self):
        self.calls = []

    def on_train_begin(self, logs):
        self.calls.append(("train_begin", dict(logs)))

    def on_epoch_begin(self, logs):
        self.calls.append(("epoch_begin", dict(logs)))

    def on_step_end(self, logs):
        self.calls.append(("step_end", dict(logs)))

    def on_epoch_end(self, logs):
        self.calls.append(("epoch_end", dict(logs)))

    def on_train_end(self, logs):
        self.calls.append(("train_end", dict(logs)))


# ------------------------------------------------------------------ fit and its hooks

def test_fit_calls_every_hook_in_order_with_its_logs():
    model, loader, _, _ = _blobs()   # 6 batches of 8
    recorder = Recorder()
    history = _fit(model, loader, 2, test_loader=loader, callbacks=[recorder])
    names = [name for name, _ in recorder.calls]
    assert names == (["train_begin"] + (["epoch_begin"] + ["step_end"] * 6 + ["epoch_end"]) * 2
                     + ["train_end"])
    assert recorder.calls[0][1] == {"epochs": 2, "start_epoch": 0, "steps": 6}
    steps = [logs for name, logs in recorder.calls if name == "step_end"]
    assert [(s["epoch"], s["step"]) for s in steps] == [(e, i) for e in (1, 2) for i in range(6)]
    assert all(s["rows"] == 8 and s["steps"] == 6 and s["seconds"] > 0 for s in steps)
    assert isinstance(steps[0]["loss"], engine.Tensor) and steps[0]["loss"].size == 1
    assert [logs for name, logs in recorder.calls if name == "epoch_end"] == history
    assert recorder.calls[-1][1] == {"history": history, "error": None}
    assert recorder.run.model is model and recorder.run.history is history


def test_callbacks_between_captured_steps_leave_the_step_captured_and_exact(device):
    """A bar that reads every step's loss, a recorder and early stopping with restored
    weights run between the steps: the step is still replayed, and the records and weights
    are those of eager steps, bit for bit."""
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        model, loader, _, _ = _blobs(device=device)
        bar = callbacks.ProgressBar(every=1, file=io.StringIO())
        stopping = callbacks.EarlyStopping(patience=1, restore_best_weights=True,
                                           verbose=False)
        history = _fit(model, loader, 4, lr=0.5, test_loader=loader, capture=capture,
                       callbacks=[bar, Recorder(), stopping])
        results.append((history, model.state_dict(), fit.last_eager_reason))
    (captured, weights, reason), (eager, eager_weights, _) = results

    def untimed(history):
        return [{key: record[key] for key in RECORD_KEYS[:5]} for record in history]
    assert reason is None and untimed(captured) == untimed(eager)
    assert len(captured) == 3 and stopping.best_epoch == 2   # stopped, restored epoch 2
    for name, value in eager_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_the_record_has_the_test_loss_of_evaluate():
    model, loader, x, y = _blobs()
    record = _fit(model, loader, 1, lr=0.0, test_loader=loader)[0]
    assert tuple(record) == RECORD_KEYS
    with engine.no_grad():
        full_batch = cross_entropy(model(engine.tensor(x)), y).item()
    assert record["test_loss"] == pytest.approx(full_batch, rel=1e-5)
    loss, accuracy = evaluate(model, loader, cross_entropy)   # another shuffle: another sum
    assert loss == pytest.approx(record["test_loss"], rel=1e-6)
    assert accuracy == record["test_acc"]
    assert evaluate(model, loader) == record["test_acc"]   # without a loss: the accuracy alone
    assert _fit(model, loader, 1)[0]["test_loss"] is None   # no test loader, no test values


def test_on_train_end_sees_the_error_that_ends_training():
    model, loader, _, _ = _blobs()
    recorder = Recorder()

    class Failing(callbacks.Callback):
        def on_epoch_end(self, logs):
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        _fit(model, loader, 3, callbacks=[recorder, Failing()])
    name, logs = recorder.calls[-1]
    assert name == "train_end" and str(logs["error"]) == "stop here"
    assert len(logs["history"]) == 1


def test_a_callback_that_sets_stop_training_ends_after_its_epoch():
    class StopAtTwo(callbacks.Callback):
        def on_epoch_end(self, logs):
            self.run.stop_training = logs["epoch"] == 2

    model, loader, _, _ = _blobs()
    assert [r["epoch"] for r in _fit(model, loader, 5, callbacks=[StopAtTwo()])] == [1, 2]


def test_fit_refuses_a_plain_function_as_a_callback():
    model, loader, _, _ = _blobs()
    with pytest.raises(TypeError, match="plain function goes in on_epoch_end="):
        _fit(model, loader, 1, callbacks=[print])


def test_the_progress_bar_and_the_epoch_line_can_be_replaced(capsys):
    model, loader, _, _ = _blobs()
    screen = io.StringIO()
    _fit(model, loader, 1, callbacks=[callbacks.ProgressBar(every=2, file=screen,
                                                            mininterval=0)])
    assert "epoch 1/1" in screen.getvalue() and "samples/s" in screen.getvalue()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""   # the built-in ones were off
    _fit(model, loader, 1, verbose=True)
    assert capsys.readouterr().out.startswith("epoch 1/1  train loss ")


def test_json_log_appends_one_record_per_epoch(tmp_path):
    model, loader, _, _ = _blobs()
    path = tmp_path / "log.jsonl"
    history = _fit(model, loader, 2, test_loader=loader, callbacks=[callbacks.JsonLog(path)])
    assert [json.loads(line) for line in path.read_text().splitlines()] == history


def test_history_keeps_keras_s_form():
    model, loader, _, _ = _blobs()
    history = callbacks.History()
    records = _fit(model, loader, 3, test_loader=loader, callbacks=[history])
    assert history.records == records and history.epochs == [1, 2, 3]
    assert history.history["test_loss"] == [r["test_loss"] for r in records]
    assert "epoch" not in history.history


# ------------------------------------------------------------------ early stopping

def _drive(callback, values, monitor="test_loss", history=()):
    """Run ``callback``'s hooks over epochs whose ``monitor`` takes ``values``; epoch ``e``
    leaves every weight of the model at ``e``. Returns the model and the epochs run."""
    model = nn.Sequential([nn.Dense(2, input_shape=(3,))])
    run = Run(model, optim.SGD(model.parameters(), lr=0.1), len(values) + len(history),
              len(history), None, list(history), evaluates=True)
    callback.run = run
    callback.on_train_begin({})
    epochs = []
    for epoch, value in enumerate(values, len(history) + 1):
        if run.stop_training:
            break
        model.load_state_dict({name: np.full_like(array, epoch)
                               for name, array in model.state_dict().items()})
        record = {**A_RECORD, "epoch": epoch, monitor: value}
        run.history.append(record)
        callback.on_epoch_end(record)
        epochs.append(epoch)
    callback.on_train_end({"history": run.history, "error": None})
    return model, epochs


@pytest.mark.parametrize("patience, epochs", [(0, [1, 2, 3]), (1, [1, 2, 3]),
                                              (2, [1, 2, 3, 4]), (5, [1, 2, 3, 4, 5, 6])])
def test_early_stopping_waits_patience_epochs_without_improvement(patience, epochs, capsys):
    stopping = callbacks.EarlyStopping(patience=patience)
    model, ran = _drive(stopping, [1.0, 0.5, 0.7, 0.8, 0.6, 0.9])
    assert ran == epochs and stopping.best == 0.5 and stopping.best_epoch == 2
    assert stopping.stopped_epoch == (epochs[-1] if len(epochs) < 6 else None)
    if stopping.stopped_epoch:
        assert (f"early stopping after epoch {epochs[-1]}: test_loss has not improved for "
                f"{epochs[-1] - 2} epoch(s) (best 0.5000 at epoch 2)") in capsys.readouterr().out
    assert model.state_dict()["dense.weight"][0, 0] == ran[-1]   # no restore asked for


def test_early_stopping_restores_the_best_weights():
    stopping = callbacks.EarlyStopping(patience=2, restore_best_weights=True, verbose=False)
    model, ran = _drive(stopping, [1.0, 0.5, 0.7, 0.8, 0.1])
    assert ran == [1, 2, 3, 4]
    assert all((array == 2).all() for array in model.state_dict().values())


def test_min_delta_and_mode():
    stopping = callbacks.EarlyStopping(patience=1, min_delta=0.1, verbose=False)
    _, ran = _drive(stopping, [1.0, 0.95, 0.5])   # 0.05 better is no improvement
    assert ran == [1, 2]
    accuracy = callbacks.EarlyStopping(monitor="test_acc", patience=1, verbose=False)
    _, ran = _drive(accuracy, [0.5, 0.6, 0.55, 0.9], monitor="test_acc")   # auto: max
    assert ran == [1, 2, 3] and accuracy.best == 0.6
    nan = callbacks.EarlyStopping(patience=1, verbose=False)
    _, ran = _drive(nan, [1.0, float("nan"), 0.5])   # a NaN never improves
    assert ran == [1, 2]


def test_early_stopping_picks_up_a_resumed_run_s_patience(capsys):
    earlier = [{**A_RECORD, "epoch": 1, "test_loss": 1.0}, {**A_RECORD, "epoch": 2,
                                                            "test_loss": 1.2}]
    stopping = callbacks.EarlyStopping(patience=2)
    _, ran = _drive(stopping, [1.1, 0.9], history=earlier)
    assert ran == [3] and stopping.best_epoch == 1
    done = callbacks.EarlyStopping(patience=1)   # already out of patience: no epoch at all
    _, ran = _drive(done, [0.1], history=earlier)
    assert ran == [] and done.stopped_epoch == 2


def test_early_stopping_in_fit_stops_a_model_that_no_longer_learns():
    model, loader, _, _ = _blobs()
    stopping = callbacks.EarlyStopping(patience=2, verbose=False)
    history = _fit(model, loader, 10, lr=0.0, test_loader=loader, callbacks=[stopping])
    assert [r["epoch"] for r in history] == [1, 2, 3] and stopping.stopped_epoch == 3


@pytest.mark.parametrize("make, test_loader, words", [
    (lambda: callbacks.EarlyStopping(monitor="val_loss"), True, "'val_loss' is not in the "
     "epoch records, which hold epoch, loss, train_acc, test_loss"),
    (lambda: callbacks.EarlyStopping(), False, r"needs fit\(..., test_loader=...\)"),
    (lambda: callbacks.ModelCheckpoint("m.npz", save_best_only=True), False, "test_loader"),
])
def test_a_monitor_fit_does_not_record_fails_before_training(make, test_loader, words):
    model, loader, _, _ = _blobs()
    recorder = Recorder()
    with pytest.raises(ValueError, match=words):
        _fit(model, loader, 2, test_loader=loader if test_loader else None,
             callbacks=[make(), recorder])
    assert not [name for name, _ in recorder.calls if name == "epoch_begin"]


@pytest.mark.parametrize("arguments, words", [
    ({"patience": -1}, "patience must be an integer >= 0"), ({"patience": 1.5}, "patience"),
    ({"mode": "lowest"}, "mode must be one of"), ({"min_delta": -0.1}, "min_delta")])
def test_early_stopping_rejects_bad_arguments(arguments, words):
    with pytest.raises(ValueError, match=words):
        callbacks.EarlyStopping(**arguments)


# ------------------------------------------------------------------ checkpoints

def test_model_checkpoint_keeps_the_best_epoch(tmp_path):
    path = tmp_path / "best.npz"
    checkpoint = callbacks.ModelCheckpoint(path, monitor="test_acc", mode="max",
                                           save_best_only=True, config={"run": "test"})
    model, _ = _drive(checkpoint, [0.5, 0.7, 0.6], monitor="test_acc")
    assert checkpoint.saved_epoch == 2 and checkpoint.best == 0.7
    state = read_checkpoint(str(path))
    assert state["epoch"] == 2 and state["config"] == {"run": "test"}
    assert [r["epoch"] for r in state["history"]] == [1, 2]
    assert all((array == 2).all() for array in nn.load(str(path)).state_dict().values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.npz"]   # no temporaries


def test_model_checkpoint_in_fit_writes_every_epoch_as_the_command_does(tmp_path):
    model, loader, _, _ = _blobs()
    path = tmp_path / "every.npz"
    seen = []
    history = _fit(model, loader, 2, test_loader=loader,
                   callbacks=[callbacks.ModelCheckpoint(path)],
                   on_epoch_end=lambda record: seen.append(read_checkpoint(str(path))["epoch"]))
    assert seen == [1, 2]
    state = read_checkpoint(str(path))
    assert state["history"] == history
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(state["model"][name], value)


def test_an_unwritable_checkpoint_path_fails_before_training(tmp_path):
    model, loader, _, _ = _blobs()
    recorder = Recorder()
    with pytest.raises(OSError, match="ModelCheckpoint: .* cannot be written"):
        _fit(model, loader, 1, callbacks=[
            callbacks.ModelCheckpoint(tmp_path / "missing" / "m.npz"), recorder])
    assert [name for name, _ in recorder.calls] == ["train_end"]


# ------------------------------------------------------------------ learning rates

class LearningRates(callbacks.Callback):
    def __init__(self):
        self.rates = []

    def on_epoch_end(self, logs):
        self.rates.append(self.run.optimizer.param_groups[0]["lr"])


def test_a_learning_rate_function_sets_every_epoch_s_rate():
    model, loader, _, _ = _blobs()
    rates = LearningRates()
    seen = []

    def schedule(epoch, lr):
        seen.append((epoch, lr))
        return 0.1 / epoch

    _fit(model, loader, 3, lr=0.5, callbacks=[callbacks.LearningRateScheduler(schedule), rates])
    assert rates.rates == [0.1, 0.05, pytest.approx(0.1 / 3)]
    assert seen == [(1, 0.5), (2, 0.1), (3, 0.05)]


def test_an_optim_scheduler_as_a_callback_steps_after_every_epoch():
    model, loader, _, _ = _blobs()
    optimizer = optim.SGD(model.parameters(), lr=0.4)
    rates = LearningRates()
    step_lr = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fit(model, loader, optimizer, cross_entropy, 3, progress=False, verbose=False,
        callbacks=[rates, callbacks.LearningRateScheduler(step_lr)])
    assert rates.rates == [0.4, 0.2, 0.1] and optimizer.param_groups[0]["lr"] == 0.05


def test_a_schedule_returning_no_rate_is_named():
    model, loader, _, _ = _blobs()
    with pytest.raises(ValueError, match=r"schedule\(1, 0.05\) returned nan"):
        _fit(model, loader, 1, callbacks=[
            callbacks.LearningRateScheduler(lambda epoch, lr: float("nan"))])
    with pytest.raises(TypeError, match="LearningRateScheduler"):
        callbacks.LearningRateScheduler(0.1)
