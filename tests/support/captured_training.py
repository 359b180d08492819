"""A small model trained eagerly and under ``engine.capture``: the comparison that
``tests/engine/test_capture.py`` makes for each optimizer it names and that
``tests/support/optim_check.py`` makes for a new optimizer's class."""
import numpy as np

import engine
import optim
from engine import nn
from engine.losses import cross_entropy


def batches(device, rows=(6, 6, 6, 3), features=5, classes=4, seed=0):
    """Three full batches and a partial last one (a second recording of the step)."""
    rng = np.random.default_rng(seed)
    return [(engine.tensor(rng.standard_normal((n, features)), dtype=np.float32, device=device),
             engine.tensor(rng.integers(0, classes, n), device=device)) for n in rows]


def train(device, captured, make_optimizer, clip=False, epochs=3, lr_changes=True):
    """``(losses, state_dict, optimizer, step)`` after ``epochs`` over ``batches`` with the
    optimizer ``make_optimizer(params)``, a StepLR schedule and (``lr_changes``) the user
    changing the rate after the first epoch."""
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)),
                           nn.Dense(4)]).to(device)
    opt = make_optimizer(model.parameters())
    sched = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if clip:
            optim.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        return loss

    if captured:
        step = engine.capture(step)
    losses = []
    for epoch in range(epochs):
        for x, y in batches(device):
            losses.append(step(x, y))
        sched.step()   # a scheduler writes param_groups[0]["lr"] between steps
        if lr_changes and epoch == 0:
            opt.param_groups[0]["lr"] *= 3   # and so may the user
    return [loss.item() for loss in losses], model.state_dict(), opt, step


def check_captured_equals_eager(make_optimizer, device="cpu", clip=False):
    """The captured training's losses, weights and step counts equal the eager one's, bit
    for bit, and the step was recorded twice (full and partial batches) and never fell back
    to eager."""
    eager_losses, eager_weights, eager_opt, _ = train(device, False, make_optimizer, clip)
    losses, weights, opt, step = train(device, True, make_optimizer, clip)
    assert step.eager_reason is None and step.recordings == 2   # full and partial batches
    assert losses == eager_losses
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)
    eager_state, state = eager_opt.state_dict(), opt.state_dict()
    assert [s["step"] for s in state["state"].values()] == \
        [s["step"] for s in eager_state["state"].values()]
