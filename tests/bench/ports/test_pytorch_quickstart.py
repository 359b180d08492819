"""PyTorch's Quickstart as ported in bench/ports/pytorch_quickstart.py (the tutorial but for its
five imports: its model class, torchvision-style Fashion-MNIST, SGD lr 1e-3,
CrossEntropyLoss), run short on MNIST as ``bench.ports.quickstart_on_mnist`` runs it here
(no Fashion-MNIST, no network): 320 samples, two epochs. The full run:
``python -m bench.ports.quickstart_on_mnist``."""
import re

import engine
from bench.ports import quickstart_on_mnist
from data import mnist


def test_the_quickstart_port_tracks_its_parameters_and_learns(monkeypatch, capsys):
    (x, y), _ = mnist.load()
    monkeypatch.setattr(mnist, "load", lambda: ((x[:320], y[:320]), (x[:320], y[:320])))
    engine.manual_seed(0)
    scope = quickstart_on_mnist.run(epochs=2, scope={"__name__": "quickstart_port"})
    assert len(scope["training_data"]) == 320 and type(scope["test_data"]).__name__ == "MNIST"
    model = scope["model"]
    assert [name for name, _ in model.named_parameters()] == [
        f"linear_relu_stack.{layer}.{kind}" for layer in ("linear", "linear_1", "linear_2")
        for kind in ("weight", "bias")]
    assert sum(p.size for p in model.parameters()) == 784 * 512 + 512 + 512 * 512 + 512 + 5130
    losses = [float(v) for v in re.findall(r"Avg loss: ([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_the_port_reads_fashion_mnist_as_the_tutorial_does():
    port = quickstart_on_mnist.PORT.read_text()
    assert port.count('datasets.FashionMNIST(root="data", train=') == 2
    assert quickstart_on_mnist.source_on_mnist().count("datasets.MNIST(") == 2
