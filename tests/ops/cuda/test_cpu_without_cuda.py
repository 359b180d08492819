"""The base install has no numba-cuda (setup.cfg): the CPU path must import, train and save
without it, and asking for CUDA must name the extra that brings it."""
import subprocess
import sys

from tests.support.paths import REPO_ROOT

PROGRAM = r'''
import importlib.abc, sys
class NoCuda(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba_cuda", "cuda") or name.startswith("numba.cuda"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoCuda())
import engine
from engine import data, nn, optim
from engine.losses import cross_entropy
from engine.train import fit
x, y = data.blobs(64, centers=3, seed=0)
model = nn.Sequential([nn.Dense(8, activation="relu", input_shape=(2,)), nn.Dense(3)])
history = fit(model, data.DataLoader(x, y, batch_size=16), optim.Adam(model.parameters()),
              cross_entropy, 2, progress=False, verbose=False)
assert history[-1]["loss"] < history[0]["loss"]
model.save(sys.argv[1])
assert not engine.cuda_available()
try:
    engine.tensor([1.0], device="cuda")
except RuntimeError as error:
    print(error)
'''


def test_the_cpu_path_needs_no_numba_cuda(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "m.npz")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.npz").exists()
    assert "pip install -e '.[cuda]'" in done.stdout
