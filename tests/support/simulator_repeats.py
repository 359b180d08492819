"""The CUDA tests the simulator phase skips: ``tests/simulator_repeats.txt`` (every CUDA
kernel line and branch they reach in the simulator, the simulator tests left in reach too;
``.ci/simulator_selection.py`` made it and says how)."""
from tests.support.paths import REPO_ROOT

SIMULATOR_REPEATS = REPO_ROOT / "tests" / "simulator_repeats.txt"


def simulator_repeats():
    """The test ids listed in ``SIMULATOR_REPEATS`` (one a line; ``#`` starts a comment)."""
    with open(SIMULATOR_REPEATS) as listing:
        return {line.split("#")[0].strip() for line in listing} - {""}
