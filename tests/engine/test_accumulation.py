"""Gradient accumulation (fit's accumulate_steps): k batches, one optimizer step, the update
of one step on the k batches together; captured == eager; a last partial group; callbacks
count optimizer steps; a Trainer that is garbage once its optimizer is."""
import gc
import weakref

import numpy as np
import pytest

import data
import engine
import optim
from engine import callbacks, nn
from engine.fit import Trainer, fit
from engine.losses import cross_entropy


def _model(dtype=np.float64):
    engine.manual_seed(0)
    return nn.Sequential([nn.Dense(5, activation="relu", input_shape=(3,), dtype=dtype),
                          nn.Dense(3, dtype=dtype)])


def _set(n=48):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 3)), rng.integers(0, 3, size=n)


@pytest.mark.parametrize("capture", [False, True])
def test_k_batches_of_b_step_as_one_batch_of_k_b(capture):
    x, y = _set()
    accumulated, together = _model(), _model()
    opt_a = optim.SGD(accumulated.parameters(), lr=0.1, momentum=0.9)
    opt_t = optim.SGD(together.parameters(), lr=0.1, momentum=0.9)
    fit(accumulated, data.DataLoader(x, y, batch_size=4), opt_a, cross_entropy, 2,
        progress=False, verbose=False, capture=capture, accumulate_steps=3)
    fit(together, data.DataLoader(x, y, batch_size=12), opt_t, cross_entropy, 2,
        progress=False, verbose=False, capture=capture)
    for (name, a), (_, t) in zip(accumulated.state_dict().items(), together.state_dict().items()):
        np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-13, err_msg=name)


def test_captured_equals_eager_bit_for_bit_with_a_partial_last_group():
    x, y = _set(46)   # 12 batches of 4 (the last of 2): groups of 5, 5 and a last of 2
    results = []
    for capture in (True, False):
        model = _model(np.float32)
        opt = optim.Adam(model.parameters(), lr=0.01)
        losses = []
        history = fit(model, data.DataLoader(x.astype(np.float32), y, batch_size=4,
                                             shuffle=True, seed=1),
                      opt, cross_entropy, 2, progress=False, verbose=False, capture=capture,
                      accumulate_steps=5, step_losses=losses)
        results.append((history, losses, model.state_dict(), fit.last_eager_reason))
    (h_c, l_c, w_c, reason), (h_e, l_e, w_e, _) = results
    assert reason is None
    assert [r["loss"] for r in h_c] == [r["loss"] for r in h_e]
    assert [len(epoch) for epoch in l_c] == [3, 3]   # optimizer steps, not batches
    for a, b in zip(l_c, l_e):
        np.testing.assert_array_equal(a, b)
    for name, value in w_e.items():
        np.testing.assert_array_equal(w_c[name], value, err_msg=name)


def test_the_last_partial_group_is_the_mean_of_its_batches():
    x, y = _set(20)   # batches of 4: a group of 3, then a last group of 2
    accumulated, reference = _model(), _model()
    opt_a = optim.SGD(accumulated.parameters(), lr=0.1)
    opt_r = optim.SGD(reference.parameters(), lr=0.1)
    fit(accumulated, data.DataLoader(x, y, batch_size=4), opt_a, cross_entropy, 1,
        progress=False, verbose=False, accumulate_steps=3)
    fit(reference, _Batches([(x[:12], y[:12]), (x[12:], y[12:])]), opt_r, cross_entropy, 1,
        progress=False, verbose=False)
    for (name, a), (_, r) in zip(accumulated.state_dict().items(), reference.state_dict().items()):
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-13, err_msg=name)


class _Batches:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return ((engine.tensor(x), engine.tensor(y)) for x, y in self.batches)


class _Steps(callbacks.Callback):
    def on_train_begin(self, logs):
        self.seen, self.steps = [], logs["steps"]

    def on_step_end(self, logs):
        self.seen.append((logs["step"], logs["rows"]))


def test_callbacks_count_optimizer_steps():
    x, y = _set(44)   # 11 batches of 4: steps of 3 batches, the last of 2
    model = _model()
    watcher = _Steps()
    fit(model, data.DataLoader(x, y, batch_size=4), optim.SGD(model.parameters(), lr=0.1),
        cross_entropy, 1, progress=False, verbose=False, accumulate_steps=3,
        callbacks=[watcher])
    assert watcher.steps == 4
    assert watcher.seen == [(0, 12), (1, 12), (2, 12), (3, 8)]


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_bad_accumulate_steps_is_refused_before_training(value):
    model = _model()
    with pytest.raises(ValueError, match="accumulate_steps must be an integer >= 1"):
        Trainer(model, optim.SGD(model.parameters(), lr=0.1), cross_entropy,
                accumulate_steps=value)


def test_the_trainer_fit_made_dies_with_its_optimizer():
    x, y = _set(8)
    model = _model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    fit(model, data.DataLoader(x, y, batch_size=4), opt, cross_entropy, 1, progress=False,
        verbose=False)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None


@pytest.mark.cuda
def test_accumulated_steps_on_cuda_capture_as_eager():
    x, y = _set(14)   # batches of 4, 4, 4, 2: one group of 3, then the last of 1
    results = []
    for capture in (True, False):
        model = _model(np.float32).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        fit(model, data.DataLoader(x.astype(np.float32), y, batch_size=4, device="cuda"),
            opt, cross_entropy, 1, progress=False, verbose=False, capture=capture,
            accumulate_steps=3)
        results.append(model.state_dict())
    for name, value in results[1].items():
        np.testing.assert_array_equal(results[0][name], value, err_msg=name)
