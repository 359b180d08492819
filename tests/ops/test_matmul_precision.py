"""engine.set_float32_matmul_precision: torch's names, checked; nothing changes on the CPU; a
captured step records again under another precision; the CLI's --matmul-precision. The
tensor-core GEMMs themselves are tested on a GPU (tests/ops/cuda/test_tensor_core.py)."""
import numpy as np
import pytest

import engine
import optim
from engine import nn
from tests.support.training_step import cross_entropy_step


@pytest.fixture(autouse=True)
def _default_precision():
    yield
    engine.set_float32_matmul_precision("highest")


def test_the_default_is_highest_and_each_name_is_kept():
    assert engine.get_float32_matmul_precision() == "highest"
    for name in ("high", "medium", "highest"):
        engine.set_float32_matmul_precision(name)
        assert engine.get_float32_matmul_precision() == name


@pytest.mark.parametrize("bad", ["fast", "HIGH", None, 32])
def test_an_unknown_precision_is_refused_with_the_names(bad):
    with pytest.raises(ValueError, match="'highest' \\(float32\\), 'high' \\(TF32"):
        engine.set_float32_matmul_precision(bad)
    assert engine.get_float32_matmul_precision() == "highest"


def _trained_weights(precision, captured):
    engine.set_float32_matmul_precision(precision)
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(7, activation="relu", input_shape=(5,)), nn.Dense(3)])
    opt = optim.Adam(model.parameters(), lr=1e-2)
    step = cross_entropy_step(model, opt)
    step = engine.capture(step) if captured else step
    rng = np.random.default_rng(0)
    x = engine.tensor(rng.standard_normal((6, 5)).astype(np.float32))
    y = engine.tensor(rng.integers(0, 3, 6))
    for _ in range(4):
        step(x, y)
    return [p.numpy().copy() for p in model.parameters()]


def test_the_cpu_ignores_the_setting():
    highest = _trained_weights("highest", captured=False)
    for precision in ("high", "medium"):
        for got, want in zip(_trained_weights(precision, captured=False), highest):
            np.testing.assert_array_equal(got, want)


def test_a_captured_step_records_again_under_another_precision():
    engine.manual_seed(0)
    model = nn.Sequential([nn.Dense(4, input_shape=(3,))])
    opt = optim.SGD(model.parameters(), lr=0.1)
    step = engine.capture(cross_entropy_step(model, opt))
    x = engine.tensor(np.ones((2, 3), np.float32))
    y = engine.tensor(np.array([0, 1]))
    for _ in range(3):
        step(x, y)
    assert step.recordings == 1
    engine.set_float32_matmul_precision("high")
    for _ in range(3):
        step(x, y)
    assert step.recordings == 2   # recorded under "high": its kernels may differ
    engine.set_float32_matmul_precision("highest")
    replayed = step.replayed
    step(x, y)
    assert step.recordings == 2 and step.replayed == replayed + 1   # the first one again


def test_the_command_sets_the_precision_and_refuses_an_unknown_one(capsys):
    from engine.train import main
    tiny = ["--limit", "64", "--epochs", "1", "--batch-size", "32", "--hidden", "8",
            "--no-progress", "--no-save", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:
        main(tiny + ["--matmul-precision", "fast"])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "unknown --matmul-precision 'fast'" in lines[0], lines
    main(tiny + ["--matmul-precision", "high"])
    assert engine.get_float32_matmul_precision() == "high"
