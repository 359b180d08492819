"""Where Numba's on-disk cache of compiled kernels goes: a user cache folder,
``$XDG_CACHE_HOME/numba-engine/numba`` (``~/.cache`` when unset), not ``__pycache__`` beside
the engine's sources, which an install must leave clean (a source tree gained 15 cache files
after one training run). ``NUMBA_CACHE_DIR`` set by the user wins. Numba keys each entry by
its source file's full path, so several checkouts share the folder without collisions."""
import os
import sys

VARIABLE = "NUMBA_CACHE_DIR"


def default_folder():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba-engine", "numba")


def apply_default():
    """Point Numba's cache at ``default_folder()`` unless ``NUMBA_CACHE_DIR`` is set; a
    folder that cannot be made leaves Numba's own choice."""
    if os.environ.get(VARIABLE):
        return
    folder = default_folder()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return
    os.environ[VARIABLE] = folder   # child processes (the benchmarks' workers) share it
    config = sys.modules.get("numba.core.config")
    if config is not None:   # Numba was imported first: its setting is read per cache lookup
        config.CACHE_DIR = folder
