"""Backend injection (Chainer style): a test that takes ``device`` runs once per backend.

The ``cuda`` run is marked ``cuda`` and needs a GPU or Numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``, set before the process imports numba.cuda: CI runs
``pytest -m cuda`` a second time in its own process for that). ``gpu`` tests need real
hardware; ``torch`` tests need PyTorch.
"""
import importlib.util

import pytest

import engine
from ops import flag_buffer
from ops.device import SIMULATOR, cuda_available

HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and (SIMULATOR or not cuda_available()):
            item.add_marker(pytest.mark.skip(reason="needs a real CUDA GPU"))
        if "cuda" in item.keywords and not cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA: a GPU or NUMBA_ENABLE_CUDASIM=1"))
        if "torch" in item.keywords and not HAS_TORCH:
            item.add_marker(pytest.mark.skip(reason="needs PyTorch (pip install '.[torch]')"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with the same seed, poison off, an empty tape, and no input fault
    left flagged by an earlier test's deferred CUDA check (ops.flag_buffer)."""
    for words in flag_buffer._buffers.values():
        words.flagged()
    engine.manual_seed(0)
    with engine.debug.poison(engine.debug.is_poisoned()):
        yield
    engine.autograd.current_tape().nodes.clear()
