"""``engine.fit.Trainer``: the object that owns a training's captured step, and ``fit``, a
plain function over one (issue 43: no module-level fit object with a rewritten signature)."""
import inspect

import numpy as np
import pytest

import data
import engine
import optim
from engine import nn
from engine.fit import Trainer, fit
from engine.losses import cross_entropy


def _setup(seed=0):
    engine.manual_seed(seed)
    x, y = data.blobs(45, centers=3, seed=0)   # 5 batches of 8, then one of 5
    loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=0)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    return model, loader, optim.Adam(model.parameters(), lr=0.01)


def _untimed(history):
    return [{key: record[key] for key in ("epoch", "loss", "train_acc")} for record in history]


def test_fit_is_a_plain_function_whose_help_is_its_own():
    assert inspect.isfunction(fit) and "__signature__" not in vars(fit)
    assert list(inspect.signature(fit).parameters)[:5] == ["model", "loader", "optimizer",
                                                            "loss_fn", "epochs"]
    assert "Trainer(model, optimizer, loss_fn, clip, capture, distributed, accumulate_steps)" \
        in " ".join(fit.__doc__.split())
    assert list(inspect.signature(Trainer).parameters) == [
        "model", "optimizer", "loss_fn", "clip", "capture", "distributed", "accumulate_steps"]
    assert list(inspect.signature(Trainer.fit).parameters)[:3] == ["self", "loader", "epochs"]


def test_the_train_module_exports_the_trainer():
    import engine.train
    assert engine.train.Trainer is Trainer and engine.train.fit is fit


def test_a_trainer_keeps_its_captured_step_across_fit_calls():
    model, loader, opt = _setup()
    trainer = Trainer(model, opt, cross_entropy)
    assert trainer.train_step is None
    history = []
    for epoch in (1, 2, 3, 4):
        trainer.fit(loader, epoch, start_epoch=epoch - 1, history=history, progress=False,
                    verbose=False)
        if epoch == 2:   # the full batches and the partial last one, each recorded once
            step, recordings = trainer.train_step, trainer.train_step.recordings
            assert recordings == 2 and trainer.eager_reason is None
    assert trainer.train_step is step and step.recordings == recordings
    assert [record["epoch"] for record in history] == [1, 2, 3, 4]


def test_a_trainer_trains_as_fit_does_bit_for_bit():
    results = []
    for through_trainer in (True, False):
        model, loader, opt = _setup()
        scheduler = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if through_trainer:
            history = Trainer(model, opt, cross_entropy).fit(
                loader, 3, scheduler=scheduler, progress=False, verbose=False)
        else:
            history = fit(model, loader, opt, cross_entropy, 3, scheduler=scheduler,
                          progress=False, verbose=False)
        results.append((_untimed(history), model.state_dict()))
    (trained, weights), (fitted, fitted_weights) = results
    assert trained == fitted
    for name, value in fitted_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_one_epoch_fit_calls_in_a_loop_record_their_step_once():
    """fit reuses the Trainer it made for the optimizer (the benchmarks' loop of one-epoch
    calls, Keras's model.fit called again)."""
    model, loader, opt = _setup()
    trainers = []
    for epoch in (1, 2, 3):
        fit(model, loader, opt, cross_entropy, epoch, start_epoch=epoch - 1, progress=False,
            verbose=False)
        trainers.append(getattr(opt, engine.fit._FIT_TRAINER))
    assert trainers[0] is trainers[1] is trainers[2] and fit.last_eager_reason is None
    other_loss = lambda logits, labels: cross_entropy(logits, labels)   # noqa: E731
    fit(model, loader, opt, other_loss, 4, start_epoch=3, progress=False, verbose=False)
    assert getattr(opt, engine.fit._FIT_TRAINER) is not trainers[0]   # another loss: another step


def test_a_trainer_without_capture_keeps_no_step():
    model, loader, opt = _setup()
    trainer = Trainer(model, opt, cross_entropy, capture=False)
    trainer.fit(loader, 1, progress=False, verbose=False)
    assert trainer.train_step is None and trainer.eager_reason is None


def test_a_bad_clip_is_named_when_the_trainer_is_made():
    model, _, opt = _setup()
    with pytest.raises(TypeError, match="Trainer: clip must be a function of the parameters"):
        Trainer(model, opt, cross_entropy, clip=1.0)
