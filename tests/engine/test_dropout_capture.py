"""Dropout inside ``engine.capture``: the mask seed is hashed on the device from the layer's
seed state, so a replayed step draws the masks the eager step draws, bit for bit; and the
state travels with the model, so ``manual_seed`` and checkpoints reproduce the masks."""
import numpy as np
import pytest

import data
import engine
import optim
from engine import nn
from engine.fit import fit, read_checkpoint, restore_checkpoint, save_checkpoint
from engine.losses import cross_entropy
from ops import dropout as dropout_op
from ops.device import to_device, to_host
from ops.step_counter import set_counter
from tests.support.training_step import cross_entropy_step

STEPS = 6


def _batches(device, steps=STEPS, rows=7, features=5, classes=4):
    rng = np.random.default_rng(0)
    return [(engine.tensor(rng.standard_normal((rows, features)), dtype=np.float32,
                           device=device),
             engine.tensor(rng.integers(0, classes, rows), device=device))
            for _ in range(steps)]


def _mlp(device):
    return nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)), nn.Dropout(0.5),
                          nn.Dense(6, activation="relu"), nn.Dropout(0.3),
                          nn.Dense(4)]).to(device)


def _train(device, captured):
    engine.manual_seed(0)
    model = _mlp(device)
    opt = optim.Adam(model.parameters(), lr=1e-2)

    step = cross_entropy_step(model, opt)
    if captured:
        step = engine.capture(step)
    losses = [step(x, y).item() for x, y in _batches(device)]
    return losses, model.state_dict(), step


def test_captured_dropout_training_equals_eager_bit_for_bit(device):
    eager_losses, eager_weights, _ = _train(device, captured=False)
    losses, weights, step = _train(device, captured=True)
    assert step.eager_reason is None and step.recordings == 1   # 1 eager, 1 recorded, 4 replays
    assert losses == eager_losses
    assert len(set(losses)) == STEPS
    for name in eager_weights:
        np.testing.assert_array_equal(weights[name], eager_weights[name], err_msg=name)
    # every call drew a mask, replayed ones included
    assert weights["dropout.masks_drawn"].tolist() == [STEPS]
    assert weights["dropout_1.masks_drawn"].tolist() == [STEPS]


def _masks(device, captured, calls=4):
    """What two Dropout layers, one of them called twice, give a batch of ones per call."""
    engine.manual_seed(0)
    first, second = nn.Dropout(0.5), nn.Dropout(0.5)
    ones = engine.ones(3, 7, device=device)

    def draw(x):
        return first(x), first(x), second(x)

    if captured:
        draw = engine.capture(draw)
    return [[mask.numpy() for mask in draw(ones)] for _ in range(calls)], draw


def test_masks_differ_between_steps_layers_and_calls_and_replay_as_eager(device):
    eager, _ = _masks(device, captured=False)
    replayed, draw = _masks(device, captured=True)
    assert draw.eager_reason is None and draw.recordings == 1
    masks = [mask for call in replayed for mask in call]
    assert all(set(np.unique(mask)) <= {0.0, 2.0} for mask in masks)
    distinct = {mask.tobytes() for mask in masks}
    assert len(distinct) == len(masks)   # 4 steps x (a layer twice, another once)
    for eager_call, replayed_call in zip(eager, replayed):
        for eager_mask, mask in zip(eager_call, replayed_call):
            np.testing.assert_array_equal(mask, eager_mask)


def test_backward_reads_its_own_forwards_seed(device):
    """Two calls of one layer before one backward: each gradient uses its own mask, though
    the layer's count moved on after the first."""
    layer = nn.Dropout(0.5)
    x = engine.ones(5, 9, device=device, requires_grad=True)
    a, b = layer(x), layer(x)
    (a * 2.0 + b).sum().backward()
    assert not np.array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), 2 * a.numpy() + b.numpy())


def test_manual_seed_before_building_reproduces_the_masks(device):
    x = engine.ones(4, 8, device=device)

    def masks(seed):
        engine.manual_seed(seed)
        model = nn.Sequential([nn.Flatten(input_shape=(8,)), nn.Dropout(0.5)]).to(device)
        return [model(x).numpy() for _ in range(3)]

    first = masks(5)
    for mask, again in zip(first, masks(5)):
        np.testing.assert_array_equal(again, mask)
    assert not any(np.array_equal(mask, other) for mask, other in zip(first, masks(6)))


def test_a_checkpoint_resumed_with_fit_continues_the_masks_exactly(tmp_path):
    x, y = data.blobs(42, centers=3, seed=0)

    def setup():
        engine.manual_seed(0)
        model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)),
                               nn.Dropout(0.4), nn.Dense(3)])
        loader = data.DataLoader(x, y, batch_size=7, shuffle=True, seed=0)
        return model, loader, optim.Adam(model.parameters(), lr=0.05)

    def train(model, loader, opt, epochs, start_epoch=0, history=None):
        return fit(model, loader, opt, cross_entropy, epochs, start_epoch=start_epoch,
                   history=history, progress=False, verbose=False)

    model, loader, opt = setup()
    straight = train(model, loader, opt, 2)
    path = str(tmp_path / "run.npz")
    first, loader, opt = setup()
    save_checkpoint(path, first, opt, 1, train(first, loader, opt, 1))
    resumed, loader, opt = setup()
    start_epoch, history = restore_checkpoint(read_checkpoint(path), resumed, opt)
    loader.epoch = start_epoch
    continued = train(resumed, loader, opt, 2, start_epoch, history)
    assert [(r["loss"], r["train_acc"]) for r in continued] == \
        [(r["loss"], r["train_acc"]) for r in straight]
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)
    assert resumed.state_dict()["dropout.masks_drawn"].tolist() == [12]   # 2 epochs x 6


def test_a_saved_model_draws_on_from_its_seed_state(tmp_path, device):
    engine.manual_seed(0)
    model = nn.Sequential([nn.Flatten(input_shape=(8,)), nn.Dropout(0.5)])
    x = engine.ones(4, 8)
    model(x)
    model.save(tmp_path / "model.npz")
    loaded = nn.load(tmp_path / "model.npz", device=device)
    np.testing.assert_array_equal(loaded(x.to(device)).numpy(), model(x).numpy())


@pytest.mark.cuda
def test_cpu_and_cuda_draw_the_same_seeds_and_masks_from_one_state():
    x = np.random.default_rng(0).standard_normal((6, 11)).astype(np.float32)
    for base, count in ((0, 0), (12345, 7), (2 ** 63 - 1, 2 ** 40 + 3)):
        seeds, masks = [], []
        for device in ("cpu", "cuda"):
            base_seed, masks_drawn = dropout_op.new_seed_state(base, device)
            set_counter(masks_drawn, count)
            seed = dropout_op.next_mask_seed(base_seed, masks_drawn)
            seeds.append(to_host(seed))
            masks.append(to_host(dropout_op.dropout(to_device(x, device), 0.4, seed)))
            assert to_host(masks_drawn).tolist() == [count + 1]
        np.testing.assert_array_equal(seeds[1], seeds[0])
        assert 0 <= int(seeds[0][0]) < dropout_op.SEED_LIMIT
        np.testing.assert_array_equal(masks[1], masks[0])
    calls = {}
    for device in ("cpu", "cuda"):
        engine.manual_seed(9)
        layer = nn.Dropout(0.4)
        calls[device] = [layer(engine.tensor(x, device=device)).numpy() for _ in range(3)]
    for on_cpu, on_cuda in zip(calls["cpu"], calls["cuda"]):
        np.testing.assert_array_equal(on_cuda, on_cpu)
