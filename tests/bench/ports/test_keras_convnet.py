"""Keras's "Simple MNIST convnet" (Conv2D 32, MaxPooling2D, Conv2D 64, MaxPooling2D, Flatten,
Dropout 0.5, Dense 10 softmax; categorical_crossentropy, adam, batch 128, validation_split
0.1) as ported in bench/ports/keras_convnet.py, run short: 384 MNIST samples, three epochs.
The full run: ``python -m bench.ports.keras_convnet``."""
import re

import engine
from data import mnist
from tests.support.paths import REPO_ROOT

PORT = REPO_ROOT / "bench" / "ports" / "keras_convnet.py"


def test_the_convnet_port_tracks_its_parameters_and_learns(monkeypatch, capsys):
    (x, y), _ = mnist.load()
    monkeypatch.setattr(mnist, "load", lambda: ((x[:384], y[:384]), (x[384:512], y[384:512])))
    source = PORT.read_text().replace("epochs = 15", "epochs = 3")
    engine.manual_seed(0)
    scope = {"__name__": "convnet_port"}
    exec(compile(source, str(PORT), "exec"), scope)
    model = scope["model"]
    assert sum(p.size for p in model.parameters()) == 34826   # Keras's summary: 34,826
    out = capsys.readouterr().out
    assert "Total params: 34,826" in out
    losses = [float(v) for v in re.findall(r"train loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert 0 <= scope["score"][1] <= 1
