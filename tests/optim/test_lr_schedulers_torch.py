"""OneCycleLR and ReduceLROnPlateau against torch.optim.lr_scheduler: the same rates (and
momenta) step by step, state saved and resumed bit for bit, and both inside ``fit`` as
callbacks, captured and eager alike."""
import numpy as np
import pytest

import data
import engine
import optim
from engine import callbacks, nn
from engine.fit import fit
from engine.losses import cross_entropy

torch = pytest.importorskip("torch")


def _pair(kind, **kwargs):
    """An engine optimizer and the torch optimizer of the same kind over one parameter."""
    engine_param = engine.tensor(np.zeros(3), requires_grad=True)
    torch_param = torch.zeros(3, requires_grad=True)
    engine_kinds = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW,
                    "rmsprop": optim.RMSprop}
    torch_kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
                   "rmsprop": torch.optim.RMSprop}
    return (engine_kinds[kind]([engine_param], **kwargs),
            torch_kinds[kind]([torch_param], **kwargs))


def _momentum(group):
    return group["betas"][0] if "betas" in group else group.get("momentum")


ONE_CYCLE_CASES = [
    ("sgd", dict(momentum=0.9), dict(max_lr=0.1, total_steps=37)),
    ("sgd", dict(momentum=0.9), dict(max_lr=0.5, epochs=4, steps_per_epoch=9,
                                     anneal_strategy="linear", pct_start=0.25)),
    ("adam", {}, dict(max_lr=3e-3, total_steps=40, three_phase=True)),
    ("adamw", {}, dict(max_lr=1e-2, total_steps=31, div_factor=10.0, final_div_factor=100.0,
                       base_momentum=0.8, max_momentum=0.9)),
    ("rmsprop", dict(momentum=0.5), dict(max_lr=0.2, total_steps=33, cycle_momentum=False)),
]


@pytest.mark.parametrize("kind, opt_kwargs, kwargs", ONE_CYCLE_CASES)
def test_one_cycle_follows_torch_step_by_step(kind, opt_kwargs, kwargs):
    ours, theirs = _pair(kind, lr=0.01, **opt_kwargs)
    mine = optim.lr_scheduler.OneCycleLR(ours, **kwargs)
    reference = torch.optim.lr_scheduler.OneCycleLR(theirs, **kwargs)
    total = kwargs.get("total_steps") or kwargs["epochs"] * kwargs["steps_per_epoch"]
    for step in range(total):
        assert mine.get_last_lr() == reference.get_last_lr(), step
        assert _momentum(ours.param_groups[0]) == _momentum(theirs.param_groups[0]), step
        theirs.step()
        reference.step()
        mine.step()
    with pytest.raises(ValueError, match="OneCycleLR: stepped"):
        mine.step()


def test_one_cycle_resumes_bit_for_bit():
    ours, _ = _pair("sgd", lr=0.01, momentum=0.9)
    uninterrupted = optim.lr_scheduler.OneCycleLR(ours, max_lr=0.1, total_steps=30)
    rates = [uninterrupted.get_last_lr()[0]] + [
        (uninterrupted.step(), uninterrupted.get_last_lr()[0])[1] for _ in range(29)]

    ours, _ = _pair("sgd", lr=0.01, momentum=0.9)
    first = optim.lr_scheduler.OneCycleLR(ours, max_lr=0.1, total_steps=30)
    for _ in range(11):
        first.step()
    saved_opt, saved_sched = ours.state_dict(), first.state_dict()
    resumed_opt, _ = _pair("sgd", lr=0.01, momentum=0.9)
    resumed_opt.load_state_dict(saved_opt)
    resumed = optim.lr_scheduler.OneCycleLR(resumed_opt, max_lr=0.1, total_steps=30)
    resumed.load_state_dict(saved_sched)
    resumed_opt.param_groups[0].update(saved_opt["param_groups"][0])   # the rates it carried
    tail = []
    for _ in range(18):
        resumed.step()
        tail.append(resumed.get_last_lr()[0])
    assert tail == rates[12:]


@pytest.mark.parametrize("arguments, words", [
    (dict(max_lr=0.1), "total_steps, or epochs and steps_per_epoch"),
    (dict(max_lr=0.1, total_steps=0), "total_steps must be an integer > 0"),
    (dict(max_lr=0.1, total_steps=5, pct_start=1.5), "pct_start"),
    (dict(max_lr=0.1, total_steps=5, anneal_strategy="exp"), "anneal_strategy"),
])
def test_one_cycle_refuses_bad_arguments(arguments, words):
    ours, _ = _pair("sgd", lr=0.01, momentum=0.9)
    with pytest.raises(ValueError, match=words):
        optim.lr_scheduler.OneCycleLR(ours, **arguments)


