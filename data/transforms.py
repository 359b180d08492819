"""Data augmentation applied to whole batches on their device: Gaussian pixel noise, and
per-sample shifts, crops and flips of images.

Adding small Gaussian noise to every input pixel is a cheap regulariser against
overfitting an MLP on MNIST. The noise is drawn inside the kernel from a counter-based
generator (splitmix64 of seed, call number and element pair, then Box-Muller), so the
CUDA path needs no random numbers from the host, and the CPU and CUDA kernels compute the
same noise for the same seed.

``RandomShift``, ``RandomCrop`` and ``RandomFlip`` move each sample's image (the last two
axes) by its own random offset and flip, drawn from ``(seed, epoch, the sample's position in
the epoch)``: the same augmented epoch on either device, on a resumed run, and in a captured
step. A ``DataLoader`` keeps the epoch and the batch's position in small device arrays that
the kernel reads (``ops.step_counter``), so ``fit``'s captured step fetches and augments its
own batches with no Python between steps. Pixels shifted in from outside the image are 0.
"""
import math

import numpy as np
from numba import njit

from engine.random import generator
from engine.tensor import Tensor
from ops.cuda import cuda
from ops.dispatch import Out, run
from ops.launch import Kernel, elements
from ops.layout import flat
from ops.step_counter import new_counter, set_counter

_GOLDEN = 0x9E3779B97F4A7C15   # splitmix64's increment
_MASK64 = (1 << 64) - 1


def _mix64(z):
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_key(seed):
    """The 64-bit key a device-keyed draw starts from (the windows here, the loader's
    sequence windows): ``seed`` scrambled, so neighbouring seeds draw unrelated streams."""
    with np.errstate(over="ignore"):   # uint64 wrap-around is the point of the hash
        return np.uint64(_mix64(np.uint64(seed & _MASK64)))


def _polar_sampler(mix64):
    """The Box-Muller sampler for one device, given that device's compiled ``_mix64``."""
    def polar(key, pair):
        """Radius and angle of the Gaussian pair ``pair`` of the stream ``key``: elements
        ``2 pair`` and ``2 pair + 1`` get ``radius * cos(angle)`` and ``radius * sin(angle)``."""
        z1 = mix64(key + np.uint64(2 * pair + 1) * np.uint64(_GOLDEN))
        z2 = mix64(key + np.uint64(2 * pair + 2) * np.uint64(_GOLDEN))
        u1 = (float(z1 >> np.uint64(11)) + 1.0) * (1.0 / 9007199254740992.0)   # (0, 1]: finite log
        u2 = float(z2 >> np.uint64(11)) * (1.0 / 9007199254740992.0)           # [0, 1)
        return math.sqrt(-2.0 * math.log(u1)), 2.0 * math.pi * u2
    return polar


_polar_cpu = njit(inline="always")(_polar_sampler(njit(inline="always")(_mix64)))
_polar_cuda = cuda.jit(device=True)(_polar_sampler(cuda.jit(device=True)(_mix64)))


