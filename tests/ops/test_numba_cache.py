"""Numba's cache goes to a user cache folder, not beside the sources; NUMBA_CACHE_DIR wins."""
import os
import pathlib
import subprocess
import sys

from tests.support.paths import REPO_ROOT

# Numba imported before the engine, as a user's program may do: its setting still moves
PROGRAM = ("from numba.core import config; import engine, numpy as np; "
           "(engine.tensor(np.ones(3)) * 2).numpy(); print(config.CACHE_DIR)")


def _run(tmp_path, **variables):
    environment = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    environment.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(REPO_ROOT), **variables)
    return subprocess.run([sys.executable, "-c", PROGRAM], env=environment, cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_cache_goes_to_the_user_cache_folder(tmp_path):
    folder = _run(tmp_path)
    assert folder == str(tmp_path / "xdg" / "numba-engine" / "numba")
    assert list(pathlib.Path(folder).rglob("*.nbi")), "no kernel was cached there"


def test_numba_cache_dir_wins(tmp_path):
    assert _run(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "mine")) == str(tmp_path / "mine")


def _cached_dispatchers():
    """Every cached ``@njit`` dispatcher of the engine's modules (module globals, and those
    inside Kernels, dicts, tuples and lists there), by name."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher
    from numba.core.caching import NullCache

    import ops
    import optim
    found = {}

    def visit(value, depth=0):
        if isinstance(value, Dispatcher):
            if not isinstance(value._cache, NullCache):
                found[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = value
            return
        if depth < 3:
            if isinstance(value, dict):
                children = value.values()
            elif isinstance(value, (tuple, list)):
                children = value
            else:
                children = [getattr(value, name, None) for name in ("cpu", "__wrapped__")]
            for child in children:
                visit(child, depth + 1)

    for package in (ops, optim):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".cuda" in info.name:
                continue
            module = importlib.import_module(info.name)
            for value in list(vars(module).values()):
                visit(value)
    return found


def test_no_cached_kernel_closes_over_a_compiled_function():
    """Numba's cache keys a closure's kernel by the pickle of its closure's values, and a
    compiled function pickles with a fresh id in each process: a kernel that closes over one
    is compiled again in every process (the CNN's average pool did: 4.2 s of every first
    step with a warm cache). Kernels close over ints and bools; helpers are module
    functions."""
    from numba.core.dispatcher import Dispatcher
    dispatchers = _cached_dispatchers()
    assert len(dispatchers) > 50   # the walk finds the kernels
    offenders = sorted(name for name, dispatcher in dispatchers.items()
                       if any(isinstance(cell.cell_contents, Dispatcher)
                              for cell in dispatcher.py_func.__closure__ or ()))
    assert not offenders, f"kernels closing over a compiled function: {offenders}"