def test_one_cycle_needs_a_momentum_to_cycle():
    ours = optim.Adagrad([engine.tensor(np.zeros(2), requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="cycle_momentum=False"):
        optim.lr_scheduler.OneCycleLR(ours, max_lr=0.1, total_steps=5)


PLATEAU_VALUES = [1.0, 0.9, 0.9, 0.95, 0.91, 0.9, 0.9, 0.7, 0.71, 0.72, 0.69, 0.7, 0.7, 0.7,
                  0.7, 0.5, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.45, 0.45, 0.45, 0.45, 0.45,
                  0.45, 0.45, 0.45, 0.45]


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(patience=2, factor=0.5),
    dict(patience=1, factor=0.5, cooldown=2, min_lr=0.02),
    dict(mode="max", patience=1, threshold=0.05, threshold_mode="abs"),
    dict(patience=0, factor=0.3, threshold=0.1, eps=1e-3),
])
def test_reduce_on_plateau_follows_torch(kwargs):
    ours, theirs = _pair("sgd", lr=0.1, momentum=0.9)
    mine = optim.lr_scheduler.ReduceLROnPlateau(ours, **kwargs)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(theirs, **kwargs)
    for step, value in enumerate(PLATEAU_VALUES):
        mine.step(value)
        reference.step(value)
        assert mine.get_last_lr() == reference.get_last_lr(), step
        assert (mine.num_bad_epochs, mine.cooldown_counter, mine.best) == \
            (reference.num_bad_epochs, reference.cooldown_counter, reference.best), step


def test_reduce_on_plateau_resumes_bit_for_bit():
    ours, _ = _pair("sgd", lr=0.1)
    whole = optim.lr_scheduler.ReduceLROnPlateau(ours, patience=1, factor=0.5)
    for value in PLATEAU_VALUES:
        whole.step(value)
    ours, _ = _pair("sgd", lr=0.1)
    first = optim.lr_scheduler.ReduceLROnPlateau(ours, patience=1, factor=0.5)
    for value in PLATEAU_VALUES[:13]:
        first.step(value)
    state = first.state_dict()
    again = optim.lr_scheduler.ReduceLROnPlateau(ours, patience=1, factor=0.5)
    again.load_state_dict(state)
    for value in PLATEAU_VALUES[13:]:
        again.step(value)
    assert again.get_last_lr() == whole.get_last_lr() and again.state_dict().keys() == \
        whole.state_dict().keys()


@pytest.mark.parametrize("arguments, words", [
    (dict(factor=1.0), "factor must be in"), (dict(mode="up"), "mode must be"),
    (dict(threshold_mode="pct"), "threshold_mode"), (dict(patience=-1), "patience"),
])
def test_reduce_on_plateau_refuses_bad_arguments(arguments, words):
    ours, _ = _pair("sgd", lr=0.1)
    with pytest.raises(ValueError, match=words):
        optim.lr_scheduler.ReduceLROnPlateau(ours, **arguments)


# ------------------------------------------------------------------ inside fit

def _blobs(device="cpu"):
    x, y = data.blobs(48, centers=3, seed=0)
    loader = data.DataLoader(x, y, batch_size=8, shuffle=True, seed=0, device=device)
    model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
    return model.to(device), loader


def _trained_with(make_schedule, capture, epochs=3, test=False):
    engine.manual_seed(0)
    model, loader = _blobs()
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = make_schedule(opt)
    history = fit(model, loader, opt, cross_entropy, epochs, progress=False, verbose=False,
                  capture=capture, test_loader=loader if test else None,
                  callbacks=[callbacks.LearningRateScheduler(schedule)])
    return history, model.state_dict(), opt.param_groups[0]["lr"], fit.last_eager_reason


def test_one_cycle_in_fit_steps_every_batch_and_capture_equals_eager():
    make = lambda opt: optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, epochs=3, steps_per_epoch=6)
    (_, captured, lr, reason), (_, eager, eager_lr, _) = (
        _trained_with(make, True), _trained_with(make, False))
    assert reason is None and lr == eager_lr
    expected = optim.lr_scheduler.OneCycleLR(_pair("sgd", lr=0.05, momentum=0.9)[0], max_lr=0.5,
                                             epochs=3, steps_per_epoch=6)
    for _ in range(18):
        expected.step()
    assert lr == expected.get_last_lr()[0]   # 18 steps: one per batch
    for name, value in eager.items():
        np.testing.assert_array_equal(captured[name], value, err_msg=name)


def test_reduce_on_plateau_in_fit_reads_the_monitored_record():
    make = lambda opt: optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5,
                                                            threshold=10.0)
    history, _, lr, _ = _trained_with(make, True, test=True)
    # with a threshold of 1000% no epoch improves on the last (not even on the first's
    # infinite "best", as in torch): with no patience, every epoch halves the rate
    assert len(history) == 3 and lr == 0.05 * 0.5 ** 3


def test_fit_s_scheduler_argument_takes_both_kinds():
    """fit(scheduler=...) steps ReduceLROnPlateau with the epoch's loss and OneCycleLR after
    every batch, as the callback does."""
    engine.manual_seed(0)
    model, loader = _blobs()
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plateau = optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)
    fit(model, loader, opt, cross_entropy, 2, progress=False, verbose=False, scheduler=plateau)
    assert opt.param_groups[0]["lr"] == 0.05 * 0.5 ** 2 and plateau.last_epoch == 2
    cycle = optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=12)
    fit(model, loader, opt, cross_entropy, 4, start_epoch=2, progress=False, verbose=False,
        scheduler=cycle)
    assert cycle.last_epoch == 12   # 2 epochs of 6 batches
