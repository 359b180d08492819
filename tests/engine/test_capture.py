"""``engine.capture``: a replayed step computes what the eager step computes, bit for bit."""
import numpy as np
import pytest

import data
import engine
import optim
from engine import nn
from engine.losses import cross_entropy
from ops.cuda import SIMULATOR
from tests.support import captured_training
from tests.support.training_step import cross_entropy_step

OPTIMIZERS = {
    "adam": lambda params: optim.Adam(params, lr=1e-2),
    "adamw": lambda params: optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda params: optim.RMSprop(params, lr=1e-2, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_captured_training_equals_eager_bit_for_bit(device, kind):
    if device == "cuda" and kind != "adam" and SIMULATOR:
        pytest.skip("one optimizer in the slow simulator; the gpu run takes them all")
    captured_training.check_captured_equals_eager(OPTIMIZERS[kind], device)


def test_clipping_inside_the_captured_step(device):
    captured_training.check_captured_equals_eager(OPTIMIZERS["adam"], device, clip=True)


def test_replay_leaves_the_callers_tensors_and_earlier_results_alone(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(3, input_shape=(5,))]).to(device)

    @engine.capture
    def predict(x):
        with engine.no_grad():
            return model(x) * 2

    batches = [x for x, _ in captured_training.batches(device)][:3]
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

    train = cross_entropy_step(model, opt)

    @engine.capture
    def step(x, y):
        return train(x, y).item()

    values = [step(x, y) for x, y in captured_training.batches(device)[:3]]
    # the read is seen on both devices (on the CPU a replay would repeat its value)
    assert "read on the host" in step.eager_reason and step.recordings == 0
    assert all(isinstance(v, float) for v in values)


def _train_at_cursor(device, batches, optimizer, repeated, batch_size=8, epochs=2):
    """Two epochs of a captured step that fetches its own batch at the loader's device
    cursor: ``repeat(batches)`` once an epoch, or ``batches`` calls; the last losses, the
    weights, the optimizer's state and the step."""
    engine.manual_seed(0)
    x, y = data.blobs(batch_size * batches, centers=3, seed=0)
    loader = data.DataLoader(x, y, batch_size=batch_size, shuffle=True, seed=0, device=device)
    model = nn.Sequential([nn.Dense(4, input_shape=(2,)), nn.Dense(3)]).to(device)
    opt = optimizer(model.parameters())
    cursor = loader.epoch_cursor()

    @engine.capture
    def step(count):
        opt.zero_grad()
        xb, yb = cursor.next_batch(count)
        loss = cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

    losses = []
    for _ in range(epochs):
        assert cursor.start_epoch() == [(k * batch_size, batch_size) for k in range(batches)]
        cursor.seek(0)
        losses.append(step.repeat(batches, batch_size).item() if repeated else
                      [step(batch_size) for _ in range(batches)][-1].item())
    return losses, model.state_dict(), opt.state_dict(), step


def _assert_same_training(run, repeated_run):
    (losses, weights, _, _), (repeated_losses, repeated_weights, _, _) = run, repeated_run
    assert repeated_losses == losses
    for name in weights:
        np.testing.assert_array_equal(repeated_weights[name], weights[name], err_msg=name)


def test_repeat_runs_the_steps_a_loop_of_calls_runs(device):
    """``repeat(n)`` of a step that fetches its own batch at the loader's device cursor is n
    calls: same losses and weights, the cursor and the optimizer's step count moved on. (The
    first epoch: eager, recorded, then 3 replays as one; the second: 5.)"""
    adam = lambda params: optim.Adam(params, lr=1e-2)   # noqa: E731
    runs = [_train_at_cursor(device, 5, adam, repeated) for repeated in (False, True)]
    _assert_same_training(*runs)
    assert [s["step"] for s in runs[1][2]["state"].values()] == [10] * 4


@pytest.mark.gpu
def test_a_long_repeat_is_one_device_loop_equal_to_calls():
    """``repeat(n)`` of n >= LOOP_UNROLL steps launches one graph whose WHILE node loops on
    the device (19 replayed steps: 2 passes of 8 and 3 more), with the results of n calls."""
    from engine.step_capture import LOOP_UNROLL
    sgd = lambda params: optim.SGD(params, lr=0.1, momentum=0.9)   # noqa: E731
    runs = [_train_at_cursor("cuda", 21, sgd, repeated) for repeated in (False, True)]
    _assert_same_training(*runs)
    (recording,) = runs[1][3]._recordings.values()
    assert LOOP_UNROLL == 8 and set(recording.loops) == {19 % 8, 21 % 8}
    assert all(graph is not None for graph in recording.loops.values())


def test_a_loaded_optimizer_state_is_recorded_anew_not_replayed_stale(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(4, input_shape=(5,))]).to(device)
    opt = optim.Adam(model.parameters(), lr=1e-2)

    step = engine.capture(cross_entropy_step(model, opt))
    x, y = captured_training.batches(device)[0]
    for _ in range(3):
        step(x, y)
    saved = opt.state_dict()
    weights = model.state_dict()
    expected = [step(x, y).item() for _ in range(2)]
    model.load_state_dict(weights)
    opt.load_state_dict(saved)   # new state buffers: the recording's are stale
    assert [step(x, y).item() for _ in range(2)] == expected
    assert [s["step"] for s in opt.state_dict()["state"].values()] == [5, 5]


def _weights_and_state(model, opt):
    return model.state_dict(), opt.state_dict()


