"""One seeded generator for every initialiser, Dropout and ``randn``: same seed, same model."""
import numpy as np

_generator = np.random.default_rng()


def manual_seed(seed):
    """Seed the engine's generator (initialisers, Dropout masks, ``randn``)."""
    global _generator
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"manual_seed: seed must be a non-negative integer, got {seed!r}")
    _generator = np.random.default_rng(int(seed))


def generator(seed=None):
    """The engine's generator, or a fresh one for an explicit ``seed``."""
    return _generator if seed is None else np.random.default_rng(seed)
