"""PyTorch's Quickstart model class (nn.Module with Flatten and a Sequential of Linear and ReLU,
SGD lr 1e-3, CrossEntropyLoss) as ported in bench/ports/pytorch_quickstart.py, run short: 320
MNIST samples, two epochs. The full run: ``python -m bench.ports.pytorch_quickstart``."""
import re

import engine
from data import mnist
from tests.support.paths import REPO_ROOT

PORT = REPO_ROOT / "bench" / "ports" / "pytorch_quickstart.py"


def test_the_quickstart_port_tracks_its_parameters_and_learns(monkeypatch, capsys):
    (x, y), _ = mnist.load()
    monkeypatch.setattr(mnist, "load", lambda: ((x[:320], y[:320]), (x[:320], y[:320])))
    source = PORT.read_text().replace("epochs = 5", "epochs = 2")
    engine.manual_seed(0)
    scope = {"__name__": "quickstart_port"}
    exec(compile(source, str(PORT), "exec"), scope)
    model = scope["model"]
    assert [name for name, _ in model.named_parameters()] == [
        f"linear_relu_stack.{layer}.{kind}" for layer in ("linear", "linear_1", "linear_2")
        for kind in ("weight", "bias")]
    assert sum(p.size for p in model.parameters()) == 784 * 512 + 512 + 512 * 512 + 512 + 5130
    losses = [float(v) for v in re.findall(r"Avg loss: ([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) == 2 and losses[1] < losses[0]
