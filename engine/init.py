"""Weight initialisers: ``shape -> host NumPy array``, drawn from the engine's seeded generator.

A kernel of shape ``(fan_in, fan_out)`` (the Dense layout, ``x @ W``) is filled so that
activations keep their scale through the layers: He for the relu family (variance
``2 / fan_in``), Xavier/Glorot otherwise (variance ``2 / (fan_in + fan_out)``). The ratios
are computed in floating point: an integer ``2 / n_in`` (0 for any n_in > 2 in Python 2 and
C) would give all-zero weights.

``engine.manual_seed(s)`` makes every initialiser reproducible.
"""
import math

import numpy as np

from engine.random import generator


def fans(shape):
    """``(fan_in, fan_out)`` of a weight of ``shape``: the last axis is the output units."""
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"init: a weight needs a non-empty shape of positive sizes, got {shape}")
    if len(shape) == 1:
        return shape[0], shape[0]
    return math.prod(shape[:-1]), shape[-1]


def _float_dtype(dtype, where):
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"init.{where}: dtype must be float32 or float64, got {dtype}")
    return dtype


def he_normal(shape, dtype=np.float32, seed=None):
    """Normal with standard deviation ``sqrt(2 / fan_in)`` (Kaiming He et al., 2015)."""
    fan_in, _ = fans(shape)
    std = math.sqrt(2.0 / fan_in)
    return (generator(seed).standard_normal(shape) * std).astype(_float_dtype(dtype, "he_normal"))


def he_uniform(shape, dtype=np.float32, seed=None):
    """Uniform on ``[-l, l]`` with ``l = sqrt(6 / fan_in)`` (same variance as ``he_normal``)."""
    fan_in, _ = fans(shape)
    limit = math.sqrt(6.0 / fan_in)
    return generator(seed).uniform(-limit, limit, shape).astype(_float_dtype(dtype, "he_uniform"))


def xavier_normal(shape, dtype=np.float32, seed=None):
    """Normal with standard deviation ``sqrt(2 / (fan_in + fan_out))`` (Glorot & Bengio, 2010)."""
    fan_in, fan_out = fans(shape)
    std = math.sqrt(2.0 / (fan_in + fan_out))
    return (generator(seed).standard_normal(shape) * std).astype(
        _float_dtype(dtype, "xavier_normal"))


def xavier_uniform(shape, dtype=np.float32, seed=None):
    """Uniform on ``[-l, l]`` with ``l = sqrt(6 / (fan_in + fan_out))`` (Glorot & Bengio, 2010)."""
    fan_in, fan_out = fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return generator(seed).uniform(-limit, limit, shape).astype(
        _float_dtype(dtype, "xavier_uniform"))


def zeros(shape, dtype=np.float32, seed=None):
    """All zeros (biases). ``seed`` is accepted so every initialiser has one signature."""
    return np.zeros(tuple(int(s) for s in shape), _float_dtype(dtype, "zeros"))


def torch(shape, dtype=np.float32, seed=None):
    """torch's default for ``nn.Linear`` and ``nn.Conv*d`` weights: uniform on ``[-l, l]``
    with ``l = 1 / sqrt(fan_in)`` (``kaiming_uniform_(a=sqrt(5))``). A layer whose kernel
    starts this way starts its bias as torch's too (``bias_for``), so a ported program starts
    from torch's distribution."""
    fan_in, _ = fans(shape)
    limit = 1.0 / math.sqrt(fan_in)
    return generator(seed).uniform(-limit, limit, shape).astype(_float_dtype(dtype, "torch"))


def bias_for(kernel_initializer, fan_in, units, dtype=np.float32):
    """The bias a layer starts with beside ``kernel_initializer``: torch's uniform on
    ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` beside ``torch``'s kernel, else zeros."""
    if kernel_initializer is torch:
        limit = 1.0 / math.sqrt(fan_in)
        return generator().uniform(-limit, limit, units).astype(_float_dtype(dtype, "torch"))
    return zeros((units,), dtype)


INITIALIZERS = {f.__name__: f for f in (he_normal, he_uniform, xavier_normal, xavier_uniform,
                                        zeros, torch)}


def get(initializer):
    """An initialiser from its name or itself (a callable ``(shape, dtype) -> array``)."""
    if callable(initializer):
        return initializer
    if initializer in INITIALIZERS:
        return INITIALIZERS[initializer]
    raise ValueError(f"init: unknown initialiser {initializer!r}; expected a callable "
                     f"(shape, dtype) -> array or one of {sorted(INITIALIZERS)}")
