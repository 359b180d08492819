"""``engine.capture``: a replayed step computes what the eager step computes, bit for bit."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from ops.cuda_backend import SIMULATOR

OPTIMIZERS = {
    "adam": lambda params: optim.Adam(params, lr=1e-2),
    "adamw": lambda params: optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


def _batches(device, rows=(6, 6, 6, 3), features=5, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(engine.tensor(rng.standard_normal((n, features)), dtype=np.float32, device=device),
             engine.tensor(rng.integers(0, classes, n), device=device)) for n in rows]


def _train(device, captured, kind="adam", clip=False, epochs=3, lr_changes=True):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)),
                           nn.Dense(4)]).to(device)
    opt = OPTIMIZERS[kind](model.parameters())
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
        for x, y in _batches(device):
            losses.append(step(x, y))
        sched.step()   # a scheduler writes param_groups[0]["lr"] between steps
        if lr_changes and epoch == 0:
            opt.param_groups[0]["lr"] *= 3   # and so may the user
    return [loss.item() for loss in losses], model.state_dict(), opt, step


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_captured_training_equals_eager_bit_for_bit(device, kind):
    if device == "cuda" and kind != "adam" and SIMULATOR:
        pytest.skip("one optimizer in the slow simulator; the gpu run takes all three")
    eager_losses, eager_weights, eager_opt, _ = _train(device, False, kind)
    losses, weights, opt, step = _train(device, True, kind)
    assert step.eager_reason is None and step.recordings == 2   # full and partial batches
    assert losses == eager_losses
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)
    eager_state, state = eager_opt.state_dict(), opt.state_dict()
    assert [s["step"] for s in state["state"].values()] == \
        [s["step"] for s in eager_state["state"].values()]


def test_clipping_inside_the_captured_step(device):
    eager_losses, eager_weights, _, _ = _train(device, False, clip=True)
    losses, weights, _, step = _train(device, True, clip=True)
    assert step.eager_reason is None
    assert losses == eager_losses
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)


def test_replay_leaves_the_callers_tensors_and_earlier_results_alone(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(3, input_shape=(5,))]).to(device)

    @engine.capture
    def predict(x):
        with engine.no_grad():
            return model(x) * 2

    batches = [x for x, _ in _batches(device)][:3]
    copies = [x.numpy().copy() for x in batches]
    results = [predict(x) for x in batches + batches]
    for x, copy in zip(batches, copies):
        np.testing.assert_array_equal(x.numpy(), copy)
    for x, result in zip(batches + batches, results):
        np.testing.assert_allclose(result.numpy(), (model(x) * 2).numpy(), rtol=1e-6)


def test_a_step_that_reads_the_device_runs_eagerly_and_says_why(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(4, input_shape=(5,))]).to(device)
    opt = optim.SGD(model.parameters(), lr=0.1)

    @engine.capture
    def step(x, y):
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    values = [step(x, y) for x, y in _batches(device)[:3]]
    # a host array's read is not seen on the CPU, but the float it returns is
    reason = "read on the host" if device == "cuda" else "returns a float"
    assert reason in step.eager_reason and step.recordings == 0
    assert all(isinstance(v, float) for v in values)


def test_dropout_is_not_captured_yet_and_says_so(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(4, input_shape=(5,)), nn.Dropout(0.5)]).to(device)

    @engine.capture
    def forward(x):
        return model(x)

    for x, _ in _batches(device)[:3]:
        forward(x)
    assert "Dropout" in forward.eager_reason


def test_capture_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        engine.capture(lambda x: x, warmup=-1)
    step = engine.capture(lambda x: x)
    with pytest.raises(TypeError, match="neither a Tensor nor hashable"):
        step([1, 2])


@pytest.mark.gpu
def test_the_cuda_replay_is_one_graph():
    assert not SIMULATOR
    _, _, _, step = _train("cuda", True, epochs=2)
    assert all(recording.graph is not None for recording in step._recordings.values())
