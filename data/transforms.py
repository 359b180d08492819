"""Data augmentation applied to whole batches on their device: Gaussian pixel noise.

Adding small Gaussian noise to every input pixel is a cheap regulariser against
overfitting an MLP on MNIST. The noise is drawn inside the kernel from a counter-based
generator (splitmix64 of seed, call number and element pair, then Box-Muller), so the
CUDA path needs no random numbers from the host, and the CPU and CUDA kernels compute the
same noise for the same seed.
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

_GOLDEN = 0x9E3779B97F4A7C15   # splitmix64's increment
_MASK64 = (1 << 64) - 1


def _mix64(z):
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


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