def _assert_same(a, b):
    (weights_a, state_a), (weights_b, state_b) = a, b
    for name in weights_a:
        np.testing.assert_array_equal(weights_a[name], weights_b[name], err_msg=name)
    assert state_a["state"].keys() == state_b["state"].keys()
    for index, saved in state_a["state"].items():
        for name, value in saved.items():
            np.testing.assert_array_equal(value, state_b["state"][index][name], err_msg=name)


def _mlp_and_adam(device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(6, activation="relu", input_shape=(5,)),
                           nn.Dense(4)]).to(device)
    return model, optim.Adam(model.parameters(), lr=1e-2)


def test_freezing_a_layer_between_replays_is_honoured(device):
    """``requires_grad = False`` after the step was recorded stops its updates, as eagerly."""
    runs = []
    for captured in (False, True):
        model, opt = _mlp_and_adam(device)
        step = cross_entropy_step(model, opt)
        step = engine.capture(step) if captured else step
        x, y = captured_training.batches(device)[0]
        losses = [step(x, y).item() for _ in range(4)]
        frozen = model.layers[0].weight
        before = frozen.numpy().copy()
        frozen.requires_grad = False
        losses += [step(x, y).item() for _ in range(3)]
        np.testing.assert_array_equal(frozen.numpy(), before)   # not one update
        frozen.requires_grad = True
        losses += [step(x, y).item() for _ in range(3)]
        runs.append((losses, _weights_and_state(model, opt), step))
    assert runs[1][0] == runs[0][0]
    _assert_same(runs[1][1], runs[0][1])
    step = runs[1][2]
    assert step.eager_reason is None and step.replayed >= 4


@pytest.mark.parametrize("read", ["item", "float", "bool"])
def test_a_host_branch_inside_the_step_runs_eagerly_on_both_devices(device, read):
    runs = []
    for captured in (False, True):
        model, opt = _mlp_and_adam(device)

        def step(x, y):
            opt.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            value = {"item": lambda: loss.item(), "float": lambda: float(loss),
                     "bool": lambda: bool(loss > 1.39)}[read]()
            if value > 1.39:   # the branch a replay would freeze
                opt.step()
            return loss

        step = engine.capture(step) if captured else step
        losses = [step(x, y).item() for x, y in captured_training.batches(device) * 2]
        runs.append((losses, _weights_and_state(model, opt), step))
    assert runs[1][0] == runs[0][0]
    _assert_same(runs[1][1], runs[0][1])
    assert "read on the host" in runs[1][2].eager_reason and runs[1][2].recordings == 0


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_first_call_that_raises_leaves_nothing_half_recorded(device, warmup):
    """Adam's first update must not be frozen into the recording: a first call that raises
    before ``opt.step()``, and ``warmup=0``, replay as the eager step runs."""
    runs = []
    for captured in (False, True):
        model, opt = _mlp_and_adam(device)
        fail = [True]

        def fail_once():
            if fail[0]:
                fail[0] = False
                raise RuntimeError("the first call fails before opt.step()")

        step = cross_entropy_step(model, opt, before_step=fail_once)
        step = engine.capture(step, warmup=warmup) if captured else step
        x, y = captured_training.batches(device)[0]
        with pytest.raises(RuntimeError, match="first call fails"):
            step(x, y)
        losses = [step(x, y).item() for _ in range(6)]
        runs.append((losses, _weights_and_state(model, opt), step))
    assert runs[1][0] == runs[0][0]
    _assert_same(runs[1][1], runs[0][1])
    assert runs[1][2].eager_reason is None and runs[1][2].replayed >= 3


def test_a_bad_label_in_a_replayed_call_changes_nothing(device):
    model, opt = _mlp_and_adam(device)
    step = engine.capture(cross_entropy_step(model, opt))
    x, y = captured_training.batches(device)[0]
    for _ in range(4):
        step(x, y).item()
    assert step.replayed == 2
    before = _weights_and_state(model, opt)
    bad = engine.tensor(np.where(np.arange(6) == 2, 7, y.numpy()), device=device)
    with pytest.raises(ValueError, match=r"label 7 at row 2 is outside \[0, 4\).*call 5"):
        step(x, bad).item()   # on CUDA the host read after the call raises
    assert step.replayed == 3   # it was a replay
    _assert_same(_weights_and_state(model, opt), before)
    assert opt.state[model.layers[0].weight]["step"] == 4
    step(x, y).item()   # training goes on from the state before the bad call
    assert opt.state[model.layers[0].weight]["step"] == 5


def test_train_and_eval_modes_each_get_their_recording(device):
    runs = []
    for captured in (False, True):
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(6, activation="relu", input_shape=(5,)),
                               nn.Dropout(0.5), nn.Dense(4)]).to(device)
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = cross_entropy_step(model, opt)
        step = engine.capture(step) if captured else step
        x, y = captured_training.batches(device)[0]
        losses = []
        for mode in (True, False, True, False):
            model.train(mode)
            losses += [step(x, y).item() for _ in range(3)]
        runs.append((losses, _weights_and_state(model, opt), step))
    assert runs[1][0] == runs[0][0]
    _assert_same(runs[1][1], runs[0][1])
    step = runs[1][2]
    assert step.recordings == 2 and step.replayed == 8   # the second visits replay at once


def test_capture_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        engine.capture(lambda x: x, warmup=-1)
    step = engine.capture(lambda x: x)
    with pytest.raises(TypeError, match="neither a Tensor nor hashable"):
        step([1, 2])


@pytest.mark.gpu
def test_the_cuda_replay_is_one_graph():
    assert not SIMULATOR
    _, _, _, step = captured_training.train("cuda", True, OPTIMIZERS["adam"], epochs=2)
    assert all(recording.graphs for recording in step._recordings.values())
