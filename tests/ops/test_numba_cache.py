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
