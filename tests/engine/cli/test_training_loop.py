"""The training command's --accumulate and --augment: they train, resume bit for bit, and
bad values are one line before training."""
import numpy as np
import pytest

from engine.checkpoint import read_checkpoint
from engine.train import main

TINY = ["--epochs", "1", "--limit", "256", "--hidden", "16", "--device", "cpu", "--no-progress"]


def _weights(path):
    return read_checkpoint(path)["model"]


@pytest.mark.parametrize("flags", [["--augment", "shift"], ["--augment", "crop=3,flip"],
                                   ["--accumulate", "3"]])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, capsys, flags):
    straight, resumed = str(tmp_path / "straight.npz"), str(tmp_path / "resumed.npz")
    main(TINY + flags + ["--epochs", "2", "--save", straight])
    main(TINY + flags + ["--save", resumed])
    main(TINY + flags + ["--epochs", "2", "--resume", resumed])
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert "epoch 2/2" in capsys.readouterr().out


def test_augmentation_changes_the_training(tmp_path, capsys):
    plain, shifted = str(tmp_path / "plain.npz"), str(tmp_path / "shifted.npz")
    main(TINY + ["--save", plain])
    main(TINY + ["--augment", "shift", "--save", shifted])
    a, b = _weights(plain), _weights(shifted)
    assert any(not np.array_equal(a[name], b[name]) for name in a)


def test_resuming_with_another_augmentation_is_refused(tmp_path, capsys):
    path = str(tmp_path / "run.npz")
    main(TINY + ["--augment", "shift", "--save", path])
    with pytest.raises(SystemExit):
        main(TINY + ["--epochs", "2", "--resume", path])
    assert "trained with" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--accumulate", "0"], "--accumulate must be a positive integer, got 0"),
    (["--augment", "twirl"], "unknown augmentation 'twirl'"),
    (["--augment", "flip=3"], "flip takes no number"),
    (["--augment", "shift=-1"], "needs a whole number of pixels >= 0"),
])
def test_bad_values_are_one_line(capsys, flags, words):
    with pytest.raises(SystemExit) as stop:
        main(TINY + ["--no-save"] + flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and len(err.strip().splitlines()) == 1
