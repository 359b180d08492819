"""RandomShift, RandomCrop and RandomFlip: each sample's window from (seed, epoch, position)
against a NumPy model of the same draw, CPU == CUDA, every element written (poison), the same
batches from iteration and from the device cursor, and fit's captured step == eager."""
import numpy as np
import pytest

import data
import engine
import optim
from data.transforms import FLIP_SCALE, _GOLDEN, _mix64
from engine import nn
from engine.fit import fit
from engine.losses import cross_entropy

# the in-kernel hash wraps uint64 on purpose; NumPy scalar math (and the simulator) warn
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _expected(images, transform, epoch, position):
    """The augmented batch computed in NumPy from the same splitmix64 draw."""
    n, height, width = images.shape[0], images.shape[-2], images.shape[-1]
    out_h, out_w = transform.size or (height, width)
    pad = transform.pad
    range_y, range_x = height + 2 * pad - out_h, width + 2 * pad - out_w
    padded = np.pad(images, [(0, 0)] * (images.ndim - 2) + [(pad, pad), (pad, pad)])
    out = np.empty(images.shape[:-2] + (out_h, out_w), images.dtype)
    threshold = np.uint64(int(round(transform.flip_p * FLIP_SCALE)))
    with np.errstate(over="ignore"):
        for sample in range(n):
            z = _mix64(transform.seed_key + np.uint64(epoch) * np.uint64(_GOLDEN)
                       + np.uint64(position + sample) * np.uint64(0xD1B54A32D192ED03))
            dy, dx = int(z % np.uint64(range_y + 1)), int((z >> np.uint64(20)) % np.uint64(range_x + 1))
            window = padded[sample, ..., dy:dy + out_h, dx:dx + out_w]
            out[sample] = window[..., ::-1] if (z >> np.uint64(40)) < threshold else window
    return out


TRANSFORMS = [lambda: data.RandomShift(2, seed=5), lambda: data.RandomCrop((4, 3), padding=1, seed=9),
              lambda: data.RandomFlip(0.5, seed=1), lambda: data.RandomCrop(5, seed=2)]


@pytest.mark.parametrize("make", TRANSFORMS)
def test_each_sample_gets_the_window_of_its_draw(make, device):
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, size=(6, 2, 5, 7))
    transform = make()
    out = transform(engine.tensor(images, device=device), epoch=3, position=40).numpy()
    np.testing.assert_array_equal(out, _expected(images, transform, 3, 40))
    with engine.debug.poison():
        again = transform(engine.tensor(images, device=device), epoch=3, position=40).numpy()
    np.testing.assert_array_equal(again, out)


def test_draws_differ_across_samples_and_epochs_and_are_uniform():
    shift = data.RandomShift(2, seed=0)
    images = np.zeros((4000, 5, 5), np.float32)
    images[:, 2, 2] = 1.0   # one bright pixel: where it lands is the sample's offset
    out = shift(engine.tensor(images), epoch=0).numpy()
    rows, cols = np.nonzero(out.reshape(4000, 25))[1] // 5, np.nonzero(out.reshape(4000, 25))[1] % 5
    counts = np.bincount(rows * 5 + cols, minlength=25)
    assert counts.min() > 4000 / 25 * 0.7 and counts.max() < 4000 / 25 * 1.3   # 25 offsets, even
    other_epoch = shift(engine.tensor(images), epoch=1).numpy()
    assert (other_epoch != out).any()
    flips = data.RandomFlip(0.25, seed=3)(engine.tensor(np.tile(np.arange(4.0), (4000, 1, 1))))
    assert abs((flips.numpy()[:, 0, 0] == 3).mean() - 0.25) < 0.03


def test_identity_and_certain_flip():
    images = engine.tensor(np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4))
    np.testing.assert_array_equal(data.RandomShift(0)(images).numpy(), images.numpy())
    np.testing.assert_array_equal(data.RandomFlip(1.0)(images).numpy(), images.numpy()[..., ::-1])


@pytest.mark.parametrize("make, words", [
    (lambda: data.RandomCrop(8, padding=1), r"a 8x8 crop is larger than the 5x5 image plus padding 1"),
    (lambda: data.RandomShift(-1), "pixels must be an integer >= 0"),
    (lambda: data.RandomFlip(1.5), r"p must be in \[0, 1\]"),
    (lambda: data.RandomCrop(0), "size must be an integer > 0"),
])
def test_bad_arguments_are_named(make, words):
    with pytest.raises(ValueError, match=words):
        make()(engine.tensor(np.zeros((2, 5, 5))))


def test_a_batch_without_image_axes_is_refused():
    with pytest.raises(TypeError, match=r"RandomShift: expects a float Tensor batch of images"):
        data.RandomShift(1)(engine.tensor(np.zeros((4, 9))))


def _loader(device, transform):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(23, 6, 6), dtype=np.uint8)
    y = rng.integers(0, 3, size=23)
    return data.DataLoader(x, y, batch_size=5, shuffle=True, seed=4, device=device,
                           transform=transform)


def test_the_cursor_fetches_the_batches_iteration_gives(device):
    make = lambda: data.Compose([data.RandomShift(1, seed=2), data.RandomFlip(0.5, seed=3)])
    iterated = _loader(device, make())
    epochs = [[(xb.numpy(), yb.numpy()) for xb, yb in iterated] for _ in range(2)]
    cursor_loader = _loader(device, make())
    cursor = cursor_loader.epoch_cursor()
    for epoch in epochs:
        spans = cursor.start_epoch()
        for (x_expected, y_expected), (start, count) in zip(epoch, spans):
            xb, yb = cursor.next_batch(count)
            np.testing.assert_array_equal(xb.numpy(), x_expected)
            np.testing.assert_array_equal(yb.numpy(), y_expected)
    assert (epochs[0][0][0] != epochs[1][0][0]).any()


def test_gaussian_noise_still_has_no_cursor():
    loader = _loader("cpu", data.GaussianNoise(0.1, seed=0))
    assert not loader.fetches_on_device
    with pytest.raises(ValueError, match="not device-keyed"):
        loader.epoch_cursor()


def test_fit_captures_the_augmented_step_and_equals_eager(device):
    results = []
    for capture in (True, False):
        engine.manual_seed(0)
        loader = _loader(device, data.RandomShift(1, seed=7))
        model = nn.Sequential([nn.Flatten(input_shape=(6, 6)), nn.Dense(3)]).to(device)
        opt = optim.SGD(model.parameters(), lr=0.1)
        history = fit(model, loader, opt, cross_entropy, 2, progress=False, verbose=False,
                      capture=capture)
        results.append(([r["loss"] for r in history], model.state_dict(), fit.last_eager_reason))
    (captured_losses, captured, reason), (eager_losses, eager, _) = results
    assert reason is None and captured_losses == eager_losses
    for name, value in eager.items():
        np.testing.assert_array_equal(captured[name], value, err_msg=name)
