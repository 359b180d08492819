"""The training command (``python -m engine.train``) run inside the test's process."""
import pytest

from engine.train import main

# a run of a second or two: 192 MNIST samples, one epoch of 3 batches, a hidden layer of 16
TINY = ["--limit", "192", "--epochs", "1", "--batch-size", "64", "--hidden", "16",
        "--no-progress"]


def run_main(argv, capsys):
    """``(exit status, captured output)`` of a command that exits (a refusal, an error, a
    stop), which ``main`` signals with ``SystemExit``."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr()
