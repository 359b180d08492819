"""Small synthetic data sets for tests, examples and first experiments.

Each returns ``(x, y)``: float32 features ``[N, dim]`` and int64 class labels ``[N]``, drawn
from its own generator seeded by ``seed`` (the engine's global seed is left alone).
"""
import math

import numpy as np


def xor():
    """The four XOR points: x = (0,0), (0,1), (1,0), (1,1) as float32 ``[4, 2]``,
    y = 0, 1, 1, 0 as int64 ``[4]`` (x₀ XOR x₁)."""
    x = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=np.float32)
    y = np.array([0, 1, 1, 0], dtype=np.int64)
    return x, y


def spirals(n=200, seed=0, classes=2, turns=1.5, noise=0.1):
    """``n`` points in 2-D on ``classes`` interleaved spiral arms; the label is the arm.

    Arm ``k`` starts at the origin at angle ``2 pi k / classes`` and winds ``turns`` times
    out to radius 1; ``noise`` is the standard deviation of the Gaussian jitter added to
    each coordinate. Points are in random order; classes differ in size by at most one.
    Returns x float32 ``[n, 2]``, y int64 ``[n]``."""
    _check_counts("spirals", n, classes)
    rng = np.random.default_rng(seed)
    y = np.arange(n, dtype=np.int64) % classes
    x = np.empty((n, 2), dtype=np.float64)
    for arm in range(classes):
        members = np.flatnonzero(y == arm)
        radius = np.linspace(0.05, 1.0, len(members))
        angle = 2 * math.pi * (arm / classes + turns * radius)
        x[members, 0] = radius * np.cos(angle)
        x[members, 1] = radius * np.sin(angle)
    x += noise * rng.standard_normal(x.shape)
    order = rng.permutation(n)
    return x[order].astype(np.float32), y[order]


def blobs(n=300, centers=3, dim=2, spread=1.0, seed=0, box=5.0):
    """``n`` points around Gaussian cluster centres; the label is the cluster.

    ``centers`` is a count (centres drawn uniformly from ``[-box, box]^dim``) or an array
    ``[k, dim]`` of centres; ``spread`` is the standard deviation around each centre.
    Points are in random order; clusters differ in size by at most one.
    Returns x float32 ``[n, dim]``, y int64 ``[n]``."""
    rng = np.random.default_rng(seed)
    if np.ndim(centers) == 0:
        _check_counts("blobs", n, int(centers))
        centres = rng.uniform(-box, box, size=(int(centers), dim))
    else:
        centres = np.asarray(centers, dtype=np.float64)
        if centres.ndim != 2:
            raise ValueError(f"blobs: centers must be a count or a [k, dim] array, got shape {centres.shape}")
        _check_counts("blobs", n, len(centres))
    y = np.arange(n, dtype=np.int64) % len(centres)
    x = centres[y] + spread * rng.standard_normal((n, centres.shape[1]))
    order = rng.permutation(n)
    return x[order].astype(np.float32), y[order]


def _check_counts(name, n, classes):
    if classes < 1 or n < classes:
        raise ValueError(f"{name}: needs at least one point per class, got n={n} for {classes} classes")