@njit(cache=True)
def gaussian_noise_cpu(x, out, key, std, low, high):
    # a pair of elements per iteration: one log and sqrt serve both
    for pair in range((out.size + 1) // 2):
        radius, angle = _polar_cpu(key, pair)
        i = 2 * pair
        out[i] = min(max(x[i] + std * (radius * math.cos(angle)), low), high)
        if i + 1 < out.size:
            out[i + 1] = min(max(x[i + 1] + std * (radius * math.sin(angle)), low), high)


@cuda.jit(cache=True)
def gaussian_noise_cuda(x, out, key, std, low, high):
    i = cuda.grid(1)
    if i < out.size:
        radius, angle = _polar_cuda(key, i // 2)
        normal = radius * math.cos(angle) if i % 2 == 0 else radius * math.sin(angle)
        out[i] = min(max(x[i] + std * normal, low), high)


GAUSSIAN_NOISE = Kernel("gaussian_noise", gaussian_noise_cpu, gaussian_noise_cuda, elements(1))


class GaussianNoise:
    """``x + std * N(0, 1)`` per element, optionally clipped to ``clip = (low, high)``.

    Use it as ``DataLoader(..., transform=GaussianNoise(0.1, seed=0))``. Call ``n`` of one
    instance draws the stream seeded by ``(seed, n)``: a fresh draw every batch, and the
    same sequence of draws for the same seed on either device. ``seed=None`` takes one from
    the engine's generator (``engine.manual_seed``).
    """

    def __init__(self, std=0.1, seed=None, clip=None):
        if not std >= 0:
            raise ValueError(f"GaussianNoise: std must be >= 0, got {std!r}")
        self.std = float(std)
        self.seed = int(generator().integers(2 ** 63)) if seed is None else int(seed)
        self.low, self.high = (-math.inf, math.inf) if clip is None else map(float, clip)
        if not self.low <= self.high:
            raise ValueError(f"GaussianNoise: clip must be (low, high) with low <= high, got {clip!r}")
        self.calls = 0

    def __call__(self, batch):
        if not isinstance(batch, Tensor) or batch.dtype.kind != "f":
            raise TypeError(f"GaussianNoise: expects a float Tensor batch, got {batch!r:.80}")
        if batch.requires_grad:
            raise TypeError("GaussianNoise: augments input batches; this tensor requires grad "
                            "and the noise would not be recorded on the tape")
        key = self._stream_key(self.calls)
        self.calls += 1
        x = batch.data
        scalars = (np.uint64(key),) + tuple(x.dtype.type(v) for v in (self.std, self.low, self.high))
        return Tensor(run(GAUSSIAN_NOISE, flat(x), Out(x.shape, x.dtype), *scalars))

    def _stream_key(self, call):
        """A 64-bit key per (seed, call), scrambled so that neighbouring calls are unrelated."""
        z = (self.seed * _GOLDEN + call) & _MASK64
        with np.errstate(over="ignore"):   # uint64 wrap-around is the point of the hash
            return int(_mix64(np.uint64(z)))

    def __repr__(self):
        clip = "" if math.isinf(self.low) and math.isinf(self.high) else f", clip=({self.low}, {self.high})"
        return f"GaussianNoise(std={self.std}, seed={self.seed}{clip})"


# ------------------------------------------------------------------ shifts, crops and flips

def _window_draw(mix64):
    """The sample's window offsets and flip, given that device's compiled ``_mix64``."""
    def draw(seed_key, epoch, position, range_y, range_x, flip_threshold):
        z = mix64(seed_key + np.uint64(epoch) * np.uint64(_GOLDEN)
                  + np.uint64(position) * np.uint64(0xD1B54A32D192ED03))
        dy = int(z % np.uint64(range_y + 1))
        dx = int((z >> np.uint64(20)) % np.uint64(range_x + 1))
        flip = (z >> np.uint64(40)) < np.uint64(flip_threshold)   # 24 bits against p * 2**24
        return dy, dx, flip
    return draw


_window_draw_cpu = njit(inline="always")(_window_draw(njit(inline="always")(_mix64)))
_window_draw_cuda = cuda.jit(device=True)(_window_draw(cuda.jit(device=True)(_mix64)))


def _window_element(draw):
    """Output element k of (N, P, H_out, W_out) from x of (N, P, H, W)."""
    def element(k, x, out, epoch, position, seed_key, pad, range_y, range_x, flip_threshold):
        _, planes, height, width = x.shape
        _, _, out_h, out_w = out.shape
        j = k % out_w
        i = (k // out_w) % out_h
        plane = (k // (out_w * out_h)) % planes
        n = k // (out_w * out_h * planes)
        dy, dx, flip = draw(seed_key, epoch[0], position[0] + n, range_y, range_x,
                            flip_threshold)
        source_x = (out_w - 1 - j if flip else j) + dx - pad
        source_y = i + dy - pad
        if 0 <= source_y < height and 0 <= source_x < width:
            out[n, plane, i, j] = x[n, plane, source_y, source_x]
        else:
            out[n, plane, i, j] = 0.0
    return element


_window_cpu_element = njit(inline="always")(_window_element(_window_draw_cpu))
_window_cuda_element = cuda.jit(device=True)(_window_element(_window_draw_cuda))


@njit(cache=True)
def random_window_cpu(x, out, epoch, position, seed_key, pad, range_y, range_x, flip_threshold):
    for k in range(out.size):
        _window_cpu_element(k, x, out, epoch, position, seed_key, pad, range_y, range_x,
                            flip_threshold)


@cuda.jit(cache=True)
def random_window_cuda(x, out, epoch, position, seed_key, pad, range_y, range_x,
                       flip_threshold):
    k = cuda.grid(1)
    if k < out.size:
        _window_cuda_element(k, x, out, epoch, position, seed_key, pad, range_y, range_x,
                             flip_threshold)


RANDOM_WINDOW = Kernel("random_window", random_window_cpu, random_window_cuda, elements(1))
FLIP_SCALE = 1 << 24   # the flip compares 24 random bits with p * 2**24


class RandomWindow:
    """A per-sample window of each image, shifted, cropped and flipped at random (the common
    kernel of ``RandomShift``, ``RandomCrop`` and ``RandomFlip``). Use it as a
    ``DataLoader(..., transform=...)``; called by hand, ``transform(batch, epoch=0,
    position=0)`` augments ``batch`` as the samples at ``position`` of epoch ``epoch``."""

    device_keyed = True   # DataLoader passes the epoch and position on the device

    def __init__(self, size, pad, flip_p, seed):
        self.size, self.pad = size, int(pad)
        if not 0 <= flip_p <= 1:
            raise ValueError(f"{type(self).__name__}: p must be in [0, 1], got {flip_p!r}")
        self.flip_p = float(flip_p)
        self.seed = int(generator().integers(2 ** 63)) if seed is None else int(seed)
        self.seed_key = stream_key(self.seed)

    def __call__(self, batch, epoch=0, position=0):
        device = getattr(batch, "device", "cpu")
        return self.apply(batch, new_counter(device, epoch), new_counter(device, position))

    def apply(self, batch, epoch, position):
        """``batch`` augmented as the samples at ``position[0]`` of epoch ``epoch[0]`` (one-
        element int64 device arrays the loader keeps)."""
        if not isinstance(batch, Tensor) or batch.dtype.kind != "f" or batch.ndim < 3:
            raise TypeError(f"{type(self).__name__}: expects a float Tensor batch of images "
                            f"(N, ..., H, W), got {batch!r:.80}")
        if batch.requires_grad:
            raise TypeError(f"{type(self).__name__}: augments input batches; this tensor "
                            "requires grad and the window would not be recorded on the tape")
        height, width = batch.shape[-2:]
        out_h, out_w = self.size or (height, width)
        range_y, range_x = height + 2 * self.pad - out_h, width + 2 * self.pad - out_w
        if range_y < 0 or range_x < 0:
            raise ValueError(f"{type(self).__name__}: a {out_h}x{out_w} crop is larger than "
                             f"the {height}x{width} image plus padding {self.pad}")
        x = batch.data
        planes = int(np.prod(x.shape[1:-2], dtype=np.int64))
        images = x.reshape((x.shape[0], planes, height, width))
        out = run(RANDOM_WINDOW, images, Out((x.shape[0], planes, out_h, out_w), x.dtype,
                                             flat=False),
                  epoch, position, self.seed_key, self.pad, range_y, range_x,
                  int(round(self.flip_p * FLIP_SCALE)))
        return Tensor(out.reshape(x.shape[:-2] + (out_h, out_w)))


class RandomShift(RandomWindow):
    """Shift each image by up to ``pixels`` in each direction (a uniform integer offset per
    axis and sample), filling with 0: MNIST's classic augmentation."""

    def __init__(self, pixels, seed=None):
        if not isinstance(pixels, (int, np.integer)) or pixels < 0:
            raise ValueError(f"RandomShift: pixels must be an integer >= 0, got {pixels!r}")
        super().__init__(None, pixels, 0.0, seed)
        self.pixels = int(pixels)

    def __repr__(self):
        return f"RandomShift(pixels={self.pixels}, seed={self.seed})"


class RandomCrop(RandomWindow):
    """A random ``size`` crop (an int or ``(height, width)``) of each image padded with
    ``padding`` zeros on every side, as torchvision's ``RandomCrop(size, padding)``."""

    def __init__(self, size, padding=0, seed=None):
        size = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
        if len(size) != 2 or not all(isinstance(s, (int, np.integer)) and s > 0 for s in size):
            raise ValueError(f"RandomCrop: size must be an integer > 0 or a pair of them, "
                             f"got {size!r}")
        if not isinstance(padding, (int, np.integer)) or padding < 0:
            raise ValueError(f"RandomCrop: padding must be an integer >= 0, got {padding!r}")
        super().__init__(tuple(int(s) for s in size), padding, 0.0, seed)

    def __repr__(self):
        return f"RandomCrop(size={self.size}, padding={self.pad}, seed={self.seed})"


class RandomFlip(RandomWindow):
    """Flip each image left to right with probability ``p``."""

    def __init__(self, p=0.5, seed=None):
        super().__init__(None, 0, p, seed)

    def __repr__(self):
        return f"RandomFlip(p={self.flip_p}, seed={self.seed})"


class Compose:
    """Several transforms in turn, as torchvision's ``Compose``. Made of device-keyed
    augmentations only (``RandomShift``, ``RandomCrop``, ``RandomFlip``), it is one too, and
    a captured step can run it."""

    def __init__(self, transforms):
        self.transforms = list(transforms)
        for transform in self.transforms:
            if not callable(transform):
                raise TypeError(f"Compose: {transform!r} is not callable")
        self.device_keyed = all(getattr(t, "device_keyed", False) for t in self.transforms)

    def __call__(self, batch):
        for transform in self.transforms:
            batch = transform(batch)
        return batch

    def apply(self, batch, epoch, position):
        for transform in self.transforms:
            batch = transform.apply(batch, epoch, position)
        return batch

    def __repr__(self):
        return f"Compose({self.transforms!r})"
