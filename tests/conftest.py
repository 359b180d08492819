"""Backend injection (Chainer style): a test that takes ``device`` runs once per backend.

The ``cuda`` run is marked ``cuda`` and needs a GPU or Numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``, set before the process imports numba.cuda: CI runs
``pytest -m cuda`` a second time in its own process for that). ``gpu`` tests need real
hardware; ``torch`` tests need PyTorch. In the simulator, the CUDA tests listed in
``tests/simulator_repeats.txt`` are skipped (they reach no kernel line or branch that the
others miss; a real GPU runs them). Every run ends with a count of its skips by reason.
"""
import collections
import importlib.util
import os

import pytest

import engine
from ops import flag_buffer
from ops.device import SIMULATOR, cuda_available
from tests.support import simulator_threads
from tests.support.simulator_repeats import simulator_repeats

HAS_TORCH = importlib.util.find_spec("torch") is not None
if SIMULATOR:   # a short switch interval, shared arrays under a lock (the module says why)
    simulator_threads.configure()


def pytest_collection_modifyitems(config, items):
    # ENGINE_SIMULATE_ALL=1 runs them too, to remake the list (.ci/simulator_selection.py)
    repeats = (simulator_repeats() if SIMULATOR and not os.environ.get("ENGINE_SIMULATE_ALL")
               else set())
    for item in items:
        if item.get_closest_marker("gpu") and (SIMULATOR or not cuda_available()):
            item.add_marker(pytest.mark.skip(reason="needs a real CUDA GPU (-m gpu on a GPU "
                                                    "machine)"))
        if item.get_closest_marker("cuda") and not cuda_available():
            item.add_marker(pytest.mark.skip(reason="a CUDA test: runs in the simulator phase "
                                                    "(NUMBA_ENABLE_CUDASIM=1 pytest -m cuda) "
                                                    "or on a GPU"))
        if item.get_closest_marker("cuda") and item.nodeid in repeats:
            item.add_marker(pytest.mark.skip(reason="repeats kernel branches that other "
                                                    "simulator tests reach "
                                                    "(tests/simulator_repeats.txt); a real "
                                                    "GPU runs it"))
        if item.get_closest_marker("torch") and not HAS_TORCH:
            item.add_marker(pytest.mark.skip(reason="needs PyTorch (pip install -e '.[torch]')"))


def pytest_terminal_summary(terminalreporter):
    """One line per reason, with its count: why tests were skipped (``-rs`` lists each)."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", f"{sum(reasons.values())} skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")


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
