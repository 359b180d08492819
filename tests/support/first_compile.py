"""A program's first compile, from an empty Numba cache, in a process of its own: where a
kernel's Numba IR once made Numba print its NumbaIRAssumptionWarning ("please report")."""
import os
import subprocess
import sys

from tests.support.paths import REPO_ROOT


def assert_first_compile_is_quiet(code, cache_dir):
    """Run ``code`` (Python source) with ``cache_dir`` as Numba's empty cache: it succeeds,
    and Numba warns of no IR assumption."""
    environment = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "always"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "NumbaIRAssumptionWarning" not in result.stderr
